"""The decoder engine: continuous batching over a paged KV cache with a multimodal prefix cache.

One ``step()`` is ``schedule()`` (which sequences run and how many tokens each: decodes first,
then prefill chunks under a token budget; blocks checked and taken in pairs), ``run()`` (one
batched forward over all of them), and ``postprocess()`` (sample, stop, free). A sequence that
cannot get a block for its next token preempts the newest running sequence, which later
recomputes (its committed blocks usually come back from the prefix cache).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from common.protocol import PreparedRequest, SamplingParams, TokenDelta
from workers.decoder.batch import (
    Scheduled,
    Sequence,
    decode_inputs,
    positions,
    step_embeddings,
    step_inputs,
    tp_payload,
)
from workers.decoder.blocks import BlockManager, BlockTable, media_token_keys
from workers.decoder.graphs import engine_graphs
from workers.decoder.sampling import Sampled, SampleFuture, SamplingRow, sample_async, sample_batch
from workers.decoder.tp import DECODE_GRAPH, EAGER, MIXED_GRAPH, RankForward, StepBroadcast, StepPayload
from workers.kernels import paged_attention
from workers.models.language import LanguageModel
from workers.models.mrope import expand_media_placeholders, rope_positions
from workers.models.paged import BatchLayout, PagedAttention, PagedKVCache, fuse_layers, paged_forward
from workers.models.runtime import upload
from workers.models.spec import ModelSpec


class PromptError(ValueError):
    """A request the engine cannot run; the message says why (answered as HTTP 400 with ``code``)."""

    def __init__(self, message: str, code: str = "invalid_prompt") -> None:
        super().__init__(message)
        self.code = code


def sampling_row(
    params: SamplingParams, prompt_ids: list[int], output_ids: list[int], banned: list[int] | None = None
) -> SamplingRow:
    """One sequence's options and history for this step; raises ValueError on bad options."""
    return SamplingRow(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        seed=params.seed,
        step=len(output_ids),
        banned=tuple(banned or ()),
        logit_bias=tuple(zip(params.logit_bias_ids, params.logit_bias_values, strict=True)),
        top_logprobs=params.top_logprobs,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
    )


@dataclass
class Pending:
    """A decode step whose forward and sampling are launched but whose tokens the host has not read: its
    sequences are already advanced (their KV is computed), their new tokens not yet appended."""

    batch: list[Scheduled]
    sampled: SampleFuture


class Engine:
    def __init__(
        self,
        model: LanguageModel,
        spec: ModelSpec,
        *,
        max_model_len: int,
        max_running: int,
        prefill_budget: int,
        num_blocks: int,
        decoding_budget: int = 0,
        block_size: int,
        prefix_cache: bool = True,
        attention: PagedAttention = paged_attention,
        fuse: bool = False,
        graphs: str = "off",
        graph_tokens: int = 0,
        overlap: bool = False,
        overlap_mixed: bool = False,
        tp_steps: StepBroadcast | None = None,
    ) -> None:
        """``fuse``: concatenated projections and the fused norm/activation/rotary/cache kernels (Triton on
        CUDA). ``graphs``: "cuda" replays steps from CUDA graphs (decode steps up to ``max_running``
        sequences, mixed prefill/decode steps up to ``graph_tokens`` tokens); "static" runs the same
        static-buffer path eagerly (how it is tested without a GPU); "off" runs every step eagerly.
        ``overlap`` (with graphs): while the GPU runs decode step N, the host stages step N+1 and reads
        step N-1's tokens (see `step`). ``overlap_mixed`` (one rank, graphs or not): every step so, those
        that carry prefill chunks or admit arrivals too (see `_schedule_ahead`)."""
        if graphs not in ("off", "static", "cuda"):
            raise ValueError(f"graphs must be 'off', 'static' or 'cuda', got {graphs!r}")
        if graph_tokens < 0:
            raise ValueError(f"graph_tokens must be >= 0, got {graph_tokens}")
        self.tp_steps = tp_steps  # rank 0 of a tensor-parallel group: each step is broadcast, then run
        self.model = model
        self.attention = attention  # paged_attention: Triton on CUDA tensors, the torch reference elsewhere
        self.spec = spec
        self.max_model_len = max_model_len
        self.max_running = max_running
        self.prefill_budget = prefill_budget  # tokens computed per step, so running decodes keep moving
        self.decoding_budget = decoding_budget or prefill_budget  # the same while a sequence decodes
        self.blocks = BlockManager(num_blocks, block_size, prefix_cache)
        self.fused = fuse_layers(model) if fuse else None
        # The graphs' padding tokens need a block that no sequence owns: one more than the manager hands out.
        self.kv = PagedKVCache.for_model(model, num_blocks + (graphs != "off"), block_size)
        self.graphs = None
        if graphs != "off":
            self.graphs = engine_graphs(
                model,
                self.kv,
                max_running=max_running,
                prefill_budget=prefill_budget,
                graph_tokens=graph_tokens,
                max_model_len=max_model_len,
                num_blocks=num_blocks,
                attention=attention,
                fused=self.fused,
                capture=graphs == "cuda",
                tp=tp_steps.tp if tp_steps is not None else None,
            )
        self.overlap = overlap and self.graphs is not None
        self.overlap_mixed = overlap_mixed and tp_steps is None
        self.rank_forward = None
        if tp_steps is not None:
            self.rank_forward = RankForward(model, self.kv, attention, tp_steps.tp, self.fused, self.graphs)
        self.pending: Pending | None = None
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}  # insertion order = admission order
        self.counters = {
            "prompt_tokens": 0.0,
            "generated_tokens": 0.0,
            "requests_finished": 0.0,
            "preemptions": 0.0,
            "steps": 0.0,
            "graph_steps": 0.0,  # of which steps replayed a graph (decode or mixed)
            "overlapped_steps": 0.0,  # of which steps were staged while the previous one ran
            "overlapped_mixed_steps": 0.0,  # of which steps with prefill chunks or arrivals (overlap_mixed)
            "decode_graph_steps": 0.0,  # of which steps replayed a decode graph
            "decode_launch_s": 0.0,  # host time building and launching those steps' forwards
            "other_launch_s": 0.0,  # and every other step's (prefill chunks, mixed or eager)
        }

    # ------------------------------------------------------------------ admission
    def prepare(self, request: PreparedRequest) -> Sequence:
        """Expand media placeholders, check limits, compute positions; raises ``PromptError``."""
        media = [(m.kind, m.grid_thw) for m in request.media]
        try:
            ids = expand_media_placeholders(request.prompt_ids, media, self.spec)
        except ValueError as exc:
            raise PromptError(str(exc)) from exc
        if not ids:
            raise PromptError("the prompt is empty")
        if len(ids) >= self.max_model_len:  # (OpenAI's words and code, which clients match to trim and retry)
            raise PromptError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your messages "
                f"resulted in {len(ids)} tokens (images and videos included). Please reduce the length of the "
                "messages.",
                code="context_length_exceeded",
            )
        if max(ids) >= self.spec.vocab_size or min(ids) < 0:
            raise PromptError(f"prompt token ids must lie in [0, {self.spec.vocab_size})")
        bias_ids = request.sampling.logit_bias_ids
        if bias_ids and (max(bias_ids) >= self.spec.vocab_size or min(bias_ids) < 0):
            raise PromptError(f"logit_bias token ids must lie in [0, {self.spec.vocab_size})")
        try:  # bad sampling options are refused here, not in the middle of a batched step
            sampling_row(request.sampling, ids, [])
        except ValueError as exc:
            raise PromptError(str(exc)) from exc
        needed = -(-min(len(ids) + request.sampling.max_tokens, self.max_model_len) // self.blocks.block_size)
        if needed > self.blocks.num_blocks:
            raise PromptError(f"the request needs {needed} KV blocks but the cache has {self.blocks.num_blocks}")
        images = [m.grid_thw for m in request.media if m.kind == "image"]
        videos = [m.grid_thw for m in request.media if m.kind == "video"]
        rope, delta = rope_positions(ids, images, videos, self.spec)
        placeholders = torch.tensor([self.spec.image_token_id, self.spec.video_token_id])
        mask = torch.isin(torch.tensor(ids), placeholders)
        return Sequence(request, ids, self._keys(ids, request), rope, delta, mask)

    def _keys(self, ids: list[int], request: PreparedRequest) -> list[int]:
        """Token ids, except that each media token is keyed by its media's content hash: the same
        tokens with another image never share KV; the same image at the same place does."""
        keys, items = list(ids), iter(request.media)
        i = 0
        while i < len(keys):
            if keys[i] in (self.spec.image_token_id, self.spec.video_token_id):
                item = next(items)
                keys[i : i + item.num_tokens] = media_token_keys(item.content_hash, item.num_tokens)
                i += item.num_tokens
            else:
                i += 1
        return keys

    def add(self, seq: Sequence) -> None:
        seq.queued_at = time.monotonic()
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        seq = self.running.pop(request_id, None)
        if seq is not None:
            self.blocks.free(seq.table)
            return True
        found = [s for s in self.waiting if s.request_id == request_id]
        for s in found:
            self.waiting.remove(s)
        return bool(found)

    def holds(self, request_id: str) -> bool:
        return request_id in self.running or any(s.request_id == request_id for s in self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.pending)

    def step(self) -> list[TokenDelta]:
        """One step; returns the tokens it made known.

        With ``overlap``, a decode step that ran from a graph leaves its sampled ids on the device
        (`Pending`). If the next step is the same sequences decoding again, it is staged and launched
        with those ids as input before the host waits for them; the host then reads them, emits them
        (stop checks, finishes) and launches the new step's sampling, all while the GPU computes. A
        sequence that finished on the pending token just has its row of the new step dropped. Anything
        else (arrivals to admit, a prefill, a sequence at its length limit, blocks short) first reads
        the pending tokens, then schedules as usual."""
        if self.pending is not None and self._continues(self.pending):
            return self._step_ahead(self.pending)
        if self.pending is not None and self.overlap_mixed:
            ahead, carried_rows = self._schedule_ahead(self.pending)
            if ahead:
                return self._run_ahead(ahead, carried_rows, self.pending)
        deltas = self._flush()
        batch = self.schedule()
        if not batch:
            return deltas
        logits, decode_graph = self.run(batch)
        if (self.overlap and decode_graph) or self.overlap_mixed:
            self.pending = self._launch_sampling(batch, logits)
            return deltas
        return deltas + self.postprocess(batch, logits)

    # ------------------------------------------------------------------ schedule
    def schedule(self, reserved: int = 0, preempt: bool = True) -> list[Scheduled]:
        """This step's work beside ``reserved`` tokens already taken (decodes run ahead); without ``preempt``
        a sequence short of blocks waits instead of taking another's."""
        batch: list[Scheduled] = []
        budget = self.prefill_budget
        if self.decoding_budget != budget and (
            reserved or any(s.num_tokens - s.num_computed == 1 for s in self.running.values())
        ):
            budget = self.decoding_budget  # (the scan only when the option is on: this runs every step)
        budget -= reserved
        for seq in list(self.running.values()):  # decodes and unfinished prefills, oldest first
            if seq.request_id not in self.running:
                continue  # preempted by an older sequence in this loop
            remaining = seq.num_tokens - seq.num_computed  # (0 for those with a token pending)
            num_new = 1 if remaining == 1 else min(remaining, budget)
            if num_new <= 0 or not self._make_room(seq, num_new, preempt):
                continue
            batch.append(Scheduled(seq, num_new))
            budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if self._twin_prefilling(seq):
                break  # one step later its whole prompt comes from the prefix cache (n > 1 choices)
            if not self.blocks.can_allocate(seq.keys(), seq.table):
                break  # first come, first served: later arrivals wait behind it
            self.waiting.popleft()
            if seq.queue_s is None:  # (a preempted sequence keeps its first wait)
                seq.queue_s = time.monotonic() - seq.queued_at
            seq.num_computed = self.blocks.allocate(seq.keys(), seq.table)
            self.counters["prompt_tokens"] += seq.num_tokens - seq.num_computed
            self.running[seq.request_id] = seq
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            batch.append(Scheduled(seq, num_new))
            budget -= num_new
        return batch

    def _twin_prefilling(self, seq: Sequence) -> bool:
        """A running sequence is still computing this very prompt (another choice of one request)."""
        return self.blocks.enable_prefix_cache and any(
            other.num_computed < len(other.prompt_ids) and other.prompt_keys == seq.prompt_keys
            for other in self.running.values()
        )

    def _make_room(self, seq: Sequence, num_new: int, preempt: bool = True) -> bool:
        """Blocks for ``num_new`` more tokens of ``seq``, preempting the newest others if needed (and allowed)."""
        grow = seq.num_computed + num_new - seq.table.num_tokens
        while grow > 0 and not self.blocks.can_append(seq.table, grow):
            if not preempt:
                return False
            victim = next(reversed(self.running.values()))
            self._preempt(victim)
            if victim is seq:
                return False
        if grow > 0:
            self.blocks.append(seq.table, grow)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Give a sequence's blocks back; it recomputes later, keeping the tokens it has."""
        del self.running[seq.request_id]
        self.blocks.free(seq.table)
        seq.table = BlockTable()
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.counters["preemptions"] += 1

    # ------------------------------------------------------------------ run
    def run(self, batch: list[Scheduled], ahead_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
        """Logits of the sampling sequences, and whether the step ran as a decode graph. ``ahead_ids``: the
        input ids (on the device) of the batch's first rows, those marked `ahead`.

        Counts the host's time building and launching the forward by kind of step: on a GPU the forward
        itself runs on after this returns, so a step kind whose launch time nears its GPU time leaves the
        GPU waiting for the host."""
        started = time.perf_counter()
        logits, decode_graph = self._run(batch, ahead_ids)
        self.counters["decode_graph_steps"] += decode_graph
        self.counters["decode_launch_s" if decode_graph else "other_launch_s"] += time.perf_counter() - started
        return logits, decode_graph

    def _run(self, batch: list[Scheduled], ahead_ids: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
        self.counters["steps"] += 1
        # A decode graph takes the ids from the host or all from the device, not some from each.
        mode = self._mode(batch, decode_graph=ahead_ids is None or len(ahead_ids) == len(batch))
        self.counters["graph_steps"] += mode != EAGER
        ends = np.cumsum([b.num_new for b in batch]) - 1
        logits_for = [int(ends[i]) for i, b in enumerate(batch) if b.samples]
        if self.rank_forward is not None:  # (steps ahead reach here only as whole decode graphs)
            rows = [] if mode == DECODE_GRAPH else logits_for  # a decode graph gives every row
            return self._run_ranks(self._payload(batch, rows, mode, ahead_ids)), mode == DECODE_GRAPH
        if mode == DECODE_GRAPH:
            return self._run_decode_graph(batch, ahead_ids), True
        spans = [(b.seq, b.seq.num_computed, b.seq.num_computed + b.num_new) for b in batch]
        known = spans[len(ahead_ids) :] if ahead_ids is not None else spans
        embeds = step_embeddings(self.model, known)
        if ahead_ids is not None:  # (`embed_tokens`, not `embed`: its range check would sync)
            embeds = torch.cat([self.model.embed_tokens(ahead_ids), embeds])
        if mode == MIXED_GRAPH:
            assert self.graphs is not None  # _mode checked
            return self.graphs.mixed(step_inputs(batch, logits_for, self.blocks.block_size), embeds), False
        step_positions = [positions(seq, start, end) for seq, start, end in spans]
        layout = BatchLayout.build(
            [b.num_new for b in batch],
            [b.seq.num_computed + b.num_new for b in batch],
            [b.seq.table.blocks for b in batch],
            self.blocks.block_size,
            self.model.device,
        )
        logits = paged_forward(
            self.model,
            embeds,
            torch.cat(step_positions, dim=1).to(self.model.device),
            layout,
            self.kv,
            logits_for,
            self.attention,
            self.fused,
        )
        return logits, False

    def _mode(self, batch: list[Scheduled], decode_graph: bool = True) -> int:
        """How the step runs: a decode graph, a mixed graph (any step of up to ``graph_tokens``), or eagerly."""
        if decode_graph and self._decode_graphable(batch):
            return DECODE_GRAPH
        tokens = sum(b.num_new for b in batch)
        context = max(b.seq.num_computed + b.num_new for b in batch)
        if self.graphs is not None and self.graphs.fits_mixed(tokens, len(batch), context):
            return MIXED_GRAPH
        return EAGER

    def _run_ranks(self, payload: StepPayload) -> torch.Tensor:
        """Rank 0 of a tensor-parallel group: the other ranks get the step, then this rank runs its share."""
        assert self.rank_forward is not None and self.tp_steps is not None
        self.tp_steps.send(payload)
        return self.rank_forward(payload)

    def _decode_graphable(self, batch: list[Scheduled]) -> bool:
        """A decode step the graphs take: one sampled token per sequence, none of them a media placeholder
        (those have no token embedding), within the graphs' batch and context."""
        if self.graphs is None or not all(item.num_new == 1 and item.samples for item in batch):
            return False
        if not self.graphs.fits_decode(len(batch), max(item.seq.num_tokens for item in batch)):
            return False
        return not any(
            item.seq.num_computed < len(item.seq.prompt_ids) and bool(item.seq.media_mask[item.seq.num_computed])
            for item in batch
        )

    def _run_decode_graph(self, batch: list[Scheduled], device_token_ids: torch.Tensor | None = None) -> torch.Tensor:
        assert self.graphs is not None  # _decode_graphable or _continues checked
        inputs, ids = decode_inputs(batch, self.blocks.block_size)
        return self.graphs.decode(inputs, ids, device_token_ids)

    def _payload(
        self, batch: list[Scheduled], rows: list[int], mode: int, device_ids: torch.Tensor | None = None
    ) -> StepPayload:
        size, hidden = self.blocks.block_size, self.spec.hidden_size
        return tp_payload(batch, rows, mode, size, self.model.dtype, hidden, device_ids)

    def _continues(self, pending: Pending) -> bool:
        """Whether the next step is exactly the pending sequences decoding once more, with room for it."""
        if self.waiting and len(self.running) < self.max_running:
            return False  # arrivals to admit: schedule normally
        seqs = [item.seq for item in pending.batch]
        if len(seqs) != len(self.running) or any(self.running.get(s.request_id) is not s for s in seqs):
            return False  # aborted, or others running (e.g. a prefill in progress)
        if any(self._ends_on_pending(seq) for seq in seqs):
            return False  # nothing to run after that token
        if self.graphs is None or not self.graphs.fits_decode(len(seqs), max(s.num_computed + 1 for s in seqs)):
            return False
        return self.blocks.can_append_all(self._one_more_token(seqs))

    def _step_ahead(self, pending: Pending) -> list[TokenDelta]:
        """The pending sequences' next decode step, every one carried (`_continues` checked that all fit)."""
        batch = [Scheduled(item.seq, 1, ahead=True) for item in pending.batch]
        self._grow(self._one_more_token([item.seq for item in batch]))
        return self._run_ahead(batch, list(range(len(batch))), pending)

    @staticmethod
    def _one_more_token(seqs: list[Sequence]) -> list[tuple[BlockTable, int]]:
        """What each table must grow by (in tokens) for its sequence's next decode."""
        return [(seq.table, seq.num_computed + 1 - seq.table.num_tokens) for seq in seqs]

    def _grow(self, growth: list[tuple[BlockTable, int]]) -> None:
        """`BlockManager.append` for each (table, tokens) pair that needs more (checked by `can_append_all`)."""
        for table, more in growth:
            if more > 0:
                self.blocks.append(table, more)

    def _launch_sampling(self, batch: list[Scheduled], logits: torch.Tensor) -> Pending | None:
        """Sample on the device and advance the sequences; the tokens are read by `_flush`. ``logits`` has a
        row for each item that samples (every item of a decode graph), in order."""
        sampling = [item for item in batch if item.samples]
        for item in batch:
            item.seq.num_computed += item.num_new
            self.blocks.commit(item.seq.keys(), item.seq.table, item.seq.num_computed)
        if not sampling:
            return None
        return Pending(sampling, sample_async(logits, [self._sampling_row(item.seq) for item in sampling]))

    def _ends_on_pending(self, seq: Sequence) -> bool:
        """It finishes on its pending token by length (the (len(output_ids) + 1)-th), whatever it is."""
        return len(seq.output_ids) + 1 >= seq.request.sampling.max_tokens or seq.num_tokens + 1 >= self.max_model_len

    def _schedule_ahead(self, pending: Pending) -> tuple[list[Scheduled], list[int]]:
        """The next step, staged before ``pending``'s tokens are read: its sequences decode once more with those
        tokens as input (first, marked `ahead`), and `schedule` adds prefill chunks and arrivals beside them.
        Also which of ``pending``'s rows those decodes are. Empty where it must wait for the tokens: blocks
        short for those decodes, or nothing to run. `schedule` here never preempts: a victim among those
        decodes would have its blocks freed while this step's row still writes them (and another row could
        be given them in the same step)."""
        carried = [
            (row, item.seq)
            for row, item in enumerate(pending.batch)
            if self.running.get(item.seq.request_id) is item.seq and not self._ends_on_pending(item.seq)
        ]
        growth = self._one_more_token([seq for _, seq in carried])
        if not self.blocks.can_append_all(growth):
            return [], []
        self._grow(growth)
        batch = [Scheduled(seq, 1, ahead=True) for _, seq in carried]
        return batch + self.schedule(reserved=len(batch), preempt=False), [row for row, _ in carried]

    def _run_ahead(self, batch: list[Scheduled], carried_rows: list[int], pending: Pending) -> list[TokenDelta]:
        """Launch ``batch`` (its first rows decode ``pending``'s ``carried_rows``), then read and emit the pending
        tokens while it runs; rows of sequences that finished on them are dropped before this step's sampling
        is launched."""
        self.counters["overlapped_steps"] += 1
        self.counters["overlapped_mixed_steps"] += len(batch) > len(carried_rows)
        ids = pending.sampled.tokens if carried_rows else None
        if ids is not None and len(carried_rows) < len(pending.batch):
            ids = ids.index_select(0, upload(torch.tensor(carried_rows, dtype=torch.int64), ids.device))
        logits, _ = self.run(batch, ids)
        deltas = self._flush()  # the GPU runs the new step meanwhile
        live, rows, row = [], [], 0
        for item in batch:
            kept = self.running.get(item.seq.request_id) is item.seq
            if kept:
                live.append(item)
            if item.samples:
                if kept:
                    rows.append(row)
                row += 1
        if len(rows) < row:  # (not a blocking copy: it would wait for the step just launched)
            logits = logits.index_select(0, upload(torch.tensor(rows, dtype=torch.int64), logits.device))
        self.pending = self._launch_sampling(live, logits)
        return deltas

    def _flush(self) -> list[TokenDelta]:
        """Read the pending step's tokens and emit them (sequences aborted meanwhile are skipped)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return []
        sampled = pending.sampled.result()
        deltas = []
        for row, item in enumerate(pending.batch):
            if self.running.get(item.seq.request_id) is item.seq:
                deltas.append(self._emit(item.seq, sampled, row))
        return deltas

    # ------------------------------------------------------------------ postprocess
    def postprocess(self, batch: list[Scheduled], logits: torch.Tensor) -> list[TokenDelta]:
        rows = [self._sampling_row(item.seq) for item in batch if item.samples]
        sampled = sample_batch(logits, rows) if rows else Sampled([], [], [])
        deltas, row = [], 0
        for item in batch:
            seq = item.seq
            samples = item.samples  # (before num_computed moves)
            seq.num_computed += item.num_new
            self.blocks.commit(seq.keys(), seq.table, seq.num_computed)
            if samples:
                deltas.append(self._emit(seq, sampled, row))
                row += 1
        return deltas

    def _emit(self, seq: Sequence, sampled: Sampled, row: int) -> TokenDelta:
        """Append the sampled token; a sequence that finishes on it leaves and gives its blocks back."""
        delta = self._append(seq, sampled, row)
        if seq.finish_reason is not None:
            del self.running[seq.request_id]
            self.blocks.free(seq.table)
            self.counters["requests_finished"] += 1
        return delta

    def _stops(self, params: SamplingParams) -> set[int]:
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.spec.eos_token_ids)
        return stops

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        params = seq.request.sampling
        banned = sorted(self._stops(params)) if len(seq.output_ids) < params.min_tokens else []
        return sampling_row(params, seq.prompt_ids, seq.output_ids, banned)

    def _append(self, seq: Sequence, sampled: Sampled, row: int) -> TokenDelta:
        params = seq.request.sampling
        token = sampled.token_ids[row]
        seq.add_output(token)
        self.counters["generated_tokens"] += 1
        if token in self._stops(params):  # (banned while below min_tokens)
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        wants_logprobs = params.top_logprobs >= 0
        return TokenDelta(
            seq.request_id,
            [token],
            seq.finish_reason,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids),
            logprobs=[sampled.logprobs[row]] if wants_logprobs else None,  # type: ignore[list-item]
            top_logprobs=[[[t, lp] for t, lp in sampled.top_logprobs[row]]] if wants_logprobs else None,
            queue_s=seq.queue_s if len(seq.output_ids) == 1 else None,
            media_wait_s=seq.media_wait_s if len(seq.output_ids) == 1 else None,
        )

    def stats(self) -> dict[str, float]:
        used = self.blocks.num_blocks - self.blocks.num_free_blocks()
        return {
            **self.counters,
            **self.blocks.counters,
            "kv_blocks_capacity": float(self.blocks.num_blocks),
            "kv_blocks_used": float(used),
            "kv_usage": used / max(1, self.blocks.num_blocks),
        }
