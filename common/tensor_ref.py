"""Tensors across processes: inline bytes, an offset in a POSIX shared-memory pool, or an offset in a GPU
pool another process owns (CUDA IPC: the embeddings then never leave the GPU).

Pools are plain files under /dev/shm mapped with mmap. We avoid
``multiprocessing.shared_memory`` because on Python 3.11 every process that merely attaches
registers the segment with its resource tracker, which unlinks it when that process exits —
an encoder restart would then delete the cache daemon's pool.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from common.protocol import CudaIpcHandle, TensorRef

if TYPE_CHECKING:  # torch only inside the functions that use it: importing common loads no torch
    import torch

SHM_DIR = Path("/dev/shm")

_DTYPE_NAMES = frozenset({"float32", "float16", "bfloat16", "int64", "int32", "uint8"})


def torch_dtype(name: str) -> torch.dtype:
    import torch

    if name not in _DTYPE_NAMES:
        raise ValueError(f"unsupported tensor dtype {name!r}")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:

    return str(dtype).removeprefix("torch.")


def nbytes_of(dtype: str, shape: list[int]) -> int:
    import torch

    return int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=torch_dtype(dtype)).element_size()


def inline_ref(tensor: torch.Tensor) -> TensorRef:
    import torch

    tensor = tensor.detach().contiguous().cpu()
    raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return TensorRef(kind="inline", dtype=dtype_name(tensor.dtype), shape=list(tensor.shape), data=raw)


class ShmPool:
    """A fixed-size shared-memory region; the cache daemon creates it, others attach by name."""

    def __init__(self, name: str, size: int, *, create: bool) -> None:
        import torch

        self.name = name
        self.path = SHM_DIR / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.size = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.buffer = torch.frombuffer(self.map, dtype=torch.uint8) if self.size else torch.empty(0)

    def view(self, ref: TensorRef) -> torch.Tensor:
        """A tensor aliasing the pool bytes that ``ref`` names (no copy)."""
        nbytes = nbytes_of(ref.dtype, ref.shape)
        if ref.offset < 0 or ref.offset + nbytes > self.size:
            raise ValueError(f"tensor ref [{ref.offset}, +{nbytes}) is outside pool {self.name} of {self.size} B")
        raw = self.buffer[ref.offset : ref.offset + nbytes]
        return raw.view(torch_dtype(ref.dtype)).view(ref.shape)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        import torch

        # Tensors made by view() may still alias the map; let GC close it when they are gone.
        self.buffer = torch.empty(0)


class CudaPool:
    """A byte pool in GPU memory: the owner allocates it and publishes `handle`; other processes map it
    once (`attach`) and index it by offset, as with `ShmPool`. Through torch's own CUDA IPC (the
    mechanism `torch.multiprocessing` uses), so the mapping is reference-counted the way torch expects."""

    def __init__(self, buffer: torch.Tensor, name: str) -> None:
        self.buffer, self.name = buffer, name
        self.size = buffer.numel()

    @classmethod
    def create(cls, name: str, size: int, device: torch.device) -> CudaPool:
        import torch

        return cls(torch.zeros(size, dtype=torch.uint8, device=device), name)

    def handle(self) -> CudaIpcHandle:
        return CudaIpcHandle(*self.buffer.untyped_storage()._share_cuda_())

    @classmethod
    def attach(cls, name: str, handle: CudaIpcHandle) -> CudaPool:
        import torch

        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            handle.device,
            handle.handle,
            handle.size,
            handle.storage_offset,
            handle.ref_counter,
            handle.ref_counter_offset,
            handle.event,
            handle.event_sync,
        )
        buffer = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", handle.device)).set_(storage)
        return cls(buffer, name)

    def view(self, ref: TensorRef) -> torch.Tensor:
        nbytes = nbytes_of(ref.dtype, ref.shape)
        if ref.offset < 0 or ref.offset + nbytes > self.size:
            raise ValueError(f"tensor ref [{ref.offset}, +{nbytes}) is outside pool {self.name} of {self.size} B")
        return self.buffer[ref.offset : ref.offset + nbytes].view(torch_dtype(ref.dtype)).view(ref.shape)

    def close(self) -> None:
        import torch

        self.buffer = torch.empty(0, dtype=torch.uint8)


class ShmAttachments:
    """A consumer's open pools, by name: each pool is attached once and then indexed by offset."""

    def __init__(self) -> None:
        self.pools: dict[str, ShmPool | CudaPool] = {}

    def view(self, ref: TensorRef) -> torch.Tensor:
        pool = self.pools.get(ref.shm_name)
        if pool is None:
            if ref.kind == "cuda_ipc":
                if ref.cuda is None:
                    raise ValueError("a cuda_ipc tensor ref without its pool handle")
                pool = CudaPool.attach(ref.shm_name, ref.cuda)
            else:
                pool = ShmPool(ref.shm_name, 0, create=False)
            self.pools[ref.shm_name] = pool
        return pool.view(ref)

    def forget_except(self, keep: str) -> None:
        """Drop attachments of pools other than ``keep`` (a restarted cache made a new pool)."""
        for name in [n for n in self.pools if n != keep]:
            self.pools.pop(name).close()


def read_tensor(ref: TensorRef, attachments: ShmAttachments | None = None) -> torch.Tensor:
    """Materialise a ref as a tensor: inline refs are copied, shm refs alias the pool."""
    import torch

    if ref.kind == "inline":
        if ref.data is None:
            raise ValueError("inline tensor ref without data")
        expected = nbytes_of(ref.dtype, ref.shape)
        if len(ref.data) != expected:
            raise ValueError(f"inline tensor has {len(ref.data)} B, shape {ref.shape} needs {expected}")
        flat = torch.frombuffer(bytearray(ref.data), dtype=torch.uint8) if expected else torch.empty(0)
        return flat.view(torch_dtype(ref.dtype)).view(ref.shape)
    if ref.kind in ("shm", "cuda_ipc"):
        if attachments is None:
            raise ValueError(f"a {ref.kind} tensor ref needs pool attachments")
        return attachments.view(ref)
    raise ValueError(f"unsupported tensor ref kind {ref.kind!r}")


def gather_rows(refs: list[TensorRef], attachments: ShmAttachments, dim: int = 0) -> torch.Tensor:
    """The rows of several refs as one new tensor (a copy: the pools may reuse their bytes once it is
    made), on the GPU if any ref is in a GPU pool: with a spill tier, one request's embeddings can be
    partly in the GPU pool and partly in host memory. ``dim``: the rows' axis (1 for entries of several
    feature sets, [sets, rows, hidden])."""
    import torch

    parts = [read_tensor(ref, attachments) for ref in refs]
    device = next((part.device for part in parts if part.is_cuda), parts[0].device)
    return torch.cat([part.to(device) for part in parts], dim=dim)
