"""Engine steps replayed from CUDA graphs.

Launched eagerly from Python, one forward costs far more host time than GPU time: a decode step is a few
hundred small kernels, and even a prefill of hundreds of tokens is launch bound (Triton's launcher is slow
per kernel). `StepGraphs` records the forward once per shape and afterwards only refreshes
its static input buffers and replays. Two ladders of shapes:

- decode graphs, one per batch size (1, 2, 4, 8, 16, 24, ...): one new token per sequence, the token ids
  read on the device (so the sampled ids of the previous step can be fed without a trip to the host);
- mixed graphs, one per token count (32, 64, 128, then multiples of 128 up to 1,024 and of 256 beyond):
  any mix of prefill chunks and decodes of up to ``max_seqs`` sequences, from input embeddings (media
  rows already merged).

A step runs in the smallest graph that holds it. Padding is made of *empty* sequences (no new token,
no context: attention skips them) and of tokens that belong to no sequence; those tokens' k/v go to a
scratch block that no sequence owns and their rows are never read, so whatever they compute is
harmless. Every input lives in two packed device buffers (int64: token ids, slots, logits rows,
positions; int32: query starts and lengths, context lengths, block tables), filled from pinned host
buffers by asynchronous copies. The host buffers alternate between two sets: with the engine's
overlap a step is staged while the previous one may still be copying from the other set.
Attention runs with the split count that the longest context would get, since a graph cannot choose
per step; splits that get no keys cost one early exit each.

DeepStack (Qwen3-VL): a mixed step can hold visual rows, whose feature sets are added after the first decoder
layers. Their count varies per step, a graph's shapes cannot, so the sets live in one dense static buffer
[K, tokens, hidden] that is zero outside the step's visual rows and is added whole (`paged.DenseDeepStack`).
Chosen over padded row indices with zero features: the add is a plain elementwise one, exact and deterministic
(no scatter with repeated indices, no need for a padding token that a full graph lacks), and it costs K adds
of [tokens, hidden] per mixed step, small beside the layers' GEMMs. Staging zeroes only the rows the previous
step wrote. Decode graphs never carry visual rows (placeholders do not decode), and a model without DeepStack
gets neither the buffer nor the adds.

Without capture (``capture=False``) the same static-buffer path runs eagerly: how it is tested on CPU.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workers.decoder.config import EngineConfig
from workers.kernels.attention import AttentionMetadata
from workers.models.language import LanguageModel, mrope_cos_sin
from workers.models.paged import (
    DenseDeepStack,
    FusedLayer,
    PagedAttention,
    PagedKVCache,
    StepContext,
    StepDeepStack,
    forward_logits,
    rope_tables,
)
from workers.models.tensor_parallel import TensorParallel


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_batch`` (itself included)."""
    sizes = [n for n in (1, 2, 4) if n < max_batch] + list(range(8, max_batch, 8))
    return sorted({*sizes, max_batch})


def graph_token_sizes(max_tokens: int) -> list[int]:
    """32, 64, then multiples of 128 up to 1,024 and of 256 beyond, up to ``max_tokens`` (included); none
    for 0. At most ~12% of a mixed graph's tokens are padding once a step has more than 128."""
    if max_tokens <= 0:
        return []
    ladder = [32, 64, *range(128, 1024, 128), *range(1024, max_tokens, 256)]
    return sorted({*(n for n in ladder if n < max_tokens), max_tokens})


def engine_graphs(
    model: LanguageModel,
    kv: PagedKVCache,
    config: EngineConfig,
    fused: Sequence[FusedLayer] | None,
    tp: TensorParallel | None = None,
) -> StepGraphs:
    """The graphs an engine with ``config`` replays (captured for ``graphs = "cuda"``). Rank 0 (`ModelRunner`)
    and every other rank of a tensor-parallel group build theirs here, so that their captures and replays
    pair up. ``kv`` has one block more than the manager's ``num_blocks``: the padding tokens' scratch block."""
    return StepGraphs(
        model,
        kv,
        max_seqs=config.max_running,
        # a step's decodes pass the budget
        max_tokens=min(config.graph_tokens, config.prefill_budget + config.max_running),
        max_context=config.max_model_len,
        scratch_block=config.num_blocks,
        attention=config.attention,
        fused=fused,
        capture=config.graphs == "cuda",
        tp=tp,
    )


@dataclass(frozen=True)
class GraphKey:
    tokens: int
    seqs: int
    decode: bool  # one token per sequence, token ids in; else embeddings in


@dataclass
class StepInputs:
    """One step's host-side description, sequence after sequence (as `BatchLayout` orders tokens)."""

    positions: np.ndarray  # int64 [3, T]
    slots: np.ndarray  # int64 [T]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    rows: list[int]  # flat token indices whose logits are wanted (mixed steps)

    @property
    def num_tokens(self) -> int:
        return self.slots.shape[0]


class _Staging:
    """Packed buffers with named views: int64 ``token_ids, slots, rows, positions``; int32 ``meta``
    (query starts, query lengths, context lengths) and ``block_table``."""

    def __init__(self, tokens: int, seqs: int, max_blocks: int, device: torch.device, pin: bool) -> None:
        t, s = tokens, seqs
        self.long = torch.zeros(5 * t + s, dtype=torch.int64, device=device, pin_memory=pin)
        self.int = torch.zeros(3 * s + 1 + s * max_blocks, dtype=torch.int32, device=device, pin_memory=pin)
        self.token_ids = self.long[:t]
        self.slots = self.long[t : 2 * t]
        self.rows = self.long[2 * t : 2 * t + s]
        self.positions = self.long[2 * t + s :].view(3, t)
        self.meta = self.int[: 3 * s + 1]
        self.query_starts = self.int[: s + 1]
        self.query_lens = self.int[s + 1 : 2 * s + 1]
        self.context_lens = self.int[2 * s + 1 : 3 * s + 1]
        self.block_table = self.int[3 * s + 1 :].view(s, max_blocks)


class StepGraphs:
    def __init__(
        self,
        model: LanguageModel,
        kv: PagedKVCache,
        *,
        max_seqs: int,
        max_tokens: int,
        max_context: int,
        scratch_block: int,
        attention: PagedAttention,
        fused: Sequence[FusedLayer] | None,
        capture: bool,
        tp: TensorParallel | None = None,
    ) -> None:
        """``max_tokens``: the largest mixed graph (0: decode graphs only). ``tp``: this rank's share of a
        tensor-parallel model (its collectives are captured too; every rank captures the same shapes in
        the same order and replays them in lockstep)."""
        if not 0 <= scratch_block < kv.num_blocks:
            raise ValueError(f"scratch block {scratch_block} is not in the cache's [0, {kv.num_blocks})")
        self.model, self.kv, self.attention, self.fused, self.tp = model, kv, attention, fused, tp
        self.decode_sizes = graph_batch_sizes(max_seqs)
        self.token_sizes = graph_token_sizes(max_tokens)
        self.max_seqs = max_seqs
        self.max_context = max_context
        self.max_blocks = -(-max_context // kv.block_size)
        self.scratch_slot = scratch_block * kv.block_size
        device = model.device
        tokens = max([max_seqs, *self.token_sizes])
        pin = device.type == "cuda"
        self.hosts = [_Staging(tokens, max_seqs, self.max_blocks, torch.device("cpu"), pin) for _ in range(2)]
        self.host_arrays = [{name: getattr(h, name).numpy() for name in _ARRAYS} for h in self.hosts]
        self.flip = 0  # which host set the next step stages into
        self.dev = _Staging(tokens, max_seqs, self.max_blocks, device, False)
        self.embeds = torch.zeros((tokens, model.spec.hidden_size), dtype=model.dtype, device=device)
        self.inv_freq, self.axis = rope_tables(model)
        sets = model.spec.num_deepstack
        # [K, tokens, hidden], zero outside the current step's visual rows (see the module's docstring)
        self.deepstack = (
            torch.zeros((sets, tokens, model.spec.hidden_size), dtype=model.dtype, device=device) if sets else None
        )
        self.deepstack_dirty = 0  # rows [0, this) of the buffer may hold the previous step's sets
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        self.runs: Counter[tuple[int, int]] = Counter()  # decode: (sequences, graph size) -> steps
        self.mixed_runs: Counter[tuple[int, int]] = Counter()  # mixed: (tokens, graph tokens) -> steps
        if capture:
            self._capture()

    def keys(self) -> list[GraphKey]:
        decode = [GraphKey(n, n, True) for n in self.decode_sizes]
        return decode + [GraphKey(t, self.max_seqs, False) for t in self.token_sizes]

    def fits_decode(self, num_seqs: int, max_context: int) -> bool:
        return num_seqs <= self.decode_sizes[-1] and max_context <= self.max_context

    def fits_mixed(self, num_tokens: int, num_seqs: int, max_context: int) -> bool:
        return (
            bool(self.token_sizes)
            and num_tokens <= self.token_sizes[-1]
            and num_seqs <= self.max_seqs
            and max_context <= self.max_context
        )

    # ------------------------------------------------------------------ steps
    def decode(
        self, inputs: StepInputs, token_ids: Sequence[int] | None, device_token_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [n, vocab] of one decode step of n sequences; the token ids come from
        ``device_token_ids`` [n] when given (int64 on the model's device, e.g. the previous step's sampled
        ids), else from the host list. The result is a view of the graph's output buffer: valid until the
        next step."""
        n = len(inputs.query_lens)
        size = next(s for s in self.decode_sizes if s >= n)
        self.runs[n, size] += 1
        key = GraphKey(size, size, True)
        self._stage(inputs, key, token_ids if device_token_ids is None else None)
        if device_token_ids is not None:
            self.dev.token_ids[:n].copy_(device_token_ids)  # after the staged copy, on the same stream
        return self._replay(key)[:n]

    def mixed(self, inputs: StepInputs, embeds: torch.Tensor, deepstack: StepDeepStack | None = None) -> torch.Tensor:
        """Logits [len(inputs.rows), vocab] of one step of prefill chunks and decodes, from embeddings
        [T, hidden] on the model's device. ``deepstack``: the step's visual rows (flat indices < T) and their
        sets, for a model with DeepStack. A view of the graph's output buffer, as for `decode`."""
        t = inputs.num_tokens
        size = next(s for s in self.token_sizes if s >= t)
        self.mixed_runs[t, size] += 1
        key = GraphKey(size, self.max_seqs, False)
        self._stage(inputs, key, None)
        self.embeds[:t].copy_(embeds)
        self._stage_deepstack(deepstack, t)
        return self._replay(key)[: len(inputs.rows)]

    def _stage_deepstack(self, deepstack: StepDeepStack | None, tokens: int) -> None:
        """Zero what the previous step wrote, then lay this step's sets on their rows (on the stream, in order)."""
        if self.deepstack is None:
            if deepstack is not None and deepstack.rows.numel():
                raise ValueError("DeepStack sets for a model without DeepStack layers")
            return
        if self.deepstack_dirty:
            self.deepstack[:, : self.deepstack_dirty].zero_()
            self.deepstack_dirty = 0
        if deepstack is None or not deepstack.rows.numel():
            return
        if deepstack.features.shape[0] != self.deepstack.shape[0]:
            raise ValueError(f"{deepstack.features.shape[0]} DeepStack sets for a model of {self.deepstack.shape[0]}")
        staged = deepstack.to(self.deepstack.device, self.deepstack.dtype)
        self.deepstack.index_copy_(1, staged.rows, staged.features)
        self.deepstack_dirty = tokens  # (the rows lie below the step's token count; no read of the device)

    def _replay(self, key: GraphKey) -> torch.Tensor:
        if key in self.graphs:
            self.graphs[key].replay()
            return self.outputs[key]
        return self._forward(key)

    # ------------------------------------------------------------------ buffers
    def _stage(self, inputs: StepInputs, key: GraphKey, token_ids: Sequence[int] | None) -> None:
        host, arrays = self.hosts[self.flip], self.host_arrays[self.flip]
        self.flip ^= 1
        t, s = inputs.num_tokens, len(inputs.query_lens)
        if token_ids is not None:
            arrays["token_ids"][:t] = token_ids
        arrays["token_ids"][t : key.tokens] = 0
        arrays["positions"][:, :t] = inputs.positions
        arrays["positions"][:, t : key.tokens] = 0
        arrays["slots"][:t] = inputs.slots
        arrays["slots"][t : key.tokens] = self.scratch_slot  # tokens of no sequence
        arrays["rows"][: len(inputs.rows)] = inputs.rows
        arrays["rows"][len(inputs.rows) : key.seqs] = 0
        starts = arrays["query_starts"]
        starts[0] = 0
        np.cumsum(inputs.query_lens, out=starts[1 : s + 1])
        starts[s + 1 : key.seqs + 1] = t  # empty sequences
        arrays["query_lens"][:s] = inputs.query_lens
        arrays["query_lens"][s : key.seqs] = 0
        arrays["context_lens"][:s] = inputs.context_lens
        arrays["context_lens"][s : key.seqs] = 0
        table = arrays["block_table"]
        width = 1
        for row, blocks in enumerate(inputs.block_tables):
            table[row, : len(blocks)] = blocks
            width = max(width, len(blocks))
        # The kernels never read a table entry past a context's last block, nor any of an empty sequence.
        dev = self.dev
        dev.token_ids[: key.tokens].copy_(host.token_ids[: key.tokens], non_blocking=True)
        dev.slots[: key.tokens].copy_(host.slots[: key.tokens], non_blocking=True)
        dev.rows[: key.seqs].copy_(host.rows[: key.seqs], non_blocking=True)
        dev.positions[:, : key.tokens].copy_(host.positions[:, : key.tokens], non_blocking=True)
        dev.meta.copy_(host.meta, non_blocking=True)
        dev.block_table[: key.seqs, :width].copy_(host.block_table[: key.seqs, :width], non_blocking=True)

    # ------------------------------------------------------------------ the captured forward
    def _forward(self, key: GraphKey) -> torch.Tensor:
        model, dev, t, s = self.model, self.dev, key.tokens, key.seqs
        metadata = AttentionMetadata(
            query_starts=dev.query_starts[: s + 1],
            query_lens=dev.query_lens[:s],
            context_lens=dev.context_lens[:s],
            block_table=dev.block_table[:s],
            num_tokens=t,
            max_query_len=1 if key.decode else t,  # decode: one query row per program
            max_context_len=self.max_context,  # fixes the split count for every context length
            block_size=self.kv.block_size,
        )
        with torch.inference_mode():
            x = self._embed(dev.token_ids[:t]) if key.decode else self.embeds[:t]
            positions = dev.positions[:, :t]
            cos, sin = mrope_cos_sin(positions, self.inv_freq, model.spec.mrope_section, model.dtype, self.axis)
            # decode graphs never see a visual row; a mixed graph of a DeepStack model always adds its buffer
            deepstack = None if key.decode or self.deepstack is None else DenseDeepStack(self.deepstack[:, :t])
            step = StepContext(cos, sin, dev.slots[:t], metadata, self.kv, self.attention, self.tp, deepstack)
            return forward_logits(model, x, step, None if key.decode else dev.rows[:s], self.fused)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight
        return torch.nn.functional.embedding(ids, weight) if self.tp is None else self.tp.embed(weight, ids)

    def release(self) -> None:
        """Destroy the captured graphs (after the work in flight): a tensor-parallel rank must, before its
        NCCL communicator is destroyed, since the graphs hold that communicator's collectives."""
        if self.graphs:
            torch.cuda.synchronize()
            for graph in self.graphs.values():
                graph.reset()
            self.graphs.clear()
            self.outputs.clear()

    def _capture(self) -> None:
        pool = None
        # Largest first: the smaller graphs then fit in the memory pool the larger ones reserved.
        for key in sorted(self.keys(), key=lambda k: (k.tokens, k.seqs), reverse=True):
            self._forward(key)  # compiles the Triton kernels for this shape outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self._forward(key)
            pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()


_ARRAYS = ("token_ids", "slots", "rows", "positions", "query_starts", "query_lens", "context_lens", "block_table")
