"""The paged-KV block manager: accounting, the multimodal prefix cache, LRU eviction, misuse, and a
seeded property test that checks, against a model of the KV contents, that reused KV is always right."""

from __future__ import annotations

import gc
import hashlib
import random
import time
import tracemalloc
from dataclasses import dataclass, field

import numpy as np
import pytest

from workers.decoder import blocks
from workers.decoder.blocks import MEDIA_KEY_MIN, BlockManager, BlockTable, OutOfBlocksError, media_token_keys

IMAGE_TOKEN = 151655  # Qwen2-VL's <|image_pad|>: every placeholder has this id, whatever the image


def committed(manager: BlockManager, keys: list[int]) -> BlockTable:
    """A table whose whole sequence has been computed and committed."""
    table = BlockTable()
    manager.allocate(keys, table)
    manager.commit(keys, table, len(keys))
    manager.check_integrity()
    return table


def allocated(manager: BlockManager, keys: list[int]) -> BlockTable:
    table = BlockTable()
    manager.allocate(keys, table)
    manager.check_integrity()
    return table


def internals(manager: BlockManager) -> tuple[object, ...]:
    """Everything an operation could change, to check that a refused one changed nothing."""
    return (
        list(manager._ref),
        list(manager._plain),
        list(manager._evictable),
        dict(manager._cache),
        list(manager._digest),
        list(manager._generation),
        dict(manager.counters),
    )


# --------------------------------------------------------------------------- media keys


def test_media_keys_are_distinct_deterministic_and_above_token_ids() -> None:
    keys = media_token_keys("sha256:aaaa", 5000)
    assert keys == media_token_keys("sha256:aaaa", 5000)
    assert len(set(keys)) == 5000
    assert all(MEDIA_KEY_MIN <= k < 2**63 and type(k) is int for k in keys)
    other = media_token_keys("sha256:aaab", 5000)
    assert not set(keys) & set(other)
    assert media_token_keys("sha256:aaaa", 3) == keys[:3]  # a key depends on the position, not the count
    assert media_token_keys("x", 0) == []


def test_media_keys_are_fast() -> None:
    media_token_keys("warm-up", 10)
    start = time.perf_counter()
    for i in range(100):
        media_token_keys(f"hash{i}", 4096)
    assert (time.perf_counter() - start) / 100 < 1e-3


@pytest.mark.parametrize(("content_hash", "count"), [("", 3), (None, 3), ("abc", -1), ("abc", 2.5)])
def test_media_keys_reject_bad_arguments(content_hash: object, count: object) -> None:
    with pytest.raises(ValueError):
        media_token_keys(content_hash, count)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- accounting


def test_allocate_and_free_accounting() -> None:
    manager = BlockManager(num_blocks=10, block_size=4)
    table = BlockTable()
    assert manager.can_allocate(list(range(9)), table)
    assert manager.allocate(list(range(9)), table) == 0
    assert (table.blocks, table.num_tokens, table.num_cached_tokens) == ([0, 1, 2], 9, 0)
    assert manager.num_free_blocks() == 7
    manager.check_integrity()
    manager.free(table)
    assert (table.blocks, table.num_tokens, table.num_cached_tokens) == ([], 0, 0)
    assert manager.num_free_blocks() == 10
    assert manager.counters["blocks_allocated"] == 3
    manager.check_integrity()
    assert manager.allocate([1, 2], table) == 0  # a freed table can be allocated again
    manager.check_integrity()


def test_append_takes_a_delta_and_adds_blocks_only_at_block_boundaries() -> None:
    manager = BlockManager(num_blocks=3, block_size=4)
    table = allocated(manager, [1, 2, 3, 4])
    assert len(table.blocks) == 1
    manager.append(table, 1)
    assert (len(table.blocks), table.num_tokens) == (2, 5)
    manager.append(table, 3)
    assert (len(table.blocks), table.num_tokens) == (2, 8)
    manager.append(table, 0)
    assert (len(table.blocks), table.num_tokens) == (2, 8)
    assert manager.can_append(table, 4) and not manager.can_append(table, 5)
    before = internals(manager)
    with pytest.raises(OutOfBlocksError):
        manager.append(table, 5)
    assert internals(manager) == before and table.num_tokens == 8
    manager.append(table, np.int64(4))  # numpy ints are fine
    assert (table.blocks, table.num_tokens, manager.num_free_blocks()) == ([0, 1, 2], 12, 0)
    manager.check_integrity()


def test_out_of_blocks_changes_nothing() -> None:
    manager = BlockManager(num_blocks=2, block_size=2)
    committed(manager, [1, 2, 3])
    table = BlockTable()
    assert not manager.can_allocate([5, 6, 7], table)
    before = internals(manager)
    with pytest.raises(OutOfBlocksError):
        manager.allocate([5, 6, 7], table)
    assert internals(manager) == before
    assert (table.blocks, table.num_tokens) == ([], 0)
    manager.check_integrity()
    assert not manager.can_allocate(list(range(100)), BlockTable())  # more than the whole pool


# --------------------------------------------------------------------------- prefix cache


def test_shared_prefix_hits_and_counts() -> None:
    manager = BlockManager(num_blocks=10, block_size=4)
    first = committed(manager, list(range(12)))
    second = BlockTable()
    keys = [*range(8), 50, 51, 52, 53, 54, 55]
    assert manager.allocate(keys, second) == 8
    assert second.num_cached_tokens == 8
    assert second.blocks[:2] == first.blocks[:2]
    assert not set(second.blocks[2:]) & set(first.blocks)
    assert manager.counters["prefix_queries_tokens"] == 12 + 14
    assert manager.counters["prefix_hit_tokens"] == 8
    assert manager.counters["prefix_hit_blocks"] == 2
    assert manager.num_free_blocks() == 10 - 3 - 2
    manager.check_integrity()


def test_uncommitted_blocks_are_not_reused() -> None:
    manager = BlockManager(num_blocks=10, block_size=4)
    first = allocated(manager, list(range(12)))
    manager.commit(list(range(12)), first, 7)  # only block 0 is fully computed
    assert manager.allocate(list(range(12)), BlockTable()) == 4


def test_commit_is_incremental_across_calls() -> None:
    manager = BlockManager(num_blocks=10, block_size=2)
    keys = list(range(9))
    table = allocated(manager, keys)
    for num_computed in (1, 3, 3, 2, 6, 9):  # chunked prefill; repeats and smaller values do nothing
        manager.commit(keys, table, num_computed)
        manager.check_integrity()
    assert manager.counters["blocks_registered"] == 4
    assert manager.allocate(keys, BlockTable()) == 8


def media_prompt(content_hash: str) -> tuple[list[int], list[int]]:
    """(token ids, keys) for 6 text tokens, a 6-token image and 4 text tokens."""
    ids = [11, 12, 13, 14, 15, 16] + [IMAGE_TOKEN] * 6 + [21, 22, 23, 24]
    keys = ids[:6] + media_token_keys(content_hash, 6) + ids[12:]
    return ids, keys


def test_same_token_ids_with_a_different_image_miss() -> None:
    manager = BlockManager(num_blocks=20, block_size=4)
    ids_a, keys_a = media_prompt("image-a")
    ids_b, keys_b = media_prompt("image-b")
    assert ids_a == ids_b
    committed(manager, keys_a)
    # Block 0 is text only; block 1 holds text and the first image tokens, so it differs.
    assert manager.allocate(keys_b, BlockTable()) == 4


def test_same_image_at_the_same_place_hits() -> None:
    manager = BlockManager(num_blocks=20, block_size=4)
    _, keys = media_prompt("image-a")
    committed(manager, keys)
    assert manager.allocate([*keys, 99], BlockTable()) == 16


def test_same_image_at_another_place_misses() -> None:
    manager = BlockManager(num_blocks=20, block_size=4)
    image = media_token_keys("image-a", 8)
    committed(manager, [1, 2, 3, 4, *image, 9])
    assert manager.allocate([1, 2, 3, 5, *image, 9], BlockTable()) == 0


def test_never_the_whole_prompt() -> None:
    manager = BlockManager(num_blocks=20, block_size=4)
    keys = list(range(8))
    committed(manager, keys)
    assert manager.allocate(keys, BlockTable()) == 4  # all cached, yet the last block is recomputed
    assert manager.allocate([*keys, 8], BlockTable()) == 8
    assert manager.allocate(keys[:5], BlockTable()) == 4
    assert manager.allocate(keys[:4], BlockTable()) == 0
    assert manager.allocate(keys[:1], BlockTable()) == 0


def test_never_the_whole_prompt_with_single_token_blocks() -> None:
    manager = BlockManager(num_blocks=20, block_size=1)
    committed(manager, [5, 6, 7])
    assert manager.allocate([5, 6, 7], BlockTable()) == 2
    assert manager.allocate([5], BlockTable()) == 0


def test_prefix_cache_can_be_disabled() -> None:
    manager = BlockManager(num_blocks=10, block_size=2, enable_prefix_cache=False)
    committed(manager, [1, 2, 3, 4, 5])
    assert manager.allocate([1, 2, 3, 4, 5], BlockTable()) == 0
    assert manager.counters["blocks_registered"] == 0
    manager.check_integrity()


def test_generated_tokens_join_the_cache_after_append_and_commit() -> None:
    manager = BlockManager(num_blocks=10, block_size=2)
    keys = [1, 2, 3]
    table = committed(manager, keys)
    for token in (4, 5, 6):  # decode: append a slot for the token, compute it, commit
        keys.append(token)
        manager.append(table, 1)
        manager.commit(keys, table, len(keys))
        manager.check_integrity()
    assert manager.allocate([*keys, 7], BlockTable()) == 6


def test_the_same_prompt_computed_twice_is_cached_once_and_the_chain_continues() -> None:
    manager = BlockManager(num_blocks=20, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    first, second = allocated(manager, prompt), allocated(manager, prompt)  # both miss: nothing committed yet
    manager.commit(prompt, first, 5)
    manager.commit(prompt, second, 5)
    assert manager.counters["blocks_registered"] == 2  # second's copies stay private
    manager.check_integrity()
    longer = [*prompt, 6, 7, 8]
    manager.append(second, 3)
    manager.commit(longer, second, 8)  # second's block 2 chains on through first's blocks
    manager.check_integrity()
    assert manager.allocate([*longer, 9], BlockTable()) == 8
    manager.free(first)
    manager.free(second)
    manager.check_integrity()


# --------------------------------------------------------------------------- collision guard


def test_colliding_digests_with_different_keys_are_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blocks, "_block_hash", lambda parent, keys: b"same digest 16 b")
    manager = BlockManager(num_blocks=20, block_size=2)
    committed(manager, [1, 2, 3, 4, 5])
    assert manager.allocate([7, 8, 3, 4, 5], BlockTable()) == 0
    assert manager.allocate([1, 2, 3, 4, 5], BlockTable()) == 2  # block 1 collides with block 0: not cached
    manager.check_integrity()


def test_a_collision_earlier_in_the_chain_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a digest that ignores the parent, [a|c] and [b|c] give block c one digest; the stored
    keys match, so only the parent check stops [b|c] from reusing the c computed after a."""
    monkeypatch.setattr(blocks, "_block_hash", lambda parent, keys: hashlib.blake2b(keys, digest_size=16).digest())
    manager = BlockManager(num_blocks=20, block_size=2)
    a_then_c, b_then_c = [1, 1, 5, 5, 9], [2, 2, 5, 5, 9]
    committed(manager, a_then_c)
    committed(manager, b_then_c)
    assert manager.counters["prefix_conflicts"] == 1  # b's c could not be registered
    assert manager.allocate(b_then_c, BlockTable()) == 2
    assert manager.allocate(a_then_c, BlockTable()) == 4
    manager.check_integrity()


# --------------------------------------------------------------------------- eviction


def test_free_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    a, b = committed(manager, [1, 2, 9]), committed(manager, [3, 4, 9])
    assert (a.blocks, b.blocks) == ([0, 1], [2, 3])
    manager.free(a)
    manager.free(b)
    assert manager.num_free_blocks() == 4 and manager.num_cached_free_blocks() == 2
    # Three fresh blocks: the two never-registered ones first, then a's cached block (freed before b's).
    c = allocated(manager, [7, 7, 7, 7, 7])
    assert c.blocks == [1, 3, 0]
    assert manager.counters["blocks_evicted_from_cache"] == 1
    # b's block is still cached, but reviving it leaves no block for the rest: can_allocate knows.
    assert not manager.can_allocate([3, 4, 9], BlockTable())
    manager.free(c)
    assert manager.allocate([3, 4, 9], BlockTable()) == 2
    assert manager.counters["prefix_revived_blocks"] == 1
    assert manager.allocate([1, 2, 9], BlockTable()) == 0
    manager.check_integrity()


def test_a_hit_refreshes_a_block_in_the_lru() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    a, b = committed(manager, [1, 2, 9]), committed(manager, [3, 4, 9])
    manager.free(a)
    manager.free(b)
    again = allocated(manager, [1, 2, 8])  # revives a's block (block 0) and takes plain block 1
    manager.free(again)  # block 0 is now the most recently freed
    filler = allocated(manager, [7, 7, 7, 7, 7])  # plain 1 and 3, then evicts b's block 2, not block 0
    assert sorted(filler.blocks) == [1, 2, 3]
    manager.free(filler)
    assert manager.allocate([1, 2, 9], BlockTable()) == 2


def test_a_freed_sequence_loses_its_tail_before_its_prefix() -> None:
    manager = BlockManager(num_blocks=5, block_size=2)
    keys = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    manager.free(committed(manager, keys))
    filler = allocated(manager, [0, 0, 0, 0, 0])  # needs 3: plain block 4, then the two last full blocks
    assert filler.blocks == [4, 3, 2]
    manager.free(filler)
    assert manager.allocate(keys, BlockTable()) == 4


# --------------------------------------------------------------------------- ref counts and integrity


def test_two_tables_share_blocks_with_ref_counts() -> None:
    manager = BlockManager(num_blocks=10, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    first = committed(manager, prompt)
    second = allocated(manager, [*prompt, 6])
    shared = first.blocks[:2]
    assert second.blocks[:2] == shared
    assert [manager._ref[b] for b in shared] == [2, 2]
    manager.free(first)
    assert [manager._ref[b] for b in shared] == [1, 1]
    assert manager.num_free_blocks() == 10 - 3  # first's private tail came back, the shared blocks did not
    manager.check_integrity()
    manager.free(second)
    assert manager.num_free_blocks() == 10
    assert manager.num_cached_free_blocks() == 2
    manager.check_integrity()


def test_check_integrity_reports_tampering() -> None:
    manager = BlockManager(num_blocks=6, block_size=2)
    table = committed(manager, [1, 2, 3])
    table.blocks.append(5)
    with pytest.raises(RuntimeError, match="edited outside"):
        manager.check_integrity()
    table.blocks.pop()
    manager.check_integrity()
    manager._ref[4] = 1
    with pytest.raises(RuntimeError, match="ref_count"):
        manager.check_integrity()
    manager._ref[4] = 0
    manager._plain.append(4)
    with pytest.raises(RuntimeError, match="duplicates"):
        manager.check_integrity()


# --------------------------------------------------------------------------- misuse


def test_misuse_raises_value_error() -> None:
    manager = BlockManager(num_blocks=10, block_size=2)
    table = allocated(manager, [1, 2, 3])
    with pytest.raises(ValueError, match="already allocated"):
        manager.allocate([1], table)
    with pytest.raises(ValueError, match="already allocated"):
        manager.can_allocate([1], table)
    with pytest.raises(ValueError, match="num_computed"):
        manager.commit([1, 2, 3, 4], table, 4)  # the table covers 3 tokens
    with pytest.raises(ValueError, match="fewer than num_computed"):
        manager.commit([1, 2], table, 3)
    with pytest.raises(ValueError, match="non-negative"):
        manager.append(table, -1)
    with pytest.raises(ValueError, match="must be an int"):
        manager.can_append(table, 1.5)  # type: ignore[arg-type]
    manager.free(table)
    for call in (
        lambda: manager.free(table),
        lambda: manager.append(table, 1),
        lambda: manager.can_append(table, 1),
        lambda: manager.commit([1, 2, 3], table, 3),
    ):
        with pytest.raises(ValueError, match="not allocated"):
            call()
    with pytest.raises(ValueError, match="empty"):
        manager.allocate([], BlockTable())
    with pytest.raises(ValueError, match="did not allocate"):
        manager.allocate([1], BlockTable(blocks=[3]))
    for bad in ([-1], [2**63], [2**64], [1.5], [[1, 2]], ["a"]):
        with pytest.raises(ValueError):
            manager.allocate(bad, BlockTable())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=4)
    with pytest.raises(ValueError):
        BlockManager(num_blocks=4, block_size=0)
    manager.check_integrity()


def test_keys_may_be_a_numpy_array() -> None:
    manager = BlockManager(num_blocks=10, block_size=2)
    keys = np.array([1, 2, 3, 4, 5], dtype=np.int64)
    committed(manager, keys)  # type: ignore[arg-type]
    assert manager.allocate([1, 2, 3, 4, 5], BlockTable()) == 4


# --------------------------------------------------------------------------- property test


@dataclass
class ModelSeq:
    table: BlockTable
    keys: list[int]
    computed: int


@dataclass
class World:
    """The manager plus a model of the engine: which KV every slot holds. A slot's KV is modelled as
    the key prefix it was computed from, so reused KV is right iff it equals our own prefix."""

    rng: random.Random
    manager: BlockManager
    bases: list[list[int]]
    live: list[ModelSeq] = field(default_factory=list)
    spare_tables: list[BlockTable] = field(default_factory=list)
    slots: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)

    def new_keys(self) -> list[int]:
        base = self.rng.choice(self.bases)
        tail = [self.rng.randint(1, 3) for _ in range(self.rng.randint(0, 3))]
        return base[: self.rng.randint(1, len(base))] + tail

    def allocate(self) -> None:
        keys = self.new_keys()
        table = self.spare_tables.pop() if self.spare_tables and self.rng.random() < 0.5 else BlockTable()
        expected = self.manager.can_allocate(keys, table)
        before = internals(self.manager)
        try:
            cached = self.manager.allocate(keys, table)
        except OutOfBlocksError:
            assert not expected
            assert internals(self.manager) == before and table.blocks == []
            self.spare_tables.append(table)
            return
        assert expected
        bs = self.manager.block_size
        assert cached == table.num_cached_tokens and cached % bs == 0 and 0 <= cached < len(keys)
        assert table.num_tokens == len(keys) and len(table.blocks) == -(-len(keys) // bs)
        for pos in range(cached):  # every reused slot holds the KV of exactly our prefix
            assert self.slots.get((table.blocks[pos // bs], pos % bs)) == tuple(keys[: pos + 1])
        self.live.append(ModelSeq(table, keys, cached))

    def compute(self) -> None:
        seq = self.rng.choice(self.live)
        bs = self.manager.block_size
        target = self.rng.randint(seq.computed, seq.table.num_tokens)
        for pos in range(seq.computed, target):
            block = seq.table.blocks[pos // bs]
            # A written block must belong to this sequence alone.
            assert sum(block in other.table.blocks for other in self.live) == 1
            self.slots[(block, pos % bs)] = tuple(seq.keys[: pos + 1])
        seq.computed = target
        self.manager.commit(seq.keys, seq.table, target)

    def append(self) -> None:
        seq = self.rng.choice(self.live)
        count = self.rng.choice([0, 1, 1, 1, 2, self.manager.block_size + 1])
        expected = self.manager.can_append(seq.table, count)
        try:
            self.manager.append(seq.table, count)
        except OutOfBlocksError:
            assert not expected
            return
        assert expected
        seq.keys += [self.rng.randint(1, 3) for _ in range(count)]
        assert seq.table.num_tokens == len(seq.keys)

    def free(self) -> None:
        seq = self.live.pop(self.rng.randrange(len(self.live)))
        self.manager.free(seq.table)
        self.spare_tables.append(seq.table)

    def step(self) -> None:
        roll = self.rng.random()
        if roll < 0.35 or not self.live:
            self.allocate()
        elif roll < 0.65:
            self.compute()
        elif roll < 0.85:
            self.append()
        else:
            self.free()
        self.manager.check_integrity()
        used = {block for seq in self.live for block in seq.table.blocks}
        assert self.manager.num_free_blocks() == self.manager.num_blocks - len(used)


def random_world(seed: int) -> World:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 3, 4])
    manager = BlockManager(num_blocks=rng.randint(1, 14), block_size=block_size)
    image = media_token_keys(f"image{rng.randint(0, 1)}", 2 * block_size)
    bases = [[rng.randint(1, 3) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    bases.append([1, 2, *image, 3])
    return World(rng, manager, bases)


def weak_digest(parent: bytes, keys: bytes) -> bytes:
    """Collides constantly: only the block's first key counts, the parent not at all."""
    return keys[:8].ljust(16, b"\0")


@pytest.mark.parametrize("digest", ["blake2b", "weak"])
def test_random_operations_keep_every_invariant(digest: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if digest == "weak":
        monkeypatch.setattr(blocks, "_block_hash", weak_digest)
    hits = 0.0
    for seed in range(150):
        world = random_world(seed)
        for _ in range(200):
            world.step()
        for seq in list(world.live):
            world.manager.free(seq.table)
        world.manager.check_integrity()
        assert world.manager.num_free_blocks() == world.manager.num_blocks
        hits += world.manager.counters["prefix_hit_tokens"]
    assert hits > 0  # the workload does exercise the cache


# --------------------------------------------------------------------------- memory


def test_filling_the_prefix_cache_allocates_little_per_block() -> None:
    """Registering a block writes the manager's arrays in place: the heap barely grows while the cache fills (on a
    GPU's tens of thousands of blocks that takes minutes of traffic, where a Python object per block looked like a
    leak in the soak), and not at all once every block has been registered and the cache evicts."""
    num_blocks, block_size = 2048, 64
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 150_000, 16 * block_size + 5).tolist() for _ in range(3 * num_blocks // 17)]
    gc.collect()
    tracemalloc.start()
    try:
        manager = BlockManager(num_blocks, block_size)
        built = tracemalloc.get_traced_memory()[0]
        for i, keys in enumerate(prompts):  # unique prompts: 16 full blocks each, then a partial one
            table = BlockTable()
            manager.allocate(keys, table)
            manager.commit(keys, table, len(keys))
            manager.free(table)
            if i == num_blocks // 17:
                full = tracemalloc.get_traced_memory()[0]
        evicted = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert manager.counters["blocks_evicted_from_cache"] > num_blocks  # the cache filled, then turned over
    assert (full - built) / num_blocks < 250  # bytes per block (a digest and its index entry)
    assert abs(evicted - full) / num_blocks < 50
    manager.check_integrity()
