"""The GPU embedding pool (`[cache] device_pool`): a slot of one process's CUDA pool, named by a TensorRef
that crossed the wire, written by another process, seen by the owner. Needs a CUDA GPU (skipped
otherwise; not yet run: written when no GPU time was left)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from common.protocol import TensorRef, decode, encode
from common.tensor_ref import CudaPool, ShmAttachments

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def write_slot(frame: bytes, value: float) -> None:
    ref = decode(frame)
    assert isinstance(ref, TensorRef)
    slot = ShmAttachments().view(ref)
    slot.copy_(torch.full(tuple(ref.shape), value, dtype=slot.dtype, device=slot.device))
    torch.cuda.synchronize(slot.device)


def test_a_slot_written_by_another_process_through_the_wire_ref() -> None:
    pool = CudaPool.create("vlm-test-cuda-pool", 1 << 20, torch.device("cuda", 0))
    ref = TensorRef("cuda_ipc", "bfloat16", [16, 64], shm_name=pool.name, offset=4096, cuda=pool.handle())
    process = mp.get_context("spawn").Process(target=write_slot, args=(encode(ref), 3.0))
    process.start()
    process.join(120)
    assert process.exitcode == 0
    assert torch.all(pool.view(ref) == 3.0)
    assert int(pool.buffer[:4096].count_nonzero()) == 0 and int(pool.buffer[4096 + 16 * 64 * 2 :].count_nonzero()) == 0
