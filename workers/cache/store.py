"""The embedding store: a byte pool, a content-hash index, leases, and LRU eviction by bytes.

Pure bookkeeping (no sockets), so it is unit-tested directly. Memory is one shared-memory
pool owned by the cache daemon; encoders write into slots reserved here, consumers read by
offset. An entry is ``pending`` from reservation until the encoder commits it, then
``ready``. Ready entries that no request leases are evicted least-recently-used first when a
reservation needs room; pending and leased ones never are.
"""

from __future__ import annotations

import bisect
import time
from collections import OrderedDict
from dataclasses import dataclass, field

ALIGN = 256


class PoolFull(Exception):
    """No room even after evicting every unleased entry."""


@dataclass
class Entry:
    content_hash: str
    offset: int
    nbytes: int
    dtype: str
    shape: list[int]
    ready: bool = False
    created: float = field(default_factory=time.monotonic)
    leases: set[str] = field(default_factory=set)


class Allocator:
    """First-fit over a sorted free list, coalescing neighbours on free."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free: list[tuple[int, int]] = [(0, size)] if size else []  # (offset, length), sorted

    def allocate(self, nbytes: int) -> int | None:
        need = -(-max(nbytes, 1) // ALIGN) * ALIGN
        for i, (offset, length) in enumerate(self.free):
            if length >= need:
                if length == need:
                    del self.free[i]
                else:
                    self.free[i] = (offset + need, length - need)
                return offset
        return None

    def release(self, offset: int, nbytes: int) -> None:
        length = -(-max(nbytes, 1) // ALIGN) * ALIGN
        i = bisect.bisect_left(self.free, (offset, 0))
        self.free.insert(i, (offset, length))
        # merge with the right neighbour, then the left one
        if i + 1 < len(self.free) and offset + length == self.free[i + 1][0]:
            self.free[i] = (offset, length + self.free.pop(i + 1)[1])
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == offset:
            prev_offset, prev_length = self.free[i - 1]
            self.free[i - 1] = (prev_offset, prev_length + self.free.pop(i)[1])

    @property
    def free_bytes(self) -> int:
        return sum(length for _, length in self.free)


class EmbeddingStore:
    def __init__(self, pool_bytes: int) -> None:
        self.allocator = Allocator(pool_bytes)
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # LRU order: oldest first
        self.leases: dict[str, tuple[set[str], float]] = {}  # request_id -> (hashes, expiry)
        self.counters: dict[str, float] = dict.fromkeys(
            ("hits", "misses", "pending_hits", "commits", "evictions", "failed", "full"), 0.0
        )

    # ------------------------------------------------------------------ lookup / reserve
    def lookup(self, content_hash: str) -> Entry | None:
        entry = self.entries.get(content_hash)
        if entry is not None:
            self.entries.move_to_end(content_hash)
            self.counters["hits" if entry.ready else "pending_hits"] += 1
        return entry

    def can_reserve(self, nbytes: int) -> bool:
        return self._plan_evictions(nbytes) is not None

    def reserve(self, content_hash: str, nbytes: int, dtype: str, shape: list[int]) -> Entry:
        """Make a pending entry, evicting LRU unleased entries for room. Raises ``PoolFull``, and
        then evicts nothing: dropping entries that would not make room only loses work."""
        victims = self._plan_evictions(nbytes)
        if victims is None:
            self.counters["full"] += 1
            raise PoolFull(f"{nbytes} B needed, {self.allocator.free_bytes} B free and not enough evictable")
        for victim in victims:
            self._drop(victim)
            self.counters["evictions"] += 1
        offset = self.allocator.allocate(nbytes)
        if offset is None:  # _plan_evictions simulated exactly this; reaching here is a bug
            raise RuntimeError("allocator disagrees with its eviction plan")
        entry = Entry(content_hash, offset, nbytes, dtype, list(shape))
        self.entries[content_hash] = entry
        self.counters["misses"] += 1
        return entry

    def _plan_evictions(self, nbytes: int) -> list[Entry] | None:
        """The LRU prefix of evictable entries whose release makes ``nbytes`` fit (None: nothing does)."""
        trial = Allocator(self.allocator.size)
        trial.free = list(self.allocator.free)
        victims: list[Entry] = []
        candidates = (e for e in self.entries.values() if self._evictable(e))
        while trial.allocate(nbytes) is None:
            victim = next(candidates, None)
            if victim is None:
                return None
            trial.release(victim.offset, victim.nbytes)
            victims.append(victim)
        return victims

    def commit(self, content_hash: str) -> Entry | None:
        entry = self.entries.get(content_hash)
        if entry is not None and not entry.ready:
            entry.ready = True
            self.counters["commits"] += 1
        return entry

    def fail(self, content_hash: str) -> None:
        entry = self.entries.get(content_hash)
        if entry is not None and not entry.ready:
            self._drop(entry)
            self.counters["failed"] += 1

    # ------------------------------------------------------------------ leases
    def lease(self, request_id: str, hashes: list[str], ttl_s: float) -> None:
        held, _ = self.leases.get(request_id, (set(), 0.0))
        for h in hashes:
            if h in self.entries:
                self.entries[h].leases.add(request_id)
                held.add(h)
        self.leases[request_id] = (held, time.monotonic() + ttl_s)

    def release(self, request_id: str) -> None:
        held, _ = self.leases.pop(request_id, (set(), 0.0))
        for h in held:
            entry = self.entries.get(h)
            if entry is not None:
                entry.leases.discard(request_id)

    def expire(self, pending_ttl_s: float) -> list[str]:
        """Release expired leases; drop pending entries nobody committed in time (returned)."""
        now = time.monotonic()
        for request_id in [r for r, (_, expiry) in self.leases.items() if expiry < now]:
            self.release(request_id)
        stale = [e for e in self.entries.values() if not e.ready and now - e.created > pending_ttl_s]
        for entry in stale:
            self._drop(entry)
            self.counters["failed"] += 1
        return [e.content_hash for e in stale]

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _evictable(entry: Entry) -> bool:
        return entry.ready and not entry.leases

    def _drop(self, entry: Entry) -> None:
        self.entries.pop(entry.content_hash, None)
        self.allocator.release(entry.offset, entry.nbytes)

    def snapshot(self) -> dict[str, float]:
        return {
            **self.counters,
            "entries": float(len(self.entries)),
            "pending_entries": float(sum(not e.ready for e in self.entries.values())),
            "bytes_used": float(self.allocator.size - self.allocator.free_bytes),
            "bytes_total": float(self.allocator.size),
            "leased_requests": float(len(self.leases)),
        }
