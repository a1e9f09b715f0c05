"""Unit tests for ``workers/cache/store.py``: the byte allocator and the embedding store."""

from __future__ import annotations

import copy
import itertools
import random
import time
import types
from pathlib import Path

import pytest
import torch

from common.config import Config, load_config
from workers.cache import store as store_mod
from workers.cache.store import ALIGN, MAIN, SPILL, Allocator, EmbeddingStore, PoolFull, Spill

B = ALIGN  # one allocation block


def aligned(nbytes: int) -> int:
    return -(-max(nbytes, 1) // ALIGN) * ALIGN


class OffsetClock:
    """``time.monotonic`` shifted by a settable offset.

    ``Entry.created`` takes the real ``time.monotonic`` (bound as its default factory), so the
    fake clock must stay on the same time base and only move forward from it.
    """

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> OffsetClock:
    clock = OffsetClock()
    monkeypatch.setattr(store_mod, "time", types.SimpleNamespace(monotonic=clock))
    return clock


# --------------------------------------------------------------------------- Allocator


def test_allocator_first_fit() -> None:
    a = Allocator(16 * B)
    o1 = a.allocate(B)
    o2 = a.allocate(B)
    o3 = a.allocate(4 * B)
    o4 = a.allocate(B)
    assert (o1, o2, o3, o4) == (0, B, 2 * B, 6 * B)
    a.release(o1, B)  # hole [0, 1B)
    a.release(o3, 4 * B)  # hole [2B, 6B)
    assert a.free == [(0, B), (2 * B, 4 * B), (7 * B, 9 * B)]
    assert a.allocate(2 * B) == 2 * B  # the first hole that fits, not the big tail
    assert a.allocate(B) == 0  # the lowest hole that fits
    assert a.allocate(2 * B) == 4 * B
    assert a.allocate(3 * B) == 7 * B


def test_allocator_alignment() -> None:
    a = Allocator(16 * B)
    offsets = [a.allocate(n) for n in (1, B - 1, B, B + 1, 3, 0)]
    assert offsets == [0, B, 2 * B, 3 * B, 5 * B, 6 * B]
    assert all(o is not None and o % ALIGN == 0 for o in offsets)
    assert a.free_bytes == 16 * B - 7 * B


def test_allocator_release_rounds_like_allocate() -> None:
    a = Allocator(4 * B)
    off = a.allocate(B + 1)
    assert off == 0 and a.free_bytes == 2 * B
    a.release(off, B + 1)
    assert a.free == [(0, 4 * B)]


def test_allocator_exhaustion_returns_none() -> None:
    a = Allocator(4 * B)
    assert a.allocate(4 * B + 1) is None
    assert a.free == [(0, 4 * B)]  # a failed allocation changes nothing
    assert a.allocate(3 * B) == 0
    assert a.allocate(2 * B) is None
    assert a.allocate(B) == 3 * B
    assert a.allocate(1) is None
    assert a.free_bytes == 0 and a.free == []


def test_allocator_unaligned_pool_never_hands_out_past_its_end() -> None:
    a = Allocator(1000)
    assert a.allocate(1000) is None  # rounded to 1024 > 1000
    assert a.allocate(700) == 0
    assert a.allocate(200) is None  # 232 B left, a block is 256


def test_allocator_empty_pool() -> None:
    a = Allocator(0)
    assert a.allocate(1) is None and a.free_bytes == 0


@pytest.mark.parametrize("seed", range(5))
def test_allocator_coalesces_back_to_one_block(seed: int) -> None:
    rng = random.Random(seed)
    size = 64 * B
    a = Allocator(size)
    live: list[tuple[int, int]] = []
    while True:
        n = rng.randint(1, 5 * B)
        off = a.allocate(n)
        if off is None:
            off = a.allocate(1)  # fill the remaining small holes too
            if off is None:
                break
            n = 1
        live.append((off, n))
    assert a.free_bytes == 0
    rng.shuffle(live)
    for i, (off, n) in enumerate(live):
        a.release(off, n)
        # Fully coalesced at every step: no two free blocks touch.
        for (o1, l1), (o2, _) in itertools.pairwise(a.free):
            assert o1 + l1 < o2
        assert a.free_bytes == sum(aligned(m) for _, m in live[: i + 1])
    assert a.free == [(0, size)]


def test_allocator_random_property() -> None:
    """A few thousand random allocate/release: no overlap, everything accounted, nothing lost."""
    rng = random.Random(20240611)
    size = 256 * B
    a = Allocator(size)
    live: dict[int, int] = {}  # offset -> aligned length
    for _ in range(4000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            length = live.pop(off)
            a.release(off, length - rng.randint(0, ALIGN - 1))  # any nbytes that rounds to the same length
        else:
            n = rng.choice([rng.randint(1, B), rng.randint(1, 8 * B), rng.randint(1, 40 * B)])
            need = aligned(n)
            off = a.allocate(n)
            if off is None:
                # First fit only fails when no free block is big enough.
                assert all(length < need for _, length in a.free)
            else:
                assert off % ALIGN == 0 and off >= 0 and off + need <= size
                for o, length in live.items():
                    assert off + need <= o or o + length <= off, "overlapping allocation"
                live[off] = need
        assert a.free_bytes + sum(live.values()) == size
        # The free list is sorted, disjoint, coalesced and disjoint from what is handed out.
        for (o1, l1), (o2, _) in itertools.pairwise(a.free):
            assert o1 + l1 < o2
        for fo, fl in a.free:
            assert fl > 0 and fo % ALIGN == 0
            for o, length in live.items():
                assert fo + fl <= o or o + length <= fo
    for off, length in list(live.items()):
        a.release(off, length)
    assert a.free == [(0, size)]


# --------------------------------------------------------------------------- EmbeddingStore


def ready(store: EmbeddingStore, h: str, nbytes: int = B) -> None:
    store.reserve(h, nbytes, "bfloat16", [nbytes // 2])
    assert store.commit(h) is not None


def test_lookup_counters() -> None:
    s = EmbeddingStore(8 * B)
    assert s.lookup("h") is None
    assert s.counters["hits"] == s.counters["pending_hits"] == s.counters["misses"] == 0
    entry = s.reserve("h", 100, "float32", [25])
    assert s.counters["misses"] == 1
    assert not entry.ready and entry.shape == [25] and entry.dtype == "float32" and entry.nbytes == 100
    assert s.lookup("h") is entry
    assert s.counters["pending_hits"] == 1 and s.counters["hits"] == 0
    assert s.commit("h") is entry and entry.ready
    assert s.counters["commits"] == 1
    s.commit("h")  # a second commit is not counted again
    assert s.counters["commits"] == 1
    assert s.lookup("h") is entry
    assert s.lookup("h") is entry
    assert s.counters["hits"] == 2 and s.counters["pending_hits"] == 1
    assert s.commit("missing") is None


def test_reserve_evicts_least_recently_used() -> None:
    s = EmbeddingStore(4 * B)
    for h in "abcd":
        ready(s, h)
    s.lookup("a")  # a is now the most recent; b the least
    new = s.reserve("e", B, "bfloat16", [1])
    assert set(s.entries) == {"a", "c", "d", "e"}
    assert s.counters["evictions"] == 1
    assert new.offset == B  # b's bytes
    s.commit("e")
    s.reserve("f", 2 * B, "bfloat16", [1])  # needs two evictions, oldest first: c, then d
    assert set(s.entries) == {"a", "e", "f"}
    assert s.counters["evictions"] == 3


def test_reserve_never_evicts_pending_or_leased() -> None:
    s = EmbeddingStore(3 * B)
    s.reserve("pending", B, "bfloat16", [1])
    ready(s, "leased")
    s.lease("r1", ["leased"], ttl_s=60)
    ready(s, "free")
    s.reserve("new", B, "bfloat16", [1])
    assert set(s.entries) == {"pending", "leased", "new"}
    with pytest.raises(PoolFull):
        s.reserve("newer", B, "bfloat16", [1])
    assert set(s.entries) == {"pending", "leased", "new"}
    assert s.counters["full"] == 1
    s.release("r1")
    s.reserve("newer", B, "bfloat16", [1])  # the released entry is evictable now
    assert set(s.entries) == {"pending", "new", "newer"}


def test_pool_full_when_nothing_is_evictable() -> None:
    s = EmbeddingStore(2 * B)
    s.reserve("a", B, "bfloat16", [1])
    s.reserve("b", B, "bfloat16", [1])
    before = s.snapshot()
    with pytest.raises(PoolFull):
        s.reserve("c", 1, "bfloat16", [1])
    with pytest.raises(PoolFull):
        s.reserve("huge", 3 * B, "bfloat16", [1])
    after = s.snapshot()
    assert after["full"] == 2
    assert {k: v for k, v in after.items() if k != "full"} == {k: v for k, v in before.items() if k != "full"}
    assert "c" not in s.entries


def test_reserve_bigger_than_the_pool_raises() -> None:
    s = EmbeddingStore(2 * B)
    ready(s, "a")
    assert not s.can_reserve(2 * B + 1)
    with pytest.raises(PoolFull):
        s.reserve("huge", 2 * B + 1, "bfloat16", [1])


def _reserve_ok(s: EmbeddingStore, nbytes: int) -> bool:
    trial = copy.deepcopy(s)
    try:
        trial.reserve("probe", nbytes, "bfloat16", [1])
    except PoolFull:
        return False
    return True


def test_can_reserve_agrees_with_reserve() -> None:
    # Layout: pending [0,1) leased [1,3) ready [3,5) free [5,8) (in blocks).
    s = EmbeddingStore(8 * B)
    s.reserve("pending", B, "bfloat16", [1])
    ready(s, "leased", 2 * B)
    s.lease("r", ["leased"], ttl_s=60)
    ready(s, "evictable", 2 * B)
    for nbytes in [1, B, 3 * B, 3 * B + 1, 5 * B - 1, 5 * B, 5 * B + 1, 6 * B, 8 * B, 9 * B]:
        assert s.can_reserve(nbytes) == _reserve_ok(s, nbytes), nbytes
    assert s.can_reserve(5 * B) and not s.can_reserve(5 * B + 1)


def test_can_reserve_agrees_with_reserve_when_fragmented() -> None:
    # Layout (blocks): ready a [0,1), pending b [1,2), ready c [2,3), pending d [3,4).
    s = EmbeddingStore(4 * B)
    ready(s, "a")
    s.reserve("b", B, "bfloat16", [1])
    ready(s, "c")
    s.reserve("d", B, "bfloat16", [1])
    assert s.can_reserve(2 * B) == _reserve_ok(s, 2 * B)
    with pytest.raises(PoolFull):  # and a reservation that cannot fit evicts nothing
        s.reserve("big", 2 * B, "bfloat16", [1])
    assert {"a", "c"} <= set(s.entries)


def test_lease_and_release() -> None:
    s = EmbeddingStore(4 * B)
    ready(s, "a")
    ready(s, "b")
    s.lease("r1", ["a", "not-there"], ttl_s=60)
    s.lease("r2", ["a", "b"], ttl_s=60)
    assert s.entries["a"].leases == {"r1", "r2"} and s.entries["b"].leases == {"r2"}
    assert s.leases["r1"][0] == {"a"}  # unknown hashes are not held
    assert s.snapshot()["leased_requests"] == 2
    s.release("r2")
    assert s.entries["a"].leases == {"r1"} and s.entries["b"].leases == set()
    s.release("r1")
    s.release("r1")  # twice is harmless
    assert s.entries["a"].leases == set()
    assert s.snapshot()["leased_requests"] == 0


def test_expire_drops_leases_past_their_ttl(clock: OffsetClock) -> None:
    s = EmbeddingStore(4 * B)
    ready(s, "a")
    ready(s, "b")
    s.lease("short", ["a"], ttl_s=10)
    s.lease("long", ["b"], ttl_s=100)
    clock.advance(5)
    assert s.expire(pending_ttl_s=60) == []
    assert s.entries["a"].leases == {"short"}
    clock.advance(10)
    assert s.expire(pending_ttl_s=60) == []  # ready entries never expire, only their leases
    assert set(s.entries) == {"a", "b"}
    assert s.entries["a"].leases == set() and s.entries["b"].leases == {"long"}
    assert set(s.leases) == {"long"}


def test_lease_again_refreshes_expiry(clock: OffsetClock) -> None:
    s = EmbeddingStore(4 * B)
    ready(s, "a")
    s.lease("r", ["a"], ttl_s=10)
    clock.advance(8)
    s.lease("r", [], ttl_s=10)
    clock.advance(8)
    s.expire(pending_ttl_s=60)
    assert s.entries["a"].leases == {"r"}


def test_expire_drops_stale_pending_entries(clock: OffsetClock) -> None:
    s = EmbeddingStore(4 * B)
    s.reserve("old", B, "bfloat16", [1])
    ready(s, "done")
    clock.advance(30)
    young = s.reserve("young", 2 * B, "bfloat16", [1])
    young.created = clock()  # Entry.created reads the real clock; put it on the shifted one
    assert s.expire(pending_ttl_s=60) == []
    clock.advance(31)  # old: 61 s pending, young: 31 s
    assert s.expire(pending_ttl_s=60) == ["old"]
    assert set(s.entries) == {"done", "young"}
    assert s.counters["failed"] == 1
    assert s.snapshot()["bytes_used"] == 3 * B
    clock.advance(30)
    assert s.expire(pending_ttl_s=60) == ["young"]
    assert s.snapshot()["bytes_used"] == B


def test_fail_drops_a_pending_entry_only() -> None:
    s = EmbeddingStore(4 * B)
    s.reserve("p", 3 * B, "bfloat16", [1])
    ready(s, "r")
    s.fail("p")
    assert "p" not in s.entries and s.counters["failed"] == 1
    assert s.allocator.free_bytes == 3 * B
    s.fail("r")  # a ready entry is not failed
    s.fail("missing")
    assert "r" in s.entries and s.counters["failed"] == 1
    s.reserve("p", 3 * B, "bfloat16", [1])  # the hash can be reserved again


def test_snapshot_is_consistent() -> None:
    s = EmbeddingStore(16 * B)
    ready(s, "a", 100)
    ready(s, "b", 3 * B + 1)
    s.reserve("c", B, "bfloat16", [1])
    s.lease("r", ["a"], ttl_s=60)
    snap = s.snapshot()
    assert snap["entries"] == 3
    assert snap["bytes_used"] == B + 4 * B + B
    assert snap["bytes_capacity"] == 16 * B
    assert snap["leased_requests"] == 1
    assert snap["misses"] == 3 and snap["commits"] == 2
    assert all(isinstance(v, float) for v in snap.values())


@pytest.mark.parametrize(("pool", "spill"), [(64 * B, 0), (24 * B, 40 * B)], ids=["one pool", "spill tier"])
def test_store_random_property(pool: int, spill: int) -> None:
    """Random store traffic: within each tier entries never overlap and the byte counts match them;
    can_reserve tells the truth; every spill moves an entry's bytes from where it was to where it is."""
    rng = random.Random(7)
    s = EmbeddingStore(pool, spill_bytes=spill)
    for step in range(3000):
        op, h = rng.random(), f"h{rng.randint(0, 50)}"
        if op < 0.4 and s.lookup(h) is None:
            nbytes = rng.randint(1, 8 * B)
            could, before = s.can_reserve(nbytes), {k: (e.tier, e.offset) for k, e in s.entries.items()}
            try:
                s.reserve(h, nbytes, "bfloat16", [1])
            except PoolFull:
                assert not could, "a reservation failed though can_reserve said yes"
            for move in s.take_spills():  # each a copy the daemon must make: to where the entry now is
                assert before[move.content_hash] == (MAIN, move.src)
                assert (s.entries[move.content_hash].tier, s.entries[move.content_hash].offset) == (SPILL, move.dst)
        elif op < 0.7:
            s.commit(h)
        elif op < 0.8:
            s.fail(h)
        elif op < 0.9:
            s.lease(f"r{rng.randint(0, 5)}", [h], ttl_s=60)
        else:
            s.release(f"r{rng.randint(0, 5)}")
        for tier, used in ((MAIN, "bytes_used"), (SPILL, "spill_bytes_used")):
            spans = sorted((e.offset, e.offset + aligned(e.nbytes)) for e in s.entries.values() if e.tier == tier)
            for (_, end), (start, _) in itertools.pairwise(spans):
                assert end <= start, f"entries overlap at step {step}"
            assert s.snapshot()[used] == sum(b - a for a, b in spans)
        assert all(e.ready for e in s.entries.values() if e.tier == SPILL)  # only committed entries move
        for e in s.entries.values():
            for r in e.leases:
                assert e.content_hash in s.leases[r][0]
    assert (s.counters["spills"] > 100) == bool(spill)  # the traffic exercised the tier where there is one


# --------------------------------------------------------------------------- the spill tier


def test_evicted_entries_move_to_the_spill_tier_and_still_hit() -> None:
    s = EmbeddingStore(2 * B, spill_bytes=4 * B)
    ready(s, "a")
    ready(s, "b")
    s.reserve("c", B, "bfloat16", [1])  # a is the least recently used: it moves, it is not lost
    a = s.entries["a"]
    assert a.tier == SPILL and s.entries["c"].tier == MAIN
    assert s.take_spills() == [Spill("a", src=0, dst=0, nbytes=B)]
    assert s.take_spills() == []  # taken once
    assert s.entries["c"].offset == 0  # a's old bytes: hence the copy must come before the answer
    assert s.lookup("a") is a and s.counters["hits"] == 1
    assert s.counters["spills"] == 1 and s.counters["evictions"] == 0
    snap = s.snapshot()
    assert snap["spilled_entries"] == 1 and snap["spill_bytes_used"] == B and snap["bytes_used"] == 2 * B


def test_a_full_spill_tier_drops_its_own_least_recently_used_unleased_entries() -> None:
    s = EmbeddingStore(B, spill_bytes=2 * B)
    for h in "abc":
        ready(s, h)  # each pushes the previous one into the spill tier
    assert [s.entries[h].tier for h in "abc"] == [SPILL, SPILL, MAIN]
    s.lease("r", ["a"], ttl_s=60)  # a is older than b but leased: b goes
    ready(s, "d")
    assert set(s.entries) == {"a", "c", "d"} and s.entries["c"].tier == SPILL
    assert s.counters["evictions"] == 1 and s.counters["spills"] == 3
    s.lease("r", ["c"], ttl_s=60)
    ready(s, "e")  # the spill tier holds only leased entries: d cannot move there and is gone
    assert set(s.entries) == {"a", "c", "e"} and s.counters["evictions"] == 2


def test_an_entry_larger_than_the_spill_tier_is_evicted_as_without_one() -> None:
    s = EmbeddingStore(4 * B, spill_bytes=2 * B)
    ready(s, "big", 3 * B)
    ready(s, "next", 2 * B)
    assert "big" not in s.entries and s.take_spills() == [] and s.counters["evictions"] == 1


def test_copy_spills_moves_the_bytes(tmp_path: Path) -> None:
    from common.tensor_ref import ShmPool
    from workers.cache.daemon import copy_spills

    main, spill = (ShmPool(f"vlm-test-{tmp_path.name}-{kind}", 8 * B, create=True) for kind in ("main", "spill"))
    try:
        main.buffer[B : 2 * B] = torch.arange(B, dtype=torch.int64).to(torch.uint8)
        copy_spills([Spill("x", src=B, dst=5 * B, nbytes=B)], main, spill)
        assert torch.equal(spill.buffer[5 * B : 6 * B], main.buffer[B : 2 * B])
        assert int(spill.buffer[: 5 * B].count_nonzero()) == 0
    finally:
        main.unlink()
        spill.unlink()


def test_a_spill_tier_without_a_gpu_pool_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "vlm.toml"
    config.write_text("[cache]\nspill_bytes = 1048576\n")
    with pytest.raises(ValueError, match=r"spill_bytes: a spill tier backs a GPU pool"):
        load_config(config, env={})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without a GPU")
def test_a_gpu_embedding_pool_on_a_cpu_host_is_refused_at_start(tmp_path: Path) -> None:
    from workers.cache.daemon import CacheDaemon

    cfg = Config()
    cfg.run_dir, cfg.cache.device_pool = str(tmp_path), True
    with pytest.raises(ValueError, match=r"device_pool = true needs a CUDA GPU"):
        CacheDaemon(cfg)


def test_a_request_waiting_on_a_failed_encode_is_told_why(tmp_path: Path) -> None:
    """The daemon on real sockets: a decoder waiting on an embedding whose encode failed gets the reason the
    fetcher gave (it got "encode failed, expired or the cache restarted" whatever had happened)."""
    import zmq

    from common.protocol import CacheAcquire, CacheAcquireResult, CacheCommit, CacheLookup, decode, encode
    from workers.cache.daemon import CacheDaemon

    cfg = Config()
    cfg.run_dir, cfg.cache.pool_bytes = str(tmp_path), 1 << 20
    daemon = CacheDaemon(cfg)
    decoder = zmq.Context.instance().socket(zmq.DEALER)
    decoder.setsockopt(zmq.IDENTITY, b"decoder")
    decoder.connect(daemon.channel.address)
    try:
        daemon.handle(b"fetcher", CacheLookup("c1", "h" * 64, 4 * 8, "float32", [4, 2]))  # reserved: encode it
        decoder.send(encode(CacheAcquire("c2", "req-1", ["h" * 64])))
        peer, msg = daemon.channel.recv()  # (through the socket: the daemon can now route the answer back)
        assert peer == b"decoder" and msg is not None
        daemon.handle(peer, msg)
        reason = "vision encoder unavailable: no worker is live to take it"
        daemon.handle(b"fetcher", CacheCommit("h" * 64, error=reason))
        assert decoder.poll(5000)
        answer = decode(decoder.recv())
        assert isinstance(answer, CacheAcquireResult) and answer.status == 503
        assert f"({reason}); retry the request" in answer.message
    finally:
        decoder.close(linger=0)
        daemon.channel.close()
        daemon.pool.unlink()
