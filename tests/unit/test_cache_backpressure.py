"""A full embedding cache is backpressure: the allocator's "refused with enough bytes free", a request's items
reserved all at once, the queue of reservations waiting for room, and the daemon answering them."""

from __future__ import annotations

import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.config import Config
from common.protocol import CacheLookup, CacheRelease, CacheReserve, CacheReserveResult, Message
from workers.cache import waiting as waiting_mod
from workers.cache.daemon import CacheDaemon
from workers.cache.store import ALIGN, EmbeddingStore, NeverFits, PoolFull, Wanted
from workers.cache.waiting import ReservationQueue, Waiting

B = ALIGN


def ready(store: EmbeddingStore, h: str, nbytes: int = B) -> None:
    store.reserve(h, nbytes, "bfloat16", [1])
    store.commit(h)


def want(h: str, nbytes: int = B) -> Wanted:
    return Wanted(h, nbytes, "bfloat16", [1])


# --------------------------------------------------------------------------- the allocator's accounting


def test_a_reservation_is_not_refused_while_a_hole_could_hold_it() -> None:
    """The refusal "2 B needed, 2 B free" (in blocks): first fit put a small entry into the only hole the
    large one could use, leaving the free bytes split between the pinned entries."""
    s = EmbeddingStore(6 * B)
    for h, n in (("x0", 2 * B), ("p1", B), ("x2", B), ("p2", 2 * B)):
        s.reserve(h, n, "bfloat16", [1])
    s.fail("x0")  # holes [0, 2) and [3, 4) between the pending p1 and p2, which nothing may evict
    s.fail("x2")
    s.reserve("small", B, "bfloat16", [1])
    big = s.reserve("big", 2 * B, "bfloat16", [1])  # was PoolFull: "512 B needed, 512 B free"
    assert (s.entries["small"].offset, big.offset) == (3 * B, 0)  # best fit: small took the one-block hole


def test_room_is_made_from_one_run_of_old_entries_not_an_lru_prefix_scattered_over_the_pool() -> None:
    # Layout (blocks): a [0,1) oldest, pending p [1,2), b [2,3), c [3,4). Two blocks fit only where b and c are:
    # evicting a as well (the old LRU prefix a, b, c) loses it for nothing.
    s = EmbeddingStore(4 * B)
    ready(s, "a")
    s.reserve("p", B, "bfloat16", [1])
    ready(s, "b")
    ready(s, "c")
    s.reserve("new", 2 * B, "bfloat16", [1])
    assert set(s.entries) == {"a", "p", "new"} and s.counters["evictions"] == 2


def test_the_refusal_says_what_the_allocator_sees() -> None:
    s = EmbeddingStore(3 * B)
    for h in ("p0", "p1", "p2"):
        s.reserve(h, B, "bfloat16", [1])
    s.fail("p1")
    with pytest.raises(PoolFull, match=rf"{2 * B} B needed; {B} B free in 1 holes, the largest {B} B"):
        s.reserve("big", 2 * B, "bfloat16", [1])


# --------------------------------------------------------------------------- a request's items together


def test_a_requests_items_are_reserved_all_at_once_and_leased_to_it() -> None:
    s = EmbeddingStore(4 * B)
    ready(s, "hit")
    got = s.reserve_all("r1", [want("hit"), want("a"), want("b", 2 * B), want("a")], ttl_s=60)
    assert [state for state, _ in got] == ["ready", "reserved", "reserved", "pending"]  # "a" twice: once reserved
    assert got[1][1] is got[3][1]
    assert s.leases["r1"][0] == {"hit", "a", "b"}
    assert s.counters["misses"] == 1 + 2 and s.counters["hits"] == 1


def test_a_request_that_does_not_fit_now_changes_nothing() -> None:
    """All or none: a request holding some slots while it waited for others could block the releases it waits on."""
    s = EmbeddingStore(4 * B)
    s.reserve("pinned", 2 * B, "bfloat16", [1])
    ready(s, "old")
    before = {h: e.offset for h, e in s.entries.items()}
    with pytest.raises(PoolFull):
        s.reserve_all("r1", [want("a"), want("b"), want("c")], ttl_s=60)  # 3 blocks, 2 can be made
    assert {h: e.offset for h, e in s.entries.items()} == before and not s.leases
    s.fail("pinned")
    assert [state for state, _ in s.reserve_all("r1", [want("a"), want("b"), want("c")], ttl_s=60)] == ["reserved"] * 3


def test_a_reservation_spares_the_requests_own_hits() -> None:
    s = EmbeddingStore(2 * B)
    ready(s, "mine")  # the oldest: the first to go, were it not the request's own
    ready(s, "other")
    got = s.reserve_all("r1", [want("mine"), want("new")], ttl_s=60)
    assert [state for state, _ in got] == ["ready", "reserved"] and set(s.entries) == {"mine", "new"}


def test_only_what_could_never_fit_is_refused_at_once() -> None:
    s = EmbeddingStore(4 * B)
    with pytest.raises(NeverFits) as raised:
        s.reserve_all("r1", [want("a", 3 * B), want("b", B + 1)], ttl_s=60)
    assert (raised.value.needed, raised.value.capacity) == (5 * B, 4 * B)
    s.reserve("pinned", 4 * B, "bfloat16", [1])
    with pytest.raises(PoolFull):  # fits once "pinned" goes: it waits, it is not refused
        s.reserve_all("r2", [want("a", 2 * B), want("b", 2 * B)], ttl_s=60)


# --------------------------------------------------------------------------- the queue


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    now = types.SimpleNamespace(t=1000.0)
    monkeypatch.setattr(waiting_mod, "time", types.SimpleNamespace(monotonic=lambda: now.t))
    return now


def test_the_queue_answers_in_arrival_order_and_stops_at_the_first_that_must_wait(clock: types.SimpleNamespace) -> None:
    q: ReservationQueue[int] = ReservationQueue()
    for rid, size in (("large", 3), ("small", 1), ("smaller", 1)):
        q.add(rid, size, wait_s=10)
    room = [2]

    def fits(w: Waiting[int]) -> bool:
        if w.what > room[0]:
            return False
        room[0] -= w.what
        return True

    assert q.serve(fits) == []  # the small ones fit, but do not overtake the large one
    room[0] = 4
    assert [w.request_id for w in q.serve(fits)] == ["large", "small"]
    assert [w.request_id for w in q.waiting.values()] == ["smaller"]


def test_a_reservation_sent_again_keeps_its_place_and_deadline(clock: types.SimpleNamespace) -> None:
    q: ReservationQueue[str] = ReservationQueue()
    q.add("a", "first call", wait_s=10)
    q.add("b", "b", wait_s=10)
    clock.t += 5
    q.add("a", "second call", wait_s=10)
    assert [(w.request_id, w.what) for w in q.waiting.values()] == [("a", "second call"), ("b", "b")]
    assert q.waiting["a"].deadline == 1010.0


def test_deadlines_and_withdrawals(clock: types.SimpleNamespace) -> None:
    q: ReservationQueue[str] = ReservationQueue()
    q.add("early", "", wait_s=5)
    q.add("aborted", "", wait_s=5)
    q.add("late", "", wait_s=20)
    assert q.withdraw("aborted") is not None and q.withdraw("aborted") is None
    clock.t += 4
    assert q.expired() == []
    clock.t += 1
    assert [w.request_id for w in q.expired()] == ["early"]
    assert len(q) == 1


# --------------------------------------------------------------------------- the daemon


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[CacheDaemon, list[tuple[bytes, Message]]]]:
    cfg = Config()
    cfg.run_dir, cfg.cache.pool_bytes, cfg.cache.reserve_wait_s = str(tmp_path), 4 * B, 30.0
    d = CacheDaemon(cfg)
    sent: list[tuple[bytes, Message]] = []
    d.channel.send_to = lambda peer, msg: sent.append((peer, msg))  # type: ignore[method-assign]
    try:
        yield d, sent
    finally:
        d.channel.close()
        d.pool.unlink()


def reserve(rid: str, *hashes: str, nbytes: int = B) -> CacheReserve:
    items = [CacheLookup(str(i), h, nbytes, "bfloat16", [1]) for i, h in enumerate(hashes)]
    return CacheReserve(f"call-{rid}", rid, items)


def answers(sent: list[tuple[bytes, Message]]) -> list[tuple[str, int, list[str]]]:
    out = [(m.request_id, m.status, [r.state for r in m.results]) for _, m in sent if isinstance(m, CacheReserveResult)]
    sent.clear()
    return out


def test_the_daemon_answers_a_waiting_reservation_when_a_release_makes_room(daemon: tuple) -> None:
    d, sent = daemon
    d.handle(b"f", reserve("r1", "a", "b", "c"))
    assert answers(sent) == [("r1", 200, ["reserved"] * 3)]
    for h in "abc":
        d.handle(b"f", CacheCommitOk(h))
    d.handle(b"f", reserve("r2", "d", "e"))  # r1 leases a, b, c: one block is free, r2 needs two
    d.handle(b"f", reserve("r3", "f"))  # would fit, but waits behind r2
    assert answers(sent) == [] and d.store.counters["waited"] == 2
    stats = d.store.snapshot() | {"reservations_waiting": float(len(d.reservations))}
    assert stats["reservations_waiting"] == 2
    d.handle(b"decoder", CacheRelease("r1"))  # r1's decoder copied its embeddings
    assert answers(sent) == [("r2", 200, ["reserved", "reserved"]), ("r3", 200, ["reserved"])]


def test_an_aborted_request_leaves_the_queue(daemon: tuple) -> None:
    d, sent = daemon
    d.handle(b"f", reserve("r1", "a", "b", "c", "d"))
    d.handle(b"f", reserve("r2", "e"))
    d.handle(b"f", CacheRelease("r2"))  # aborted while waiting
    assert len(d.reservations) == 0
    d.handle(b"f", CacheRelease("r1"))
    assert answers(sent) == [("r1", 200, ["reserved"] * 4)]


def test_too_large_is_refused_at_once_and_a_wait_past_the_deadline_with_a_503(daemon: tuple) -> None:
    d, sent = daemon
    d.handle(b"f", reserve("huge", "a", "b", nbytes=3 * B))
    [(_, refusal)] = sent
    assert isinstance(refusal, CacheReserveResult) and refusal.status == 413
    assert refusal.code == "embeddings_too_large" and "[cache] pool_bytes" in refusal.message
    assert f"need {6 * B} B" in refusal.message and f"holds {4 * B} B" in refusal.message
    sent.clear()
    d.handle(b"f", reserve("r1", "a", "b", "c", "d"))
    d.handle(b"f", reserve("r2", "e"))
    assert answers(sent) == [("r1", 200, ["reserved"] * 4)]
    d.reservations.waiting["r2"].deadline = time.monotonic() - 1
    d.expire()
    [(rid, status, _)] = answers(sent)
    assert (rid, status) == ("r2", 503) and d.store.counters["full"] == 1


def CacheCommitOk(h: str) -> Message:
    from common.protocol import CacheCommit

    return CacheCommit(h)
