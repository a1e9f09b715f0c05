"""The embedding pool's size when left at "auto" (common.memory), from injected totals."""

from __future__ import annotations

from pathlib import Path

from common.config import Config
from common.memory import GIB, MIB, HostMemory, device_pool_bytes, host_memory, host_pool_bytes, pool_plan

H200 = 143_771 * MIB


def test_the_gpu_pool_is_a_thirty_second_of_the_gpu_within_bounds() -> None:
    size = device_pool_bytes(0, H200)
    assert size.nbytes == H200 // 32 and 4 * GIB < size.nbytes < 5 * GIB
    assert size.rule == "auto: 1/32 of the GPU's 140.4 GiB, within 1.0 GiB..8.0 GiB"
    assert device_pool_bytes(0, 24 * GIB).nbytes == 1 * GIB  # at least 1 GiB
    assert device_pool_bytes(0, 4 * GIB).nbytes == GIB // 2  # never over 1/8 of a small GPU
    assert device_pool_bytes(0, 640 * GIB).nbytes == 8 * GIB  # at most 8 GiB
    assert device_pool_bytes(3 * GIB, H200) == device_pool_bytes(3 * GIB, 1)  # a configured size wins
    assert device_pool_bytes(3 * GIB, H200).rule == "[cache] pool_bytes"


def test_the_host_pool_fits_memory_and_dev_shm() -> None:
    assert host_pool_bytes(0, HostMemory(available=100 * GIB, shm_free=64 * GIB)).nbytes == 4 * GIB  # the cap
    assert host_pool_bytes(0, HostMemory(available=8 * GIB, shm_free=64 * GIB)).nbytes == 2 * GIB  # 1/4 available
    assert host_pool_bytes(0, HostMemory(available=100 * GIB, shm_free=64 * MIB)).nbytes == 32 * MIB  # Docker's shm
    rule = host_pool_bytes(0, HostMemory(8 * GIB, 64 * MIB)).rule
    assert rule == "auto: min(1/4 of 8.0 GiB available, 1/2 of 64 MiB free in /dev/shm, 4.0 GiB)"
    assert host_pool_bytes(16 * MIB, HostMemory(0, 0)).nbytes == 16 * MIB


def test_the_plan_names_where_the_pool_lives_and_its_spill_tier() -> None:
    cfg, host = Config(), HostMemory(available=100 * GIB, shm_free=64 * GIB)
    plan = pool_plan(cfg, 0, host)
    assert (plan.pool.nbytes, plan.spill.nbytes, plan.device) == (4 * GIB, 0, "shared memory")
    assert plan.describe().startswith("embedding pool 4.0 GiB in shared memory (auto: min(1/4 of 100.0 GiB")
    cfg.cache.device_pool = True  # spill_bytes set (0: none) unless the file left it to "auto"
    plan = pool_plan(cfg, H200, host)
    assert (plan.pool.nbytes, plan.spill.nbytes, plan.device) == (H200 // 32, 0, "cuda:0")
    cfg.auto = frozenset({"cache.spill_bytes"})
    plan = pool_plan(cfg, H200, host)
    assert plan.spill.nbytes == 8 * GIB
    assert plan.describe() == (
        "embedding pool 4.4 GiB in cuda:0 (auto: 1/32 of the GPU's 140.4 GiB, within 1.0 GiB..8.0 GiB), spill tier "
        "8.0 GiB in shared memory (auto: min(1/4 of 100.0 GiB available, 1/2 of 64.0 GiB free in /dev/shm, 8.0 GiB))"
    )


def test_host_memory_reads_meminfo_and_dev_shm(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:         1000 kB\nMemAvailable:    8000000 kB\n")
    host = host_memory(meminfo, tmp_path)
    assert host.available == 8_000_000 * 1024 and host.shm_free > 0
    assert host_memory(tmp_path / "missing", tmp_path / "missing").shm_free == 0
