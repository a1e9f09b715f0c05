"""The GPU embedding pool (`[cache] device_pool`): a slot of one process's CUDA pool, named by a TensorRef
that crossed the wire, written by another process, seen by the owner; and its spill tier in host memory.
Needs a CUDA GPU (skipped otherwise); results of GPU runs are recorded under benchmarks/results/."""

from __future__ import annotations

import multiprocessing as mp
import shutil
import tempfile

import pytest
import torch

from common.config import Config
from common.protocol import CacheLookup, TensorRef, decode, encode
from common.tensor_ref import CudaPool, ShmAttachments, gather_rows

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


def test_a_full_gpu_pool_spills_to_the_host_tier_and_answers_from_there() -> None:
    from workers.cache.daemon import CacheDaemon

    cfg = Config()
    cfg.run_dir = tempfile.mkdtemp(prefix="vlm-spill-")  # short: it holds the daemon's ipc:// socket
    cfg.cache.device_pool, cfg.cache.pool_bytes, cfg.cache.spill_bytes = True, 1 << 16, 1 << 18
    daemon = CacheDaemon(cfg)
    views = ShmAttachments()
    views.pools[daemon.pool.name] = daemon.pool  # the owner's own map: CUDA opens no IPC handle in its exporter
    try:
        nbytes = 1 << 15  # two fit the GPU pool
        for i in range(3):
            reply = daemon.lookup(CacheLookup(f"c{i}", f"h{i}", nbytes, "uint8", [nbytes]))
            assert reply.state == "reserved" and reply.slot is not None and reply.slot.kind == "cuda_ipc"
            slot = views.view(reply.slot)
            slot.fill_(i + 1)
            torch.cuda.synchronize()
            daemon.store.commit(f"h{i}")
        # the third reservation took h0's bytes; h0 moved to the host tier first, and is still a hit
        moved = daemon.lookup(CacheLookup("c3", "h0", nbytes, "uint8", [nbytes]))
        assert moved.state == "ready" and moved.slot is not None and moved.slot.kind == "shm"
        assert torch.all(views.view(moved.slot) == 1)
        kept = daemon.lookup(CacheLookup("c4", "h1", nbytes, "uint8", [nbytes]))
        assert kept.slot is not None and kept.slot.kind == "cuda_ipc" and torch.all(views.view(kept.slot) == 2)
        assert daemon.store.counters["spills"] == 1 and daemon.store.counters["evictions"] == 0
        rows = gather_rows([moved.slot, kept.slot], views)  # one request's rows from both tiers, as the decoder
        assert rows.is_cuda and rows[:nbytes].eq(1).all() and rows[nbytes:].eq(2).all()
    finally:
        if daemon.spill is not None:
            daemon.spill.unlink()
        daemon.channel.close()
        shutil.rmtree(cfg.run_dir, ignore_errors=True)
