"""The embedding store: a byte pool, a content-hash index, leases, and LRU eviction by bytes.

Pure bookkeeping (no sockets), so it is unit-tested directly. Memory is the cache daemon's pool
(host shared memory, or GPU memory) and, behind a GPU pool, an optional spill tier in host shared
memory; encoders write into slots reserved here, consumers read by offset. An entry is ``pending``
from reservation until the encoder commits it, then ``ready``. Ready entries that no request leases
are evicted least-recently-used first when a reservation needs room; pending and leased ones never
are. With a spill tier, an entry evicted from the pool moves there (the daemon copies its bytes,
`take_spills`) and is still a hit; only what the spill tier must evict in turn is gone.
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
    tier: int = 0  # MAIN or SPILL: which pool ``offset`` is in


MAIN, SPILL = 0, 1


@dataclass(frozen=True)
class Spill:
    """An entry moved out of the main pool: its bytes go from ``src`` there to ``dst`` in the spill tier,
    copied by the daemon before it answers anyone, since the main bytes are already given to another."""

    content_hash: str
    src: int
    dst: int
    nbytes: int


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
    def __init__(self, pool_bytes: int, spill_bytes: int = 0) -> None:
        self.allocator = Allocator(pool_bytes)
        self.spill_allocator = Allocator(spill_bytes)
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # LRU order: oldest first
        self.leases: dict[str, tuple[set[str], float]] = {}  # request_id -> (hashes, expiry)
        self.spills: list[Spill] = []  # moves the daemon has yet to copy (take_spills)
        self.counters: dict[str, float] = dict.fromkeys(
            ("hits", "misses", "pending_hits", "commits", "evictions", "spills", "failed", "full"), 0.0
        )

    # ------------------------------------------------------------------ lookup / reserve
    def lookup(self, content_hash: str) -> Entry | None:
        entry = self.entries.get(content_hash)
        if entry is not None:
            self.entries.move_to_end(content_hash)
            self.counters["hits" if entry.ready else "pending_hits"] += 1
        return entry

    def can_reserve(self, nbytes: int) -> bool:
        return self._plan_evictions(nbytes, MAIN) is not None

    def reserve(self, content_hash: str, nbytes: int, dtype: str, shape: list[int]) -> Entry:
        """Make a pending entry in the main pool, evicting LRU unleased entries for room (into the spill
        tier where one is). Raises ``PoolFull``, and then evicts nothing: dropping entries that would not
        make room only loses work."""
        victims = self._plan_evictions(nbytes, MAIN)
        if victims is None:
            self.counters["full"] += 1
            raise PoolFull(f"{nbytes} B needed, {self.allocator.free_bytes} B free and not enough evictable")
        for victim in victims:
            self._evict(victim)
        offset = self.allocator.allocate(nbytes)
        if offset is None:  # _plan_evictions simulated exactly this; reaching here is a bug
            raise RuntimeError("allocator disagrees with its eviction plan")
        entry = Entry(content_hash, offset, nbytes, dtype, list(shape))
        self.entries[content_hash] = entry
        self.counters["misses"] += 1
        return entry

    def take_spills(self) -> list[Spill]:
        """The moves made since the last call, for the daemon to copy now (oldest first)."""
        spills, self.spills = self.spills, []
        return spills

    def _evict(self, victim: Entry) -> None:
        """Out of the main pool: into the spill tier if room can be made there, else gone. ("evictions"
        counts the entries gone from the cache, "spills" those moved.)"""
        room = self._plan_evictions(victim.nbytes, SPILL) if self.spill_allocator.size else None
        if room is None:
            self._drop(victim)
            self.counters["evictions"] += 1
            return
        for spilled in room:
            self._drop(spilled)
            self.counters["evictions"] += 1
        dst = self.spill_allocator.allocate(victim.nbytes)
        if dst is None:  # as in reserve: the plan simulated exactly this
            raise RuntimeError("spill allocator disagrees with its eviction plan")
        self.allocator.release(victim.offset, victim.nbytes)
        self.spills.append(Spill(victim.content_hash, victim.offset, dst, victim.nbytes))
        victim.offset, victim.tier = dst, SPILL
        self.counters["spills"] += 1

    def _plan_evictions(self, nbytes: int, tier: int) -> list[Entry] | None:
        """The LRU prefix of the tier's evictable entries whose release makes ``nbytes`` fit there (None:
        nothing does)."""
        allocator = self.allocator if tier == MAIN else self.spill_allocator
        trial = Allocator(allocator.size)
        trial.free = list(allocator.free)
        victims: list[Entry] = []
        candidates = (e for e in self.entries.values() if e.tier == tier and self._evictable(e))
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
        (self.allocator if entry.tier == MAIN else self.spill_allocator).release(entry.offset, entry.nbytes)
        if entry.tier == SPILL and self.spills:  # spilled and dropped before the daemon copied it: no copy
            self.spills = [move for move in self.spills if move.content_hash != entry.content_hash]

    def snapshot(self) -> dict[str, float]:
        return {
            **self.counters,
            "entries": float(len(self.entries)),
            "pending_entries": float(sum(not e.ready for e in self.entries.values())),
            "spilled_entries": float(sum(e.tier == SPILL for e in self.entries.values())),
            "bytes_used": float(self.allocator.size - self.allocator.free_bytes),
            "bytes_capacity": float(self.allocator.size),  # (not "_total": Prometheus reads that as a counter)
            "spill_bytes_used": float(self.spill_allocator.size - self.spill_allocator.free_bytes),
            "spill_bytes_capacity": float(self.spill_allocator.size),
            "leased_requests": float(len(self.leases)),
        }
