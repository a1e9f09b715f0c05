"""Where each sequence's tokens of one forward step live: `BatchLayout` on the host (lists, validated, with
the index tensors built from them) and `AttentionMetadata`, its int32 device-side form that the attention
kernels read.

Both sit in the kernels' layer because the kernels take them and the models build them: `workers.models.paged`
re-exports `BatchLayout`, `workers.kernels.attention` re-exports `AttentionMetadata`.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class BatchLayout:
    """Where each sequence's new tokens and context live for one forward.

    Sequence ``s`` contributes ``query_lens[s]`` new tokens at positions ``context_lens[s] -
    query_lens[s] ..`` and attends over positions ``0 .. context_lens[s] - 1``. Construction validates
    and copies the lists (the engine goes on growing its own tables); frozen, because the index tensors
    are built from them on first use, on ``device``, and cached.
    """

    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    block_size: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _tensors: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "query_lens", [int(n) for n in self.query_lens])
        object.__setattr__(self, "context_lens", [int(n) for n in self.context_lens])
        object.__setattr__(self, "block_tables", [[int(b) for b in table] for table in self.block_tables])
        object.__setattr__(self, "device", torch.device(self.device))
        self._validate()

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        num_blocks: int | None = None,
    ) -> BatchLayout:
        """Validated layout; with ``num_blocks`` block ids are also checked against the cache size."""
        layout = cls(list(query_lens), list(context_lens), [list(t) for t in block_tables], block_size, device)
        if num_blocks is not None:
            layout.check_blocks(num_blocks)
        return layout

    @classmethod
    def from_metadata(cls, metadata: AttentionMetadata) -> BatchLayout:
        """The host form of kernel metadata (a device sync): block tables cut to each context's blocks.

        Empty sequences (no new token: the padding of a CUDA-graph step) are left out; tokens past the
        last sequence's belong to none (`paged_attention_reference` gives them zeros)."""
        query_lens, context_lens = metadata.query_lens.tolist(), metadata.context_lens.tolist()
        tables = metadata.block_table.tolist()
        size = metadata.block_size
        kept = [s for s, q in enumerate(query_lens) if q > 0]
        cut = [tables[s][: _blocks_for(context_lens[s], size)] for s in kept]
        return cls([query_lens[s] for s in kept], [context_lens[s] for s in kept], cut, size, metadata.device)

    def to(self, device: torch.device | str) -> BatchLayout:
        device = torch.device(device)
        if device == self.device:
            return self
        # A shallow copy: the lists were validated already, only the cached tensors are per device.
        moved = copy.copy(self)
        object.__setattr__(moved, "device", device)
        object.__setattr__(moved, "_tensors", {name: t.to(device) for name, t in self._tensors.items()})
        return moved

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def past_lens(self) -> list[int]:
        """Tokens per sequence whose k/v were computed by earlier forwards."""
        return [c - q for q, c in zip(self.query_lens, self.context_lens, strict=True)]

    @property
    def query_starts(self) -> list[int]:
        """Flat index of each sequence's first new token, plus T at the end ([B + 1], as cu_seqlens)."""
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        return starts

    @property
    def last_token_indices(self) -> list[int]:
        return [end - 1 for end in self.query_starts[1:]]

    @property
    def slot_mapping(self) -> torch.Tensor:
        """int64 [T]: the slot each new token's k/v is written to."""
        return self._cached("slot_mapping", lambda: self._slots(self.query_lens, self.past_lens))

    @property
    def context_slots(self) -> torch.Tensor:
        """int64 [sum(context_lens)]: every context token's slot, sequence after sequence, in position order."""
        return self._cached("context_slots", lambda: self._slots(self.context_lens, [0] * self.num_seqs))

    @property
    def block_table_tensor(self) -> torch.Tensor:
        """int64 [B, max blocks], padded with -1: the form paged kernels take."""
        return self._cached("block_table", self._padded_block_tables)

    def check_blocks(self, num_blocks: int) -> None:
        """Raise ValueError if a block id does not exist in a cache of ``num_blocks`` blocks."""
        for s, table in enumerate(self.block_tables):
            bad = [b for b in table if not 0 <= b < num_blocks]
            if bad:
                raise ValueError(f"sequence {s} uses block ids {bad} outside the cache's [0, {num_blocks})")

    def _cached(self, name: str, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        if name not in self._tensors:
            # Built on the CPU from the lists, then moved once: no per-step chain of tiny device kernels.
            self._tensors[name] = build().to(self.device)
        return self._tensors[name]

    def _padded_block_tables(self) -> torch.Tensor:
        width = max(len(t) for t in self.block_tables)
        return torch.tensor([t + [-1] * (width - len(t)) for t in self.block_tables], dtype=torch.int64)

    def _slots(self, counts: list[int], firsts: list[int]) -> torch.Tensor:
        """Slots of positions firsts[s] .. firsts[s] + counts[s] - 1 of every sequence, concatenated."""
        counts_t = torch.tensor(counts, dtype=torch.int64)
        seq = torch.repeat_interleave(torch.arange(self.num_seqs), counts_t)
        starts = torch.cumsum(counts_t, 0) - counts_t
        pos = torch.arange(int(counts_t.sum())) - starts[seq] + torch.tensor(firsts, dtype=torch.int64)[seq]
        tables, size = self._padded_block_tables(), self.block_size
        return tables[seq, pos // size] * size + pos % size

    def _validate(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        n = len(self.query_lens)
        if n == 0:
            raise ValueError("a batch needs at least one sequence")
        if len(self.context_lens) != n or len(self.block_tables) != n:
            raise ValueError(
                f"query_lens, context_lens and block_tables must have one entry per sequence, got "
                f"{n}, {len(self.context_lens)} and {len(self.block_tables)}"
            )
        for s, (q, c, table) in enumerate(zip(self.query_lens, self.context_lens, self.block_tables, strict=True)):
            if q < 1:
                raise ValueError(f"sequence {s}: query_len must be >= 1, got {q}")
            if c < q:
                raise ValueError(f"sequence {s}: context_len {c} is smaller than its query_len {q}")
            needed = _blocks_for(c, self.block_size)
            if len(table) < needed:
                raise ValueError(
                    f"sequence {s}: {c} tokens need {needed} blocks of {self.block_size}, block table has {len(table)}"
                )
            if min(table) < 0:
                raise ValueError(f"sequence {s}: negative block id in its block table {table}")
            if len(set(table[:needed])) != needed:
                raise ValueError(f"sequence {s}: block table repeats a block: {table[:needed]}")
        self._check_writes_are_private()

    def _check_writes_are_private(self) -> None:
        # A block written in this forward must belong to its writer alone: otherwise two sequences write
        # the same slots, or one reads slots that another overwrites. Shared (prefix) blocks are read-only;
        # the engine copies a shared partial block (copy_blocks) before appending to it.
        users: dict[int, set[int]] = {}
        for s, (table, c) in enumerate(zip(self.block_tables, self.context_lens, strict=True)):
            for b in table[: _blocks_for(c, self.block_size)]:
                users.setdefault(b, set()).add(s)
        for s, (q, c, table) in enumerate(zip(self.query_lens, self.context_lens, self.block_tables, strict=True)):
            for b in table[(c - q) // self.block_size : _blocks_for(c, self.block_size)]:
                if users[b] != {s}:
                    others = sorted(users[b] - {s})
                    raise ValueError(f"sequence {s} writes block {b}, which sequences {others} also use")


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass(frozen=True)
class AttentionMetadata:
    """int32 per-sequence tensors on the kernel's device, plus the host-side sizes that pick the launch.

    ``block_table`` is [num_seqs, max blocks] padded with -1 (as `BatchLayout.block_table_tensor`); the
    kernel never reads an entry past a sequence's context.
    """

    query_starts: torch.Tensor  # [num_seqs + 1], cu_seqlens of the flat queries
    query_lens: torch.Tensor  # [num_seqs]
    context_lens: torch.Tensor  # [num_seqs]
    block_table: torch.Tensor  # [num_seqs, max blocks]
    num_tokens: int
    max_query_len: int
    max_context_len: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return self.query_lens.shape[0]

    @property
    def device(self) -> torch.device:
        return self.query_lens.device

    @functools.cached_property
    def context_total(self) -> torch.Tensor:
        """int32 [1]: the batch's keys in all, summed on the device once for every layer of a step (in a
        captured graph, once per replay): balanced decode splits are cut from it."""
        return self.context_lens.sum(dtype=torch.int32).view(1)

    @classmethod
    def from_layout(cls, layout: BatchLayout, device: torch.device | str | None = None) -> AttentionMetadata:
        device = torch.device(device) if device is not None else layout.device
        b = layout.num_seqs
        width = max(len(t) for t in layout.block_tables)
        tables = [t + [-1] * (width - len(t)) for t in layout.block_tables]
        # One int32 tensor built on the host and moved in one copy, then viewed as its four parts: a step
        # pays for one small host-to-device transfer instead of four.
        flat = [*layout.query_starts, *layout.query_lens, *layout.context_lens, *(b for t in tables for b in t)]
        packed = torch.tensor(flat, dtype=torch.int32).to(device)
        starts, lens, ctx, table = torch.split(packed, [b + 1, b, b, b * width])
        return cls(
            query_starts=starts,
            query_lens=lens,
            context_lens=ctx,
            block_table=table.view(b, width),
            num_tokens=layout.num_tokens,
            max_query_len=max(layout.query_lens),
            max_context_len=max(layout.context_lens),
            block_size=layout.block_size,
        )
