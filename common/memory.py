"""How large the embedding pool and its host spill tier are, from the machine's memory when left at "auto".

The rules are pure functions of the totals they are given, so they are tested with any machine's numbers; the
probes below them read the host without torch (``/proc/meminfo``, ``os.statvfs``). The GPU's total memory comes
from the processes that already hold torch: the cache daemon, which allocates the pool, and the decoder, whose
KV cache leaves the pool's bytes on GPU 0 (`device_pool_bytes` gives both the same answer).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from common.config import Config

GIB = 2**30
MIB = 2**20

# GPU pool: 1/32 of the GPU. The pool holds the embeddings of every request in flight plus the LRU of earlier
# ones that a conversation's next turn hits; a few GiB held a 32-client three-image load with its later turns,
# and 1/32 of a large GPU is that while leaving the KV cache nearly all of the memory it would have had. At
# least 1 GiB (a few hundred large images; never more than 1/8 of a small GPU), at most 8 GiB: past that the
# KV cache's tokens are worth more than older images.
GPU_POOL_SHARE = 32
GPU_POOL_MIN = 1 * GIB
GPU_POOL_MAX = 8 * GIB
GPU_POOL_MAX_SHARE = 8
# Host pool (and the spill tier): a quarter of the memory available now and half of /dev/shm's free space (the
# pool is a file there, and the other processes' media and tensors need the rest), at most 4 GiB for the pool
# (as much as a GPU host's pool gets) and 8 GiB for a spill tier (twice the GPU pool it backs).
HOST_AVAILABLE_SHARE = 4
SHM_FREE_SHARE = 2
HOST_POOL_MAX = 4 * GIB
SPILL_MAX = 8 * GIB
SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class HostMemory:
    """What the host has for a pool in shared memory: MemAvailable and /dev/shm's free bytes."""

    available: int
    shm_free: int


@dataclass(frozen=True)
class PoolSize:
    """A pool's bytes and the rule that chose them (for the start-up log)."""

    nbytes: int
    rule: str


def gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.0f} MiB"


def device_pool_bytes(configured: int, gpu_total: int) -> PoolSize:
    """The GPU pool on a GPU of ``gpu_total`` bytes: ``configured`` (``[cache] pool_bytes``), or with 0 1/32 of
    the GPU within 1..8 GiB (never over 1/8 of it)."""
    if configured:
        return PoolSize(configured, "[cache] pool_bytes")
    share = gpu_total // GPU_POOL_SHARE
    nbytes = min(max(share, GPU_POOL_MIN), gpu_total // GPU_POOL_MAX_SHARE, GPU_POOL_MAX)
    bounds = f"{gib(GPU_POOL_MIN)}..{gib(GPU_POOL_MAX)}"
    return PoolSize(nbytes, f"auto: 1/{GPU_POOL_SHARE} of the GPU's {gib(gpu_total)}, within {bounds}")


def host_pool_bytes(configured: int, host: HostMemory, cap: int = HOST_POOL_MAX) -> PoolSize:
    """A pool in shared memory: ``configured``, or with 0 a quarter of MemAvailable and half of /dev/shm's free
    space, at most ``cap``."""
    if configured:
        return PoolSize(configured, "[cache] pool_bytes")
    nbytes = min(host.available // HOST_AVAILABLE_SHARE, host.shm_free // SHM_FREE_SHARE, cap)
    rule = (
        f"auto: min(1/{HOST_AVAILABLE_SHARE} of {gib(host.available)} available, 1/{SHM_FREE_SHARE} of "
        f"{gib(host.shm_free)} free in {SHM_DIR}, {gib(cap)})"
    )
    return PoolSize(max(nbytes, 0), rule)


def spill_bytes(configured: int, auto: bool, host: HostMemory) -> PoolSize:
    """The host tier behind a GPU pool: ``configured`` bytes (0: none), or with ``auto`` the host rule up to
    ``SPILL_MAX``."""
    if not auto:
        return PoolSize(configured, "[cache] spill_bytes")
    return host_pool_bytes(0, host, SPILL_MAX)


def host_memory(meminfo: Path = Path("/proc/meminfo"), shm: Path = SHM_DIR) -> HostMemory:
    """MemAvailable (MemFree where the kernel has no MemAvailable; 0 unreadable) and /dev/shm's free bytes."""
    fields: dict[str, int] = {}
    try:
        for line in meminfo.read_text().splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                fields[name] = int(parts[0]) * 1024  # (kB)
    except OSError:
        pass
    try:
        stat = os.statvfs(shm)
        shm_free = stat.f_bavail * stat.f_frsize
    except OSError:
        shm_free = 0
    return HostMemory(fields.get("MemAvailable", fields.get("MemFree", 0)), shm_free)


@dataclass(frozen=True)
class PoolPlan:
    """Where the embedding pool lives, its size and its spill tier's (0: none), each with its rule."""

    pool: PoolSize
    spill: PoolSize
    device: str  # "cuda:0" or "shared memory"

    def describe(self) -> str:
        line = f"embedding pool {gib(self.pool.nbytes)} in {self.device} ({self.pool.rule})"
        if self.spill.nbytes:
            line += f", spill tier {gib(self.spill.nbytes)} in shared memory ({self.spill.rule})"
        return line


def pool_plan(cfg: Config, gpu_total: int, host: HostMemory) -> PoolPlan:
    """The pool that ``cfg`` asks for on a host with ``host``'s memory and, for a GPU pool (``[cache]
    device_pool``), GPU 0's ``gpu_total`` bytes."""
    cache = cfg.cache
    if not cache.device_pool:
        return PoolPlan(
            host_pool_bytes(cache.pool_bytes, host), PoolSize(0, "host pool: no spill tier"), "shared memory"
        )
    spill = spill_bytes(cache.spill_bytes, "cache.spill_bytes" in cfg.auto, host)
    return PoolPlan(device_pool_bytes(cache.pool_bytes, gpu_total), spill, "cuda:0")
