"""The decoder engine: sequences, one ``step()`` that prefills new ones and decodes running ones.

Correctness first: each sequence has its own contiguous KV cache and runs its own forward.
The paged, batched engine replaces the inside of ``step()`` without changing its contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.protocol import PreparedRequest, TokenDelta
from workers.decoder.sampling import make_generator, sample, suppress
from workers.models.language import KVCache, LanguageModel, merge_media_embeddings
from workers.models.mrope import decode_positions, expand_media_placeholders, rope_positions
from workers.models.spec import ModelSpec


class PromptError(ValueError):
    """A request the engine cannot run; the message says why (answered as HTTP 400)."""


@dataclass
class Sequence:
    request: PreparedRequest
    input_ids: list[int]
    media_embeds: torch.Tensor | None = None
    output_ids: list[int] = field(default_factory=list)
    cache: KVCache | None = None
    delta: int = 0
    generator: torch.Generator | None = None
    finish_reason: str | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id


class Engine:
    def __init__(
        self, model: LanguageModel, spec: ModelSpec, max_model_len: int, max_running: int, prefill_budget: int
    ) -> None:
        self.model = model
        self.spec = spec
        self.max_model_len = max_model_len
        self.max_running = max_running
        self.prefill_budget = prefill_budget  # prompt tokens prefilled per step, so decodes keep moving
        self.queued: dict[str, Sequence] = {}  # insertion order = arrival order
        self.running: dict[str, Sequence] = {}
        self.counters = {"prompt_tokens": 0.0, "generated_tokens": 0.0, "requests_finished": 0.0}

    def prepare(self, request: PreparedRequest) -> Sequence:
        """Expand media placeholders and check limits; raises ``PromptError``."""
        media = [(m.kind, m.grid_thw) for m in request.media]
        try:
            ids = expand_media_placeholders(request.prompt_ids, media, self.spec)
        except ValueError as exc:
            raise PromptError(str(exc)) from exc
        if not ids:
            raise PromptError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PromptError(
                f"the prompt is {len(ids)} tokens but the model's context is {self.max_model_len}; shorten it"
            )
        if max(ids) >= self.spec.vocab_size or min(ids) < 0:
            raise PromptError(f"prompt token ids must lie in [0, {self.spec.vocab_size})")
        return Sequence(request, ids)

    def add(self, seq: Sequence) -> None:
        self.queued[seq.request_id] = seq

    def abort(self, request_id: str) -> bool:
        found = self.running.pop(request_id, None) or self.queued.pop(request_id, None)
        return found is not None

    def has_work(self) -> bool:
        return bool(self.running or self.queued)

    def schedule(self) -> list[Sequence]:
        """Running sequences decode; queued ones start while slots and the prefill budget last
        (the oldest always gets its turn, however long its prompt)."""
        batch = [s for s in self.running.values() if s.cache is not None]
        budget = self.prefill_budget
        for seq in list(self.queued.values()):
            if len(self.running) >= self.max_running or (budget < len(seq.input_ids) and budget < self.prefill_budget):
                break
            budget -= len(seq.input_ids)
            self.running[seq.request_id] = self.queued.pop(seq.request_id)
            batch.append(seq)
        return batch

    def step(self) -> list[TokenDelta]:
        deltas = []
        for seq in self.schedule():
            logits = self._decode(seq) if seq.cache is not None else self._prefill(seq)
            deltas.append(self._append(seq, logits))
            if seq.finish_reason is not None:
                del self.running[seq.request_id]
                self.counters["requests_finished"] += 1
        return deltas

    # ------------------------------------------------------------------ model calls
    def _prefill(self, seq: Sequence) -> torch.Tensor:
        grids = [m.grid_thw for m in seq.request.media if m.kind == "image"]
        videos = [m.grid_thw for m in seq.request.media if m.kind == "video"]
        positions, seq.delta = rope_positions(seq.input_ids, grids, videos, self.spec)
        embeds = self.model.embed(seq.input_ids)
        if seq.media_embeds is not None:
            placeholders = (self.spec.image_token_id, self.spec.video_token_id)
            embeds = merge_media_embeddings(embeds, seq.input_ids, seq.media_embeds, placeholders)
            seq.media_embeds = None  # the KV cache holds what we needed
        seq.cache = self.model.new_cache(len(seq.input_ids) + min(seq.request.sampling.max_tokens, 1024))
        seq.generator = make_generator(seq.request.sampling, self.model.device)
        self.counters["prompt_tokens"] += len(seq.input_ids)
        return self.model(embeds, positions, seq.cache)

    def _decode(self, seq: Sequence) -> torch.Tensor:
        index = len(seq.input_ids) + len(seq.output_ids) - 1
        positions = decode_positions(index, 1, seq.delta, self.model.device)
        assert seq.cache is not None
        return self.model(self.model.embed([seq.output_ids[-1]]), positions, seq.cache)

    # ------------------------------------------------------------------ sampling and stopping
    def _append(self, seq: Sequence, logits: torch.Tensor) -> TokenDelta:
        params = seq.request.sampling
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.spec.eos_token_ids)
        if len(seq.output_ids) < params.min_tokens:
            logits = suppress(logits, sorted(stops))
        token = sample(logits, params, seq.generator)
        seq.output_ids.append(token)
        self.counters["generated_tokens"] += 1
        if token in stops:  # (suppressed above while below min_tokens)
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= params.max_tokens or len(seq.input_ids) + len(seq.output_ids) >= self.max_model_len:
            seq.finish_reason = "length"
        return TokenDelta(
            seq.request_id,
            [token],
            seq.finish_reason,
            prompt_tokens=len(seq.input_ids),
            completion_tokens=len(seq.output_ids),
        )
