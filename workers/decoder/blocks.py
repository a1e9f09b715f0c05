"""Paged KV blocks for the decoder, with a prefix cache that tells images apart.

The KV cache is ``num_blocks`` physical blocks of ``block_size`` token slots. Each sequence owns a
``BlockTable`` (its blocks in order); the engine writes token ``p``'s KV into slot ``p % block_size``
of ``table.blocks[p // block_size]``.

Token keys. The prefix cache matches sequences by *keys*, not token ids: an ordinary token's key is
its id, an image/video placeholder's key comes from ``media_token_keys(content_hash, count)``. The
placeholder ids of two different images are identical, so keying on ids would hand one image's KV to
another; keying on content makes "same tokens, same media at the same place" the only way to share.

Prefix cache. A *full* block whose KV is computed is registered under a chained digest
``H(digest of the previous block, keys of this block)``, so a block is found only after the same
whole prefix. Lookups verify more than the digest: the stored keys must equal ours and the block's
recorded parent must be exactly the block matched one step earlier (same id, same registration).
A digest collision, even one in an earlier block of the chain, therefore costs a miss, never wrong KV.

Block life cycle. A block is *used* (ref_count > 0, held by that many tables) or *free*. Free blocks
are either plain (never registered, or evicted) or *cached* (registered, reusable by a later prefix
hit). Fresh blocks come from the plain pool first, then by evicting the least recently freed cached
block. Tables free their blocks tail first, so a prefix outlives its continuations in the LRU.

Engine protocol::

    table = BlockTable()
    if manager.can_allocate(keys, table):          # exact: True iff allocate succeeds now
        cached = manager.allocate(keys, table)     # compute KV for keys[cached:] only
    manager.commit(keys, table, num_computed)      # after each forward: keys[:num_computed] have KV
    if manager.can_append(table, 1):               # before a decode step feeds the next token
        manager.append(table, 1)                   # the table now covers one more token
    manager.free(table)                            # finished or preempted; the table can be reused

Misuse (double free, appending to a freed table, committing tokens the table does not cover, ...)
raises ``ValueError``; allocating or appending without enough free blocks raises
``OutOfBlocksError`` (a ``ValueError``) and changes nothing.
"""

from __future__ import annotations

import hashlib
import operator
from array import array
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

# Media keys live in [2**62, 2**63): above any vocabulary, so never equal to a token id, and still
# non-negative int64 so they hash as the same 8 bytes as token ids do.
MEDIA_KEY_MIN = 1 << 62
MAX_KEY = (1 << 63) - 1
_MEDIA_KEY_LOW_BITS = MEDIA_KEY_MIN - 1
# Odd, so k -> k * stride is a bijection mod 2**62: the keys of one media item are all distinct.
_MEDIA_KEY_STRIDE = 0x9E3779B97F4A7C15
_MEDIA_KEY_PERSON = b"vlm-serve-media"

_DIGEST_SIZE = 16
_ROOT_DIGEST = bytes(_DIGEST_SIZE)
_KEY_BYTES = 8

# A registered block's identity: (block id, registration generation). Stale once the block is evicted.
_Identity = tuple[int, int]
_ROOT: _Identity = (-1, 0)
_NO_PARENT = -2  # the parent block id stored for a block that is not registered (-1 is the root)


def _count(value: int, name: str) -> int:
    """A token count as a plain int (numpy ints welcome), or ``ValueError``."""
    try:
        count = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None
    if count < 0:
        raise ValueError(f"{name} must be non-negative, got {count}")
    return count


def media_token_keys(content_hash: str, count: int) -> list[int]:
    """Keys for the ``count`` placeholder tokens of one image or video, in order.

    ``key(k) = 2**62 | ((base ^ k * STRIDE) mod 2**62)`` with ``base`` a 64-bit blake2b digest of
    the content hash. Within one item the keys are distinct (odd stride); two items agree at a
    position pair only if their 62-bit bases differ by exactly that pair's stride pattern, a
    ~2**-62 event per pair (and a block is reused only if every key in it agrees). Keys are
    >= 2**62, far above any vocabulary, so a media key never equals a token id.
    The content hash already covers the preprocessing parameters (so the grid), and the position
    inside the item is in the key, so the same image with the same token ids shares KV and a
    different image never does.
    """
    if not isinstance(content_hash, str) or not content_hash:
        raise ValueError("content_hash must be a non-empty string")
    count = _count(count, "count")
    digest = hashlib.blake2b(content_hash.encode(), digest_size=8, person=_MEDIA_KEY_PERSON).digest()
    base = np.uint64(int.from_bytes(digest, "little"))
    index = np.arange(count, dtype=np.uint64)
    # uint64 array arithmetic wraps modulo 2**64, which is what the formula wants.
    keys = ((index * np.uint64(_MEDIA_KEY_STRIDE)) ^ base) & np.uint64(_MEDIA_KEY_LOW_BITS)
    return (keys | np.uint64(MEDIA_KEY_MIN)).tolist()


def _block_hash(parent_digest: bytes, block_keys: bytes) -> bytes:
    """Chained digest of one full block (a module function so tests can force collisions)."""
    return hashlib.blake2b(parent_digest + block_keys, digest_size=_DIGEST_SIZE).digest()


def _key_bytes(keys: Sequence[int]) -> bytes:
    """Keys as little-endian int64 bytes: the form they are hashed and stored in."""
    try:
        array = np.asarray(keys)
    except (OverflowError, TypeError, ValueError) as exc:
        raise ValueError(f"keys must be a flat sequence of ints in [0, 2**63): {exc}") from exc
    if array.ndim != 1:
        raise ValueError(f"keys must be a flat sequence of ints, got shape {array.shape}")
    if array.size == 0:
        return b""
    if array.dtype.kind not in "iu":
        raise ValueError(f"keys must be ints in [0, 2**63), got dtype {array.dtype}")
    if array.min() < 0 or array.max() > MAX_KEY:
        raise ValueError("keys must be ints in [0, 2**63)")
    return array.astype("<i8", copy=False).tobytes()


class OutOfBlocksError(ValueError):
    """``allocate``/``append`` without enough free blocks (``can_*`` said no); nothing was changed."""


@dataclass(eq=False)  # a table is an identity: two sequences with equal block lists are not one table
class BlockTable:
    """One sequence's blocks. Written by ``BlockManager`` only; the engine reads it."""

    blocks: list[int] = field(default_factory=list)  # physical block ids, in token order
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache at allocation
    num_tokens: int = 0  # tokens the table covers (slots the engine may write); 0 when not allocated


@dataclass
class _Match:
    """The cached prefix of a key sequence: reusable blocks and where their chain ends."""

    blocks: list[int]
    digest: bytes
    parent: _Identity


@dataclass(eq=False)
class _Live:
    """The manager's own record of an allocated table (the engine's copy is checked against it)."""

    table: BlockTable
    blocks: list[int]
    num_tokens: int
    num_hashed: int  # leading blocks already walked by the cache (hits at allocation + commits)
    digest: bytes  # chained digest after ``num_hashed`` blocks
    parent: _Identity | None  # registered block standing for our prefix; None once a conflict broke it


class _FreeOrder:
    """Blocks in the order they were freed (least recently first), as a list linked through two arrays made at their
    full size: adding, removing and taking the oldest allocate nothing."""

    def __init__(self, num_blocks: int) -> None:
        self._end = num_blocks  # the sentinel: its next is the oldest block, its previous the newest
        self._next = array("q", range(1, num_blocks + 2))
        self._prev = array("q", range(-1, num_blocks))
        self._next[self._end] = self._prev[self._end] = self._end
        self._member = bytearray(num_blocks)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __contains__(self, block: int) -> bool:
        return bool(self._member[block])

    def __iter__(self) -> Iterator[int]:
        """Oldest first."""
        block = self._next[self._end]
        while block != self._end:
            yield block
            block = self._next[block]

    def add(self, block: int) -> None:
        """``block`` becomes the most recently freed."""
        last = self._prev[self._end]
        self._next[last], self._prev[block], self._next[block], self._prev[self._end] = block, last, self._end, block
        self._member[block] = 1
        self._count += 1

    def remove(self, block: int) -> None:
        before, after = self._prev[block], self._next[block]
        self._next[before], self._prev[after] = after, before
        self._member[block] = 0
        self._count -= 1

    def pop_oldest(self) -> int:
        block = self._next[self._end]
        self.remove(block)
        return block


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._ref = [0] * num_blocks
        # Registration of a block in the prefix cache: its digest (None: not registered), its keys and its parent's
        # identity. The keys and parents live in arrays made here at their full size, written in place: a Python
        # object per registered block would grow the process's heap until every block had been registered once,
        # which on a large GPU cache takes minutes of traffic and looks like a leak.
        self._digest: list[bytes | None] = [None] * num_blocks
        self._key_rows = memoryview(bytearray(num_blocks * block_size * _KEY_BYTES))
        self._parent_block = array("q", [_NO_PARENT]) * num_blocks
        self._parent_generation = array("q", [0]) * num_blocks
        self._generation = array("q", [0]) * num_blocks
        self._cache: dict[bytes, int] = {}
        self._plain: deque[int] = deque(range(num_blocks))
        self._evictable = _FreeOrder(num_blocks)  # free cached blocks, least recently freed first
        self._live: dict[int, _Live] = {}  # by id(table); holding the table keeps its id from being reused
        # can_allocate then allocate walk the same keys; the walk only changes when registrations do.
        self._cache_version = 0
        self._last_match: tuple[int, bytes, _Match] | None = None
        self.counters: dict[str, float] = {
            "prefix_queries_tokens": 0.0,  # prompt tokens looked up at allocation
            "prefix_hit_tokens": 0.0,  # of those, served from the cache
            "prefix_hit_blocks": 0.0,
            "prefix_revived_blocks": 0.0,  # hits on free cached blocks (they become used again)
            "prefix_conflicts": 0.0,  # commits that found their digest taken by a different block
            "blocks_allocated": 0.0,  # fresh blocks handed out by allocate and append
            "blocks_registered": 0.0,
            "blocks_evicted_from_cache": 0.0,
            "tables_allocated": 0.0,
            "tables_freed": 0.0,
        }

    # ------------------------------------------------------------------ queries
    def num_free_blocks(self) -> int:
        """Blocks a fresh allocation can take: plain free ones plus free cached ones (evicted on use)."""
        return len(self._plain) + len(self._evictable)

    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold reusable prefix KV."""
        return len(self._evictable)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ allocation
    def can_allocate(self, keys: Sequence[int], table: BlockTable) -> bool:
        """Whether ``allocate(keys, table)`` would succeed now. Raises ``ValueError`` on misuse, like allocate."""
        buf = self._check_allocatable(keys, table)
        match = self._match_prefix(buf)
        return self._fresh_needed(buf, match) <= self._free_besides(match)

    def allocate(self, keys: Sequence[int], table: BlockTable) -> int:
        """Give ``table`` blocks for all ``len(keys)`` tokens, reusing the cached prefix.

        Returns (and stores in ``table.num_cached_tokens``) how many leading tokens already have KV:
        a multiple of ``block_size``, and always less than ``len(keys)`` so the last token is computed
        (its logits are needed). Raises ``OutOfBlocksError`` and changes nothing if blocks are short.
        """
        buf = self._check_allocatable(keys, table)
        match = self._match_prefix(buf)
        fresh, available = self._fresh_needed(buf, match), self._free_besides(match)
        if fresh > available:
            raise OutOfBlocksError(f"allocation needs {fresh} fresh blocks but {available} are free")
        for block in match.blocks:  # claim hits first: a fresh block must not evict one of them
            self._take_cached(block)
        blocks = match.blocks + [self._take_fresh() for _ in range(fresh)]
        num_tokens = len(buf) // _KEY_BYTES
        cached = len(match.blocks) * self.block_size
        self._live[id(table)] = _Live(table, list(blocks), num_tokens, len(match.blocks), match.digest, match.parent)
        table.blocks, table.num_tokens, table.num_cached_tokens = blocks, num_tokens, cached
        if self.enable_prefix_cache:
            self.counters["prefix_queries_tokens"] += num_tokens
            self.counters["prefix_hit_tokens"] += cached
            self.counters["prefix_hit_blocks"] += len(match.blocks)
        self.counters["tables_allocated"] += 1
        return cached

    def _check_allocatable(self, keys: Sequence[int], table: BlockTable) -> bytes:
        if id(table) in self._live:
            raise ValueError("table is already allocated; free it before allocating it again")
        if table.blocks:
            raise ValueError("table holds blocks this manager did not allocate (or was edited after free)")
        buf = _key_bytes(keys)
        if not buf:
            raise ValueError("cannot allocate an empty sequence: keys is empty")
        return buf

    def _match_prefix(self, buf: bytes) -> _Match:
        """Longest run of cached full blocks from the start, leaving at least the last token uncached."""
        if not self.enable_prefix_cache:
            return _Match([], _ROOT_DIGEST, _ROOT)
        if self._last_match is not None and self._last_match[0] == self._cache_version and self._last_match[1] == buf:
            return self._last_match[2]
        stride = self.block_size * _KEY_BYTES
        # Blocks wholly before the last token: if the whole prompt is cached we still recompute its
        # last block, since the last token's logits are needed and a shared block must not be written.
        reusable = (len(buf) // _KEY_BYTES - 1) // self.block_size
        match = _Match([], _ROOT_DIGEST, _ROOT)
        for i in range(reusable):
            chunk = buf[i * stride : (i + 1) * stride]
            digest = _block_hash(match.digest, chunk)
            block = self._cache.get(digest)
            if block is None or not self._holds(block, chunk, match.parent):
                break
            match.blocks.append(block)
            match.digest, match.parent = digest, (block, self._generation[block])
        self._last_match = (self._cache_version, buf, match)
        return match

    def _fresh_needed(self, buf: bytes, match: _Match) -> int:
        return self._blocks_for(len(buf) // _KEY_BYTES) - len(match.blocks)

    def _free_besides(self, match: _Match) -> int:
        """Free blocks left for fresh use once the hits among the free cached blocks are claimed."""
        revived = sum(1 for block in match.blocks if self._ref[block] == 0)
        return self.num_free_blocks() - revived

    def _take_cached(self, block: int) -> None:
        if self._ref[block] == 0:
            self._evictable.remove(block)
            self.counters["prefix_revived_blocks"] += 1
        self._ref[block] += 1

    def _take_fresh(self) -> int:
        if self._plain:
            block = self._plain.popleft()
        else:
            block = self._evictable.pop_oldest()
            self._unregister(block)
            self.counters["blocks_evicted_from_cache"] += 1
        self._ref[block] = 1
        self.counters["blocks_allocated"] += 1
        return block

    # ------------------------------------------------------------------ growth
    def can_append(self, table: BlockTable, num_tokens: int) -> bool:
        """Whether ``append(table, num_tokens)`` would succeed now (``num_tokens`` is a delta)."""
        live = self._require_live(table, "can_append to")
        return self._growth_blocks(live, _count(num_tokens, "num_tokens (tokens to add)")) <= self.num_free_blocks()

    def can_append_all(self, growth: Sequence[tuple[BlockTable, int]]) -> bool:
        """Whether ``append(table, n)`` would succeed for every (table, n) pair, one after another
        (an ``n`` <= 0 needs nothing)."""
        needed = sum(self._growth_blocks(self._require_live(t, "can_append to"), max(n, 0)) for t, n in growth)
        return needed <= self.num_free_blocks()

    def append(self, table: BlockTable, num_tokens: int) -> None:
        """Grow the table by ``num_tokens`` more tokens (a delta, not a total), adding blocks as needed.

        Afterwards ``table.num_tokens`` is the new total. Raises ``OutOfBlocksError`` and changes
        nothing if blocks are short.
        """
        live = self._require_live(table, "append to")
        num_tokens = _count(num_tokens, "num_tokens (tokens to add)")
        needed = self._growth_blocks(live, num_tokens)
        if needed > self.num_free_blocks():
            raise OutOfBlocksError(f"append needs {needed} fresh blocks but {self.num_free_blocks()} are free")
        fresh = [self._take_fresh() for _ in range(needed)]
        live.blocks.extend(fresh)
        table.blocks.extend(fresh)
        live.num_tokens += num_tokens
        table.num_tokens = live.num_tokens

    def _growth_blocks(self, live: _Live, num_tokens: int) -> int:
        return self._blocks_for(live.num_tokens + num_tokens) - len(live.blocks)

    # ------------------------------------------------------------------ prefix registration
    def commit(self, keys: Sequence[int], table: BlockTable, num_computed: int) -> None:
        """Record that ``keys[:num_computed]`` now have KV in the table: full blocks join the prefix cache.

        ``keys`` is the sequence's key list (at least ``num_computed`` long; later entries are ignored)
        and must agree with the keys given to ``allocate`` and earlier commits. Calling it again with
        the same or a smaller ``num_computed`` does nothing.
        """
        live = self._require_live(table, "commit")
        num_computed = _count(num_computed, "num_computed")
        if num_computed > live.num_tokens:
            raise ValueError(f"num_computed must lie in [0, {live.num_tokens}] (tokens the table covers)")
        if len(keys) < num_computed:
            raise ValueError(f"keys has {len(keys)} entries, fewer than num_computed={num_computed}")
        full = num_computed // self.block_size
        if not self.enable_prefix_cache or live.parent is None or full <= live.num_hashed:
            return
        start = live.num_hashed
        buf = _key_bytes(keys[start * self.block_size : full * self.block_size])
        stride = self.block_size * _KEY_BYTES
        for offset, index in enumerate(range(start, full)):
            chunk = buf[offset * stride : (offset + 1) * stride]
            digest = _block_hash(live.digest, chunk)
            live.parent = self._register_or_join(live.blocks[index], digest, chunk, live.parent)
            live.digest, live.num_hashed = digest, index + 1
            if live.parent is None:
                break

    def _register_or_join(self, block: int, digest: bytes, chunk: bytes, parent: _Identity) -> _Identity | None:
        """Register ``block``; or, if an equal block got there first, continue the chain through it."""
        owner = self._cache.get(digest)
        if owner is None:
            return self._register(block, digest, chunk, parent)
        if self._holds(owner, chunk, parent):
            return owner, self._generation[owner]  # same prefix computed twice; ours stays private
        # A digest collision (or a stale entry): registering anything further from this table could
        # chain onto the wrong KV, so this table stops contributing to the cache.
        self.counters["prefix_conflicts"] += 1
        return None

    def _keys_of(self, block: int) -> memoryview:
        stride = self.block_size * _KEY_BYTES
        return self._key_rows[block * stride : (block + 1) * stride]

    def _parent_of(self, block: int) -> _Identity | None:
        parent = self._parent_block[block]
        return None if parent == _NO_PARENT else (parent, self._parent_generation[block])

    def _holds(self, block: int, chunk: bytes, parent: _Identity) -> bool:
        """The registered ``block`` stands for ``chunk``'s keys after the block ``parent``."""
        return self._parent_of(block) == parent and self._keys_of(block) == chunk

    def _register(self, block: int, digest: bytes, chunk: bytes, parent: _Identity) -> _Identity:
        self._generation[block] += 1
        self._cache[digest] = block
        self._digest[block] = digest
        self._keys_of(block)[:] = chunk
        self._parent_block[block], self._parent_generation[block] = parent
        self._cache_version += 1
        self.counters["blocks_registered"] += 1
        return block, self._generation[block]

    def _unregister(self, block: int) -> None:
        digest = self._digest[block]
        if digest is not None:  # always, for an evictable block; checked rather than asserted
            del self._cache[digest]
        self._digest[block] = None
        self._parent_block[block] = _NO_PARENT
        self._cache_version += 1

    # ------------------------------------------------------------------ release
    def free(self, table: BlockTable) -> None:
        """Release the table's blocks; afterwards it is empty and may be allocated again."""
        live = self._require_live(table, "free")
        del self._live[id(table)]
        # Tail first: within one freed sequence the LRU then evicts continuations before prefixes.
        for block in reversed(live.blocks):
            self._ref[block] -= 1
            if self._ref[block] > 0:
                continue
            if self._digest[block] is None:
                self._plain.append(block)
            else:
                self._evictable.add(block)
        table.blocks, table.num_tokens, table.num_cached_tokens = [], 0, 0
        self.counters["tables_freed"] += 1

    def _require_live(self, table: BlockTable, action: str) -> _Live:
        live = self._live.get(id(table))
        if live is None:
            raise ValueError(f"cannot {action} a table that is not allocated (already freed, or never allocated)")
        return live

    # ------------------------------------------------------------------ self-check
    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` listing every inconsistency found; O(blocks + table entries)."""
        problems = self._table_problems() + self._block_problems() + self._cache_problems()
        if problems:
            shown = "; ".join(problems[:20])
            more = f" (+{len(problems) - 20} more)" if len(problems) > 20 else ""
            raise RuntimeError(f"block manager is inconsistent: {shown}{more}")

    def _table_problems(self) -> list[str]:
        problems = []
        for live in self._live.values():
            table, name = live.table, f"table@{id(live.table):#x}"
            if table.blocks != live.blocks or table.num_tokens != live.num_tokens:
                problems.append(f"{name} was edited outside the manager")
            if live.num_tokens < 1 or len(live.blocks) != self._blocks_for(live.num_tokens):
                problems.append(f"{name} has {len(live.blocks)} blocks for {live.num_tokens} tokens")
            if len(set(live.blocks)) != len(live.blocks):
                problems.append(f"{name} holds a block twice")
            if any(not 0 <= block < self.num_blocks for block in live.blocks):
                problems.append(f"{name} holds an out-of-range block id")
                continue
            if live.num_hashed * self.block_size > live.num_tokens:
                problems.append(f"{name} hashed {live.num_hashed} blocks beyond its {live.num_tokens} tokens")
            # Blocks past the cached/committed prefix get written: they must be private and unregistered.
            for block in live.blocks[live.num_hashed :]:
                if self._ref[block] != 1 or self._digest[block] is not None:
                    problems.append(f"{name}: writable block {block} is shared or registered")
        return problems

    def _block_problems(self) -> list[str]:
        problems = []
        holders = [0] * self.num_blocks
        for live in self._live.values():
            for block in live.blocks:
                if 0 <= block < self.num_blocks:
                    holders[block] += 1
        plain = set(self._plain)
        if len(plain) != len(self._plain):
            problems.append("the free list has duplicates")
        for block in range(self.num_blocks):
            ref, registered = self._ref[block], self._digest[block] is not None
            free_states = (block in plain) + (block in self._evictable)
            if ref != holders[block]:
                problems.append(f"block {block} has ref_count {ref} but {holders[block]} tables hold it")
            if (ref > 0 and free_states) or (ref == 0 and free_states != 1) or ref < 0:
                problems.append(f"block {block} (ref_count {ref}) is in {free_states} free pools")
            if block in plain and registered:
                problems.append(f"block {block} is registered but in the plain free pool")
            if block in self._evictable and not registered:
                problems.append(f"block {block} is evictable but not registered")
            if ref > 1 and not registered:
                problems.append(f"block {block} is shared but not a cached block")
        return problems

    def _cache_problems(self) -> list[str]:
        problems = []
        if not self.enable_prefix_cache and self._cache:
            problems.append("the prefix cache is disabled but has entries")
        for digest, block in self._cache.items():
            if not 0 <= block < self.num_blocks or self._digest[block] != digest:
                problems.append(f"cache entry for block {block} disagrees with the block's digest")
        for block in range(self.num_blocks):
            digest = self._digest[block]
            if (digest is None) != (self._parent_of(block) is None):
                problems.append(f"block {block} is half registered")
            elif digest is not None and self._cache.get(digest) != block:
                problems.append(f"block {block} has a digest the cache does not map to it")
        return problems
