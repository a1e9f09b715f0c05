"""The decoder's scheduler: which sequences run each step and how many tokens each, over a paged KV cache with a
multimodal prefix cache. No model calls: it hands `Scheduled` batches to the model runner and takes the sampled
tokens back (`postprocess`).

Admission: `prepare` turns a request into a `Sequence` (media placeholders expanded, limits checked, M-RoPE
positions), `add` queues it. `schedule` takes decodes first, then prefill chunks under a token budget, then
arrivals whose blocks the `BlockManager` can give (their cached prefix included); every check is paired with
its action (`can_append`/`append`, `can_allocate`/`allocate`). A sequence that cannot get a block for its next
token preempts the newest running sequence, which later recomputes (its committed blocks usually come back from
the prefix cache). `schedule_ahead` is the same beside a step whose tokens the host has not read yet.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from common.protocol import PreparedRequest, TokenDelta
from workers.decoder.batch import Scheduled, Sequence
from workers.decoder.blocks import BlockManager, BlockTable, media_token_keys
from workers.decoder.config import EngineConfig
from workers.decoder.grammar import GrammarError, Grammars, consume
from workers.decoder.sampling import Sampled, sampling_row, stop_ids
from workers.models.mrope import expand_media_placeholders
from workers.models.registry import family
from workers.models.spec import ModelSpec

if TYPE_CHECKING:
    from llguidance import LLMatcher


class PromptError(ValueError):
    """A request the engine cannot run; the message says why (answered as HTTP 400 with ``code``)."""

    def __init__(self, message: str, code: str = "invalid_prompt") -> None:
        super().__init__(message)
        self.code = code


class Scheduler:
    def __init__(
        self, config: EngineConfig, spec: ModelSpec, counters: dict[str, float], grammars: Grammars | None = None
    ) -> None:
        """``grammars``: the structured-output matchers (None: constrained requests are refused)."""
        self.config, self.spec, self.counters, self.grammars = config, spec, counters, grammars
        # Requests ended by an error while decoding (their matcher refused a token): id and why, until taken.
        self.failed: list[tuple[str, str]] = []
        self.rope_positions = family(spec.model_type).rope_positions  # the family's M-RoPE index rule
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.prefix_cache)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}  # insertion order = admission order

    # ------------------------------------------------------------------ admission
    def prepare(self, request: PreparedRequest) -> Sequence:
        """Expand media placeholders, check limits, compute positions; raises ``PromptError``."""
        spec, max_len = self.spec, self.config.max_model_len
        try:
            media = [(m.kind, m.grid_thw) for m in request.media]
            texts = [m.frame_text_ids for m in request.media]
            ids = expand_media_placeholders(request.prompt_ids, media, spec, texts)
        except ValueError as exc:
            raise PromptError(str(exc)) from exc
        if not ids:
            raise PromptError("the prompt is empty")
        if len(ids) >= max_len:  # (OpenAI's words and code, which clients match to trim and retry)
            raise PromptError(
                f"This model's maximum context length is {max_len} tokens. However, your messages "
                f"resulted in {len(ids)} tokens (images and videos included). Please reduce the length of the "
                "messages.",
                code="context_length_exceeded",
            )
        if max(ids) >= spec.vocab_size or min(ids) < 0:
            raise PromptError(f"prompt token ids must lie in [0, {spec.vocab_size})")
        bias_ids = request.sampling.logit_bias_ids
        if bias_ids and (max(bias_ids) >= spec.vocab_size or min(bias_ids) < 0):
            raise PromptError(f"logit_bias token ids must lie in [0, {spec.vocab_size})")
        try:  # bad sampling options are refused here, not in the middle of a batched step
            sampling_row(request.sampling, ids, [])
        except ValueError as exc:
            raise PromptError(str(exc)) from exc
        needed = -(-min(len(ids) + request.sampling.max_tokens, max_len) // self.blocks.block_size)
        if needed > self.blocks.num_blocks:
            raise PromptError(f"the request needs {needed} KV blocks but the cache has {self.blocks.num_blocks}")
        images = [m.grid_thw for m in request.media if m.kind == "image"]
        videos = [m.grid_thw for m in request.media if m.kind == "video"]
        seconds = [m.second_per_grid_t for m in request.media if m.kind == "video"]
        rope, delta = self.rope_positions(ids, images, videos, spec, video_seconds=seconds)
        mask = torch.isin(torch.tensor(ids), torch.tensor([spec.image_token_id, spec.video_token_id]))
        return Sequence(request, ids, self._keys(ids, request), rope, delta, mask, matcher=self._matcher(request))

    def _matcher(self, request: PreparedRequest) -> LLMatcher | None:
        """The sequence's grammar matcher at its start (None: unconstrained); raises ``PromptError``."""
        grammar = request.sampling.grammar
        if not grammar:
            return None
        if self.grammars is None:
            raise PromptError("structured outputs are not available: the checkpoint has no tokenizer.json")
        try:
            return self.grammars.matcher(grammar)
        except GrammarError as exc:
            raise PromptError(str(exc), code="invalid_grammar") from exc

    def _keys(self, ids: list[int], request: PreparedRequest) -> list[int]:
        """Token ids, except that each media token is keyed by its media's content hash: the same
        tokens with another image never share KV; the same image at the same place does. An item's tokens may
        come in several runs (a Qwen3-VL video's temporal steps between their timestamps): they take its keys in
        order."""
        media_keys = iter(
            [key for item in request.media for key in media_token_keys(item.content_hash, item.num_tokens)]
        )
        media_ids = (self.spec.image_token_id, self.spec.video_token_id)
        return [next(media_keys) if tok in media_ids else tok for tok in ids]

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

    def is_running(self, seq: Sequence) -> bool:
        """Still running (not finished, aborted or preempted since it was scheduled)."""
        return self.running.get(seq.request_id) is seq

    # ------------------------------------------------------------------ schedule
    def schedule(self, reserved: int = 0, preempt: bool = True) -> list[Scheduled]:
        """This step's work beside ``reserved`` tokens already taken (decodes run ahead); without ``preempt``
        a sequence short of blocks waits instead of taking another's."""
        batch: list[Scheduled] = []
        budget = self.config.prefill_budget
        if self.config.step_budget != budget and (
            reserved or any(s.num_tokens - s.num_computed == 1 for s in self.running.values())
        ):
            budget = self.config.step_budget  # (the scan only when the option is on: this runs every step)
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
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running:
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

    def schedule_ahead(self, pending: list[Sequence]) -> tuple[list[Scheduled], list[int]]:
        """The next step, scheduled before the ``pending`` sequences' sampled tokens are read: those still running
        decode once more with their token as input (first, marked `ahead`), and `schedule` adds prefill chunks
        and arrivals beside them. Also which rows of ``pending`` those decodes are. Empty where the step must
        wait for the tokens: blocks short for those decodes, or nothing to run. This never preempts: a victim
        among those decodes would have its blocks freed while the running step still writes them (and another
        row could be given them in the same step)."""
        carried = [(row, seq) for row, seq in enumerate(pending) if self.is_running(seq) and not self._ends(seq)]
        growth = [(seq.table, seq.num_computed + 1 - seq.table.num_tokens) for _, seq in carried]
        if not self.blocks.can_append_all(growth):
            return [], []
        for table, more in growth:
            if more > 0:
                self.blocks.append(table, more)
        batch = [Scheduled(seq, 1, ahead=True) for _, seq in carried]
        return batch + self.schedule(reserved=len(batch), preempt=False), [row for row, _ in carried]

    def _ends(self, seq: Sequence) -> bool:
        """It finishes on its pending token by length (the (len(output_ids) + 1)-th), whatever it is."""
        max_tokens = seq.request.sampling.max_tokens
        return len(seq.output_ids) + 1 >= max_tokens or seq.num_tokens + 1 >= self.config.max_model_len

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

    # ------------------------------------------------------------------ after the forward
    def advance(self, batch: list[Scheduled]) -> None:
        """The step's KV is computed (or being computed, in stream order): its full blocks join the prefix cache."""
        for item in batch:
            item.seq.num_computed += item.num_new
            self.blocks.commit(item.seq.keys(), item.seq.table, item.seq.num_computed)

    def _fail(self, seq: Sequence, why: str) -> None:
        del self.running[seq.request_id]
        self.blocks.free(seq.table)
        self.failed.append((seq.request_id, why))

    def take_failed(self) -> list[tuple[str, str]]:
        failed, self.failed = self.failed, []
        return failed

    def postprocess(self, seqs: list[Sequence], sampled: Sampled) -> list[TokenDelta]:
        """Append each sequence's sampled token (row i is ``seqs[i]``'s) and check its stops; a sequence that
        finishes leaves and gives its blocks back. Sequences aborted since they were scheduled are skipped."""
        deltas = []
        for row, seq in enumerate(seqs):
            if not self.is_running(seq):
                continue
            params, token = seq.request.sampling, sampled.token_ids[row]
            seq.add_output(token)
            self.counters["generated_tokens"] += 1
            if seq.matcher is not None and (error := consume(seq.matcher, token)) is not None:
                self._fail(seq, f"the output left its grammar: {error}")
                continue
            # A stop token (banned while below min_tokens), or a matcher that stopped: its grammar is complete,
            # or it took an EOS (under ignore_eos too).
            grammar_done = seq.matcher is not None and seq.matcher.is_stopped()
            if grammar_done or token in stop_ids(params, self.spec.eos_token_ids):
                seq.finish_reason = "stop"
            elif len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                del self.running[seq.request_id]
                self.blocks.free(seq.table)
                self.counters["requests_finished"] += 1
            logprobs = params.top_logprobs >= 0
            first = len(seq.output_ids) == 1
            deltas.append(
                TokenDelta(
                    seq.request_id,
                    [token],
                    seq.finish_reason,
                    prompt_tokens=len(seq.prompt_ids),
                    completion_tokens=len(seq.output_ids),
                    logprobs=[sampled.logprobs[row]] if logprobs else None,  # type: ignore[list-item]
                    top_logprobs=[[[t, lp] for t, lp in sampled.top_logprobs[row]]] if logprobs else None,
                    queue_s=seq.queue_s if first else None,
                    media_wait_s=seq.media_wait_s if first else None,
                )
            )
        return deltas
