"""Paged attention over the flat KV slots: one launch for a whole batch of prefill chunks and decodes.

`paged_attention` has the `PagedAttention` signature of `workers.models.paged`, so it plugs into
``paged_forward(..., attention=paged_attention)``. On CUDA tensors (with triton installed) it launches the
Triton kernel in `attention_triton`; otherwise it is `paged_attention_reference`. `paged_attention_triton`
launches the kernel on any device (Triton's interpreter on CPU tensors), for tests and benchmarks.

The kernel reads per-sequence metadata as int32 tensors (`AttentionMetadata`); they are built from the
`BatchLayout` once per forward step and reused by every layer.
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from workers.kernels._launch import use_triton

if TYPE_CHECKING:  # workers.models.paged imports this package's kernels: import it lazily here
    from workers.models.paged import BatchLayout

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionMetadata:
    """int32 per-sequence tensors on the kernel's device, plus the host-side sizes that pick the launch.

    ``block_table`` is [num_seqs, max blocks] padded with -1 (as `BatchLayout.block_table_tensor`); the
    kernel never reads an entry past a sequence's context.
    """

    query_starts: torch.Tensor  # [num_seqs + 1], cu_seqlens of the flat queries
    query_lens: torch.Tensor  # [num_seqs]
    context_lens: torch.Tensor  # [num_seqs]
    block_table: torch.Tensor  # [num_seqs, max blocks]
    num_tokens: int
    max_query_len: int
    max_context_len: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return self.query_lens.shape[0]

    @property
    def device(self) -> torch.device:
        return self.query_lens.device

    @functools.cached_property
    def context_total(self) -> torch.Tensor:
        """int32 [1]: the batch's keys in all, summed on the device once for every layer of a step (in a
        captured graph, once per replay): balanced decode splits are cut from it."""
        return self.context_lens.sum(dtype=torch.int32).view(1)

    @classmethod
    def from_layout(cls, layout: BatchLayout, device: torch.device | str | None = None) -> AttentionMetadata:
        device = torch.device(device) if device is not None else layout.device
        b = layout.num_seqs
        width = max(len(t) for t in layout.block_tables)
        tables = [t + [-1] * (width - len(t)) for t in layout.block_tables]
        # One int32 tensor built on the host and moved in one copy, then viewed as its four parts: a step
        # pays for one small host-to-device transfer instead of four.
        flat = [*layout.query_starts, *layout.query_lens, *layout.context_lens, *(b for t in tables for b in t)]
        packed = torch.tensor(flat, dtype=torch.int32).to(device)
        starts, lens, ctx, table = torch.split(packed, [b + 1, b, b, b * width])
        return cls(
            query_starts=starts,
            query_lens=lens,
            context_lens=ctx,
            block_table=table.view(b, width),
            num_tokens=layout.num_tokens,
            max_query_len=max(layout.query_lens),
            max_context_len=max(layout.context_lens),
            block_size=layout.block_size,
        )


class _MetadataCache:
    """The metadata of the last layout seen, so that the layers of one step build it once.

    Keyed by the layout object itself (held weakly): a `BatchLayout` is frozen, so the same object always
    describes the same batch, and a new step brings a new object.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entry: tuple[weakref.ref[BatchLayout], torch.device, AttentionMetadata] | None = None

    def get(self, layout: BatchLayout, device: torch.device) -> AttentionMetadata:
        with self._lock:
            entry = self._entry
            if entry is not None and entry[0]() is layout and entry[1] == device:
                return entry[2]
        metadata = AttentionMetadata.from_layout(layout, device)
        with self._lock:
            self._entry = (weakref.ref(layout), device, metadata)
        return metadata


_metadata_cache = _MetadataCache()


def attention_metadata(layout: BatchLayout, device: torch.device | str | None = None) -> AttentionMetadata:
    """`AttentionMetadata` for ``layout`` on ``device`` (default: the layout's), built once per layout object."""
    return _metadata_cache.get(layout, torch.device(device) if device is not None else layout.device)


def paged_attention_reference(
    q: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor, layout: BatchLayout | AttentionMetadata, scale: float
) -> torch.Tensor:
    """The plain-torch contract (`workers.models.paged.paged_attention_reference`)."""
    from workers.models.paged import paged_attention_reference as reference

    return reference(q, kv_k, kv_v, layout, scale)


def paged_attention(
    q: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor, layout: BatchLayout | AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal GQA attention of q [T, heads, D] over each sequence's slots in kv_k/kv_v [slots, kv_heads, D].

    Triton on CUDA tensors, the reference otherwise; see `paged_attention_reference` for the contract.
    """
    if use_triton(q, kv_k, kv_v):
        return paged_attention_triton(q, kv_k, kv_v, layout, scale)
    return paged_attention_reference(q, kv_k, kv_v, layout, scale)


def paged_attention_triton(
    q: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    layout: BatchLayout | AttentionMetadata,
    scale: float,
    *,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    tiles: object = None,
) -> torch.Tensor:
    """Launch the Triton kernel on q's device (interpreted on CPU). The keywords override the heuristics
    (``tiles``: an `attention_triton.Tiles`, typed loosely here because that module imports triton)."""
    from workers.kernels import attention_triton

    metadata = layout if isinstance(layout, AttentionMetadata) else attention_metadata(layout, q.device)
    check_inputs(q, kv_k, kv_v, metadata)
    return attention_triton.launch(q, kv_k, kv_v, metadata, scale, num_splits, block_m, block_n, tiles)


def check_inputs(q: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor, metadata: AttentionMetadata) -> None:
    """ValueError for inputs the kernel cannot take (it would read out of bounds instead of failing)."""
    if q.ndim != 3 or kv_k.ndim != 3 or kv_v.shape != kv_k.shape:
        raise ValueError(
            f"q must be [T, heads, D] and kv_k, kv_v [slots, kv_heads, D] alike, got {tuple(q.shape)}, "
            f"{tuple(kv_k.shape)}, {tuple(kv_v.shape)}"
        )
    tokens, heads, head_dim = q.shape
    slots, kv_heads, kv_dim = kv_k.shape
    if kv_dim != head_dim:
        raise ValueError(f"q's head_dim {head_dim} != the cache's {kv_dim}")
    if heads % kv_heads:
        raise ValueError(f"kv_heads ({kv_heads}) must divide heads ({heads})")
    if tokens != metadata.num_tokens:
        raise ValueError(f"q has {tokens} tokens, the layout {metadata.num_tokens}")
    if not q.dtype == kv_k.dtype == kv_v.dtype or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"q, kv_k, kv_v must share one of {SUPPORTED_DTYPES}, got {q.dtype}, {kv_k.dtype}, {kv_v.dtype}"
        )
    if not q.device == kv_k.device == kv_v.device == metadata.device:
        raise ValueError(
            f"q, kv_k, kv_v and the metadata must be on one device, got {q.device}, {kv_k.device}, "
            f"{kv_v.device}, {metadata.device}"
        )
    if q.stride(-1) != 1 or kv_k.stride(-1) != 1 or kv_v.stride(-1) != 1:
        raise ValueError("q, kv_k and kv_v must be contiguous in head_dim")
    if slots % metadata.block_size:
        raise ValueError(f"the cache's {slots} slots are not whole blocks of {metadata.block_size}")
    if head_dim > 256:
        raise ValueError(f"head_dim {head_dim} > 256 is not supported")
