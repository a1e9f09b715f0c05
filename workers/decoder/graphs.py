"""Decode steps replayed from CUDA graphs.

A decode step (one new token per sequence) launches a few hundred small kernels; from Python, eagerly,
launching them costs far more than running them. `DecodeGraphs` records the whole decode forward once
per batch size of a ladder (1, 2, 4, 8, 16, 24, 32, ...) and afterwards only refreshes its static input
buffers and replays: a batch of n sequences runs in the graph of the smallest size >= n, the spare rows
padded with a sequence of one token that lives in a scratch block nobody else owns.

Every input the graph reads lives in two packed device buffers (int64: token ids, positions, slots;
int32: context lengths, block tables), filled from pinned host buffers by two asynchronous copies.
Attention runs with a fixed split count per batch size (the heuristic's choice for the longest context),
since the graph cannot pick one per step; splits that get no keys cost one early exit each.

Without capture (``capture=False``) the same static-buffer path runs eagerly: how it is tested on CPU.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch

from workers.kernels.attention import AttentionMetadata
from workers.models.language import LanguageModel, mrope_axis, mrope_cos_sin
from workers.models.paged import FusedLayer, PagedAttention, PagedKVCache, StepContext, forward_logits


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_batch`` (itself included)."""
    sizes = [n for n in (1, 2, 4) if n < max_batch] + list(range(8, max_batch, 8))
    return sorted({*sizes, max_batch})


class DecodeGraphs:
    def __init__(
        self,
        model: LanguageModel,
        kv: PagedKVCache,
        *,
        max_batch: int,
        max_context: int,
        scratch_block: int,
        attention: PagedAttention,
        fused: Sequence[FusedLayer] | None,
        capture: bool,
    ) -> None:
        if not 0 <= scratch_block < kv.num_blocks:
            raise ValueError(f"scratch block {scratch_block} is not in the cache's [0, {kv.num_blocks})")
        self.model, self.kv, self.attention, self.fused = model, kv, attention, fused
        self.sizes = graph_batch_sizes(max_batch)
        self.max_context = max_context
        self.max_blocks = -(-max_context // kv.block_size)
        self.scratch_slot = scratch_block * kv.block_size
        self.scratch_block = scratch_block
        device, b = model.device, max_batch
        pin = device.type == "cuda"
        # int64: token ids [b], positions [3, b], slots [b]; int32: context lengths [b], block tables [b, blocks]
        self.host_long = torch.zeros(5 * b, dtype=torch.int64, pin_memory=pin)
        self.host_int = torch.zeros(b + b * self.max_blocks, dtype=torch.int32, pin_memory=pin)
        self.long = torch.zeros(5 * b, dtype=torch.int64, device=device)
        self.int = torch.zeros(b + b * self.max_blocks, dtype=torch.int32, device=device)
        self.query_starts = torch.arange(b + 1, dtype=torch.int32, device=device)
        self.query_lens = torch.ones(b, dtype=torch.int32, device=device)
        self.axis = mrope_axis(model.spec.mrope_section, device)
        self.inv_freq = model._rope_inv_freq()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.runs: Counter[tuple[int, int]] = Counter()  # (sequences, graph size) -> steps
        self.outputs: dict[int, torch.Tensor] = {}
        # Views made once: the staging runs every decode step.
        self.host = self._views(self.host_long, self.host_int)
        self.host_arrays = {name: t.numpy() for name, t in self.host.items()}  # cheap to fill from lists
        self.dev = self._views(self.long, self.int)
        self._fill_padding(0, b)
        self.long.copy_(self.host_long)
        self.int.copy_(self.host_int)
        if capture:
            self._capture()

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def fits(self, num_seqs: int, max_context: int) -> bool:
        return num_seqs <= self.max_batch and max_context <= self.max_context

    def run(
        self,
        token_ids: Sequence[int],
        positions: Sequence[Sequence[int]],
        slots: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """Logits [n, vocab] of one decode step of n sequences (positions: a (t, h, w) triple each).

        The result is a view of the graph's output buffer: valid until the next `run`.
        """
        n = len(token_ids)
        size = next(s for s in self.sizes if s >= n)
        self.runs[n, size] += 1
        width = max(len(t) for t in block_tables)
        self._stage(token_ids, positions, slots, context_lens, block_tables, size, width)
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self._forward(size)[:n]

    # ------------------------------------------------------------------ buffers
    def _views(self, buf_long: torch.Tensor, buf_int: torch.Tensor) -> dict[str, torch.Tensor]:
        b = self.max_batch
        return {
            "token_ids": buf_long[:b],
            "positions": buf_long[b : 4 * b].view(3, b),
            "slots": buf_long[4 * b :],
            "context_lens": buf_int[:b],
            "block_table": buf_int[b:].view(b, self.max_blocks),
        }

    def _stage(
        self,
        token_ids: Sequence[int],
        positions: Sequence[Sequence[int]],
        slots: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        size: int,
        width: int,
    ) -> None:
        n = len(token_ids)
        host = self.host_arrays
        host["token_ids"][:n] = token_ids
        host["positions"][:, :n] = np.asarray(positions, dtype=np.int64).T
        host["slots"][:n] = slots
        host["context_lens"][:n] = context_lens
        table = host["block_table"]
        for row, blocks in enumerate(block_tables):
            table[row, : len(blocks)] = blocks
        self._fill_padding(n, size)
        # The device side only needs rows [:size] and table columns [:width]; the kernels never read a
        # table entry past a context's last block, so stale columns beyond it are harmless.
        host, dev = self.host, self.dev
        for name in ("token_ids", "slots", "context_lens"):
            dev[name][:size].copy_(host[name][:size], non_blocking=True)
        dev["positions"][:, :size].copy_(host["positions"][:, :size], non_blocking=True)
        dev["block_table"][:size, :width].copy_(host["block_table"][:size, :width], non_blocking=True)

    def _fill_padding(self, start: int, end: int) -> None:
        """Rows [start, end): one token at position 0 in the scratch block."""
        host = self.host_arrays
        host["token_ids"][start:end] = 0
        host["positions"][:, start:end] = 0
        host["slots"][start:end] = self.scratch_slot
        host["context_lens"][start:end] = 1
        host["block_table"][start:end, 0] = self.scratch_block

    # ------------------------------------------------------------------ the captured step
    def _forward(self, size: int) -> torch.Tensor:
        model, views = self.model, self.dev
        metadata = AttentionMetadata(
            query_starts=self.query_starts[: size + 1],
            query_lens=self.query_lens[:size],
            context_lens=views["context_lens"][:size],
            block_table=views["block_table"][:size],
            num_tokens=size,
            max_query_len=1,
            max_context_len=self.max_context,  # fixes the split count for every context length
            block_size=self.kv.block_size,
        )
        with torch.inference_mode():
            x = model.embed_tokens(views["token_ids"][:size])
            positions = views["positions"][:, :size]
            cos, sin = mrope_cos_sin(positions, self.inv_freq, model.spec.mrope_section, model.dtype, self.axis)
            slots = views["slots"][:size]
            step = StepContext(cos, sin, slots, metadata, self.kv, self.attention)
            return forward_logits(model, x, step, None, self.fused)

    def _capture(self) -> None:
        pool = None
        # Largest first: the smaller graphs then fit in the memory pool the largest one reserved.
        for size in reversed(self.sizes):
            self._forward(size)  # compiles the Triton kernels for this shape outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
