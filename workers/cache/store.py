"""The embedding store: a byte pool, a content-hash index, leases, and LRU eviction by bytes.

Pure bookkeeping (no sockets), so it is unit-tested directly. Memory is the cache daemon's pool
(host shared memory, or GPU memory) and, behind a GPU pool, an optional spill tier in host shared
memory; encoders write into slots reserved here, consumers read by offset. An entry is ``pending``
from reservation until the encoder commits it, then ``ready``. Ready entries that no request leases
are evicted least-recently-used first when a reservation needs room; pending and leased ones never
are. With a spill tier, an entry evicted from the pool moves there (the daemon copies its bytes,
`take_spills`) and is still a hit; only what the spill tier must evict in turn is gone.

Offsets are live in other processes (IPC), so the pool is never compacted: the allocator takes the best-fitting
hole, and room for an entry is made by evicting the contiguous run of unleased entries (and holes) whose newest
entry is the oldest, not an LRU prefix scattered over the pool. A request's slots are reserved all at once or
not at all (`reserve_all`): one holding some while it waited for others could block the releases it waits on.
"""

from __future__ import annotations

import bisect
import time
from collections import OrderedDict
from dataclasses import dataclass, field

ALIGN = 256


class PoolFull(Exception):
    """No room now even after evicting every unleased entry: room may come when leases end."""


class NeverFits(Exception):
    """Embeddings larger than the pool could ever hold, whatever is released."""

    def __init__(self, needed: int, capacity: int) -> None:
        super().__init__(f"{needed} B needed, the pool holds {capacity} B")
        self.needed, self.capacity = needed, capacity


def aligned(nbytes: int) -> int:
    """The bytes an entry of ``nbytes`` takes in a pool."""
    return -(-max(nbytes, 1) // ALIGN) * ALIGN


@dataclass(frozen=True)
class Wanted:
    """One media item of a request: its embedding's hash and size."""

    content_hash: str
    nbytes: int
    dtype: str
    shape: list[int]


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
    """Best fit over a sorted free list (the smallest hole that fits, the lowest of equals), coalescing
    neighbours on free. First fit carved small entries out of the holes a large one needed, leaving the free
    bytes in pieces none of which fit it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free: list[tuple[int, int]] = [(0, size)] if size else []  # (offset, length), sorted

    def copy(self) -> Allocator:
        trial = Allocator(self.size)
        trial.free = list(self.free)
        return trial

    def allocate(self, nbytes: int) -> int | None:
        need = aligned(nbytes)
        fits = [(length, i) for i, (_, length) in enumerate(self.free) if length >= need]
        if not fits:
            return None
        length, i = min(fits)
        offset = self.free[i][0]
        if length == need:
            del self.free[i]
        else:
            self.free[i] = (offset + need, length - need)
        return offset

    @property
    def largest_hole(self) -> int:
        return max((length for _, length in self.free), default=0)

    def release(self, offset: int, nbytes: int) -> None:
        length = aligned(nbytes)
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
            (
                *("hits", "misses", "pending_hits", "commits", "evictions", "spills", "failed", "full", "waited"),
                *("writes", "written_bytes"),  # embeddings sent by value (`CacheWrite`), written by the daemon
            ),
            0.0,
        )

    # ------------------------------------------------------------------ lookup / reserve
    def lookup(self, content_hash: str) -> Entry | None:
        entry = self.entries.get(content_hash)
        if entry is not None:
            self.entries.move_to_end(content_hash)
            self.counters["hits" if entry.ready else "pending_hits"] += 1
        return entry

    def can_reserve(self, nbytes: int) -> bool:
        return self._plan_main([nbytes], set()) is not None

    def reserve(self, content_hash: str, nbytes: int, dtype: str, shape: list[int]) -> Entry:
        """Make a pending entry in the main pool, evicting LRU unleased entries for room (into the spill
        tier where one is). Raises ``PoolFull``, and then evicts nothing: dropping entries that would not
        make room only loses work."""
        plan = self._plan_main([nbytes], set())
        if plan is None:
            self.counters["full"] += 1
            raise PoolFull(self.why_full(nbytes))
        return self._carry_out(plan, [Wanted(content_hash, nbytes, dtype, list(shape))])[0]

    def reserve_all(self, request_id: str, wanted: list[Wanted], ttl_s: float) -> list[tuple[str, Entry]]:
        """Every item of one request, at once or not at all: each found (``ready`` or ``pending``) or
        ``reserved`` here for the caller to encode, all leased to ``request_id``. Raises ``NeverFits`` where
        no release could ever make room, ``PoolFull`` (changing nothing) where none makes room now."""
        distinct = {w.content_hash: w for w in wanted}
        missing = [w for h, w in distinct.items() if h not in self.entries]
        self.check_fits(list(distinct.values()), missing)
        plan = self._plan_main([w.nbytes for w in missing], set(distinct) - {w.content_hash for w in missing})
        if plan is None:
            raise PoolFull(self.why_full(sum(aligned(w.nbytes) for w in missing)))
        states = {h: ("ready" if e.ready else "pending") for h, e in self.entries.items() if h in distinct}
        self.lease(request_id, list(states), ttl_s)  # first: the evictions below must spare them
        for h in states:
            self.lookup(h)  # (counted, and now the most recently used)
        for entry in self._carry_out(plan, missing):
            states[entry.content_hash] = "reserved"
        self.lease(request_id, [w.content_hash for w in missing], ttl_s)
        answers, seen = [], set()
        for w in wanted:  # a hash asked for twice is reserved once: the second is pending on the first
            state = states[w.content_hash]
            state = "pending" if state == "reserved" and w.content_hash in seen else state
            answers.append((state, self.entries[w.content_hash]))
            seen.add(w.content_hash)
        return answers

    def check_fits(self, distinct: list[Wanted], missing: list[Wanted]) -> None:
        """``NeverFits`` unless the new slots fit in the main pool together and every item fits in the
        pool and the spill tier together (a request's embeddings are read all at once)."""
        new, every = sum(aligned(w.nbytes) for w in missing), sum(aligned(w.nbytes) for w in distinct)
        if new > self.allocator.size:
            raise NeverFits(new, self.allocator.size)
        if every > self.allocator.size + self.spill_allocator.size:
            raise NeverFits(every, self.allocator.size + self.spill_allocator.size)

    def why_full(self, nbytes: int) -> str:
        """What the allocator sees, not a sum that counts holes too small to use as room."""
        free = self.allocator
        return (
            f"{nbytes} B needed; {free.free_bytes} B free in {len(free.free)} holes, the largest {free.largest_hole} "
            "B, the rest held by embeddings in use"
        )

    def _carry_out(self, plan: list[list[Entry]], wanted: list[Wanted]) -> list[Entry]:
        """The plan's evictions and allocations in the order it simulated them, so that each lands where planned."""
        made = []
        for victims, w in zip(plan, wanted, strict=True):
            for victim in victims:
                self._evict(victim)
            offset = self.allocator.allocate(w.nbytes)
            if offset is None:  # _plan_main simulated exactly this; reaching here is a bug
                raise RuntimeError("allocator disagrees with its eviction plan")
            entry = Entry(w.content_hash, offset, w.nbytes, w.dtype, list(w.shape))
            self.entries[w.content_hash] = entry
            self.counters["misses"] += 1
            made.append(entry)
        return made

    def _plan_main(self, sizes: list[int], keep: set[str]) -> list[list[Entry]] | None:
        """For each size in turn, the entries to evict before allocating it (None: they do not all fit now),
        sparing ``keep``. Simulated on a copy of the free list, allocations included."""
        trial = self.allocator.copy()
        gone: set[str] = set()
        placed: list[tuple[int, int]] = []
        plan = []
        for nbytes in sizes:
            victims: list[Entry] | None = []
            if trial.largest_hole < aligned(nbytes):
                victims = self._cheapest_run(trial, aligned(nbytes), keep, gone, placed)
                if victims is None:
                    return None
            for victim in victims:
                trial.release(victim.offset, victim.nbytes)
                gone.add(victim.content_hash)
            offset = trial.allocate(nbytes)
            if offset is None:
                raise RuntimeError("an evicted run does not hold what it was chosen for")
            placed.append((offset, aligned(nbytes)))
            plan.append(victims)
        return plan

    def _cheapest_run(
        self, trial: Allocator, need: int, keep: set[str], gone: set[str], placed: list[tuple[int, int]]
    ) -> list[Entry] | None:
        """The contiguous run of holes and evictable entries of at least ``need`` bytes whose most recently used
        entry is the least recent (then: the fewest bytes evicted); None if no run is long enough."""
        rank = {h: i for i, h in enumerate(self.entries)}  # LRU order
        spans: list[tuple[int, int, Entry | None, bool]] = [(o, n, None, True) for o, n in trial.free]
        spans += [(o, n, None, False) for o, n in placed]
        for e in self.entries.values():
            if e.tier == MAIN and e.content_hash not in gone:
                spans.append((e.offset, aligned(e.nbytes), e, self._evictable(e) and e.content_hash not in keep))
        spans.sort(key=lambda span: span[0])
        best: tuple[tuple[int, int], list[Entry]] | None = None
        for i in range(len(spans)):
            total, victims = 0, []
            for _, length, entry, usable in spans[i:]:
                if not usable or total >= need:
                    break
                total += length
                if entry is not None:
                    victims.append(entry)
            if total >= need:
                cost = (max(rank[v.content_hash] for v in victims), sum(aligned(v.nbytes) for v in victims))
                if best is None or cost < best[0]:
                    best = (cost, victims)
        return None if best is None else best[1]

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
        nothing does). (The spill tier's plan: its offsets are read only by copies, so scattering is cheap.)"""
        allocator = self.allocator if tier == MAIN else self.spill_allocator
        trial = allocator.copy()
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
