"""The decoder's model runner: owns the device state (the model, its paged KV cache, fused layers, CUDA graphs,
the tensor-parallel ranks) and turns a scheduled batch into one forward and its sampling.

A step runs one of three ways (`tp.EAGER`, `DECODE_GRAPH`, `MIXED_GRAPH`): a decode graph when every row
samples one token and the graphs hold the batch, a mixed graph for any step of up to ``graph_tokens`` tokens,
else eagerly. Under tensor parallelism rank 0 broadcasts the step (`tp.StepPayload`) and every rank runs its
share the same way. Rows marked `ahead` take their input ids from the device (the previous step's sampled
tokens, not yet read by the host); they come first in the batch.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from workers.decoder.batch import (
    Scheduled,
    decode_inputs,
    positions,
    step_deepstack,
    step_embeddings,
    step_inputs,
    tp_payload,
)
from workers.decoder.config import EngineConfig
from workers.decoder.grammar import Grammars, constrain
from workers.decoder.graphs import engine_graphs
from workers.decoder.sampling import SampleFuture, sample_async
from workers.decoder.tp import DECODE_GRAPH, EAGER, MIXED_GRAPH, RankForward, StepBroadcast
from workers.models.language import LanguageModel
from workers.models.paged import BatchLayout, PagedKVCache, fuse_layers, kv_cache_dtype, paged_forward
from workers.models.spec import ModelSpec


class ModelRunner:
    def __init__(
        self,
        model: LanguageModel,
        spec: ModelSpec,
        config: EngineConfig,
        counters: dict[str, float],
        tp_steps: StepBroadcast | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        """``tp_steps``: this is rank 0 of a tensor-parallel group; each step is broadcast, then run.
        ``grammars``: the structured-output matchers' tokenizer and bitmask filler."""
        self.model, self.spec, self.config, self.counters, self.tp_steps = model, spec, config, counters, tp_steps
        # (served, never trained: a parameter requiring grad would chain every step's inputs copied into the step
        # graphs' static buffers into one autograd graph, kept alive without end; the loaders already turn it off)
        model.requires_grad_(False)
        self.grammars = grammars
        self.fused = fuse_layers(model) if config.fuse else None
        # The graphs' padding tokens need a block that no sequence owns: one more than the manager hands out.
        graphs = config.graphs != "off"
        cache_dtype = kv_cache_dtype(config.kv_cache_dtype, model.dtype)
        self.kv = PagedKVCache.for_model(model, config.num_blocks + graphs, config.block_size, cache_dtype)
        tp = tp_steps.tp if tp_steps is not None else None
        self.graphs = engine_graphs(model, self.kv, config, self.fused, tp) if graphs else None
        self.rank_forward = None
        if tp_steps is not None:
            self.rank_forward = RankForward(model, self.kv, config.attention, tp_steps.tp, self.fused, self.graphs)

    def run(self, batch: list[Scheduled], ahead_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the rows that sample, in order. ``ahead_ids``: the input ids (on the device) of the batch's
        first rows, those marked `ahead`.

        Counts the host's time building and launching the forward by kind of step: on a GPU the forward
        itself runs on after this returns, so a step kind whose launch time nears its GPU time leaves the
        GPU waiting for the host."""
        started = time.perf_counter()
        # A decode graph takes the ids from the host or all from the device, not some from each.
        mode = self._mode(batch, decode_graph=ahead_ids is None or len(ahead_ids) == len(batch))
        logits = self._forward(batch, mode, ahead_ids)
        self.counters["steps"] += 1
        self.counters["graph_steps"] += mode != EAGER
        self.counters["decode_graph_steps"] += mode == DECODE_GRAPH
        self.counters["decode_launch_s" if mode == DECODE_GRAPH else "other_launch_s"] += time.perf_counter() - started
        return logits

    def sample(self, batch: list[Scheduled], logits: torch.Tensor) -> SampleFuture:
        """Launch the sampling of ``batch``'s rows (one row of ``logits`` each) on the device. The constrained
        rows' grammar masks are filled here on the host: with overlapped steps this runs after the previous
        step's tokens were read and fed to the matchers, while the device computes this step's forward."""
        rows = [item.seq.sampling_row(self.spec.eos_token_ids) for item in batch]
        started = time.perf_counter()
        rows, mask = constrain(self.grammars, [item.seq.matcher for item in batch], rows)
        if mask is not None:
            self.counters["grammar_rows"] += len(mask.rows)
            self.counters["grammar_fill_s"] += time.perf_counter() - started
        return sample_async(logits, rows, mask)

    def _mode(self, batch: list[Scheduled], decode_graph: bool = True) -> int:
        """How the step runs: a decode graph, a mixed graph (any step of up to ``graph_tokens``), or eagerly."""
        if decode_graph and self._decode_graphable(batch):
            return DECODE_GRAPH
        tokens = sum(b.num_new for b in batch)
        context = max(b.seq.num_computed + b.num_new for b in batch)
        if self.graphs is not None and self.graphs.fits_mixed(tokens, len(batch), context):
            return MIXED_GRAPH
        return EAGER

    def _decode_graphable(self, batch: list[Scheduled]) -> bool:
        """A decode step the graphs take: one sampled token per sequence, none of them a media placeholder
        (those have no token embedding), within the graphs' batch and context."""
        if self.graphs is None or not all(item.num_new == 1 and item.samples for item in batch):
            return False
        if not self.graphs.fits_decode(len(batch), max(item.seq.num_computed + 1 for item in batch)):
            return False
        return not any(
            item.seq.num_computed < len(item.seq.prompt_ids) and bool(item.seq.media_mask[item.seq.num_computed])
            for item in batch
        )

    def _forward(self, batch: list[Scheduled], mode: int, ahead_ids: torch.Tensor | None) -> torch.Tensor:
        ends = np.cumsum([b.num_new for b in batch]) - 1
        logits_for = [int(ends[i]) for i, b in enumerate(batch) if b.samples]
        block_size = self.config.block_size
        if self.rank_forward is not None and self.tp_steps is not None:
            rows = [] if mode == DECODE_GRAPH else logits_for  # a decode graph gives every row
            payload = tp_payload(batch, rows, mode, block_size, self.model.dtype, self.spec.hidden_size, ahead_ids)
            self.tp_steps.send(payload)  # the other ranks get the step, then this rank runs its share
            return self.rank_forward(payload)
        if mode == DECODE_GRAPH and self.graphs is not None:
            inputs, ids = decode_inputs(batch, block_size)
            return self.graphs.decode(inputs, ids, ahead_ids)
        spans = [(b.seq, b.seq.num_computed, b.seq.num_computed + b.num_new) for b in batch]
        known = spans[len(ahead_ids) :] if ahead_ids is not None else spans
        embeds = step_embeddings(self.model, known)
        if ahead_ids is not None:  # (`embed_tokens`, not `embed`: its range check would sync)
            embeds = torch.cat([self.model.embed_tokens(ahead_ids), embeds])
        deepstack = step_deepstack(spans) if self.spec.num_deepstack else None
        if mode == MIXED_GRAPH and self.graphs is not None:
            return self.graphs.mixed(step_inputs(batch, logits_for, block_size), embeds, deepstack)
        layout = BatchLayout.build(
            [b.num_new for b in batch],
            [b.seq.num_computed + b.num_new for b in batch],
            [b.seq.table.blocks for b in batch],
            block_size,
            self.model.device,
        )
        step_positions = torch.cat([positions(seq, start, end) for seq, start, end in spans], dim=1)
        return paged_forward(
            self.model,
            embeds,
            step_positions.to(self.model.device),
            layout,
            self.kv,
            logits_for,
            self.config.attention,
            self.fused,
            deepstack=deepstack,
        )
