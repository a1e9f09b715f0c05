"""A step's batch and the forward inputs built from it.

`Sequence` is one request's state in the engine; `Scheduled` is a sequence with the tokens it computes
this step. The functions below turn a batch into what a forward takes — embeddings, M-RoPE positions,
KV slots, the staged inputs of a CUDA graph, a tensor-parallel step — with the position and slot rules
written once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.protocol import PreparedRequest
from workers.decoder.blocks import BlockTable
from workers.decoder.graphs import StepInputs
from workers.decoder.sampling import SamplingRow, sampling_row, stop_ids
from workers.decoder.tp import StepPayload
from workers.models.language import LanguageModel
from workers.models.paged import StepDeepStack
from workers.models.runtime import upload

if TYPE_CHECKING:
    from llguidance import LLMatcher


@dataclass
class Sequence:
    request: PreparedRequest
    prompt_ids: list[int]
    prompt_keys: list[int]  # prefix-cache keys: token ids, media tokens keyed by content hash + offset
    positions: torch.Tensor  # [3, prompt_len] M-RoPE positions of the prompt
    delta: int  # position of token i (past the prompt) is i + delta
    media_mask: torch.Tensor  # [prompt_len] bool: rows filled from media_embeds, in order
    media_embeds: torch.Tensor | None = None
    # [K, media rows, hidden]: the DeepStack sets of the same rows (Qwen3-VL), added after decoder layers 0..K-1
    deepstack_embeds: torch.Tensor | None = None
    output_ids: list[int] = field(default_factory=list)
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0  # tokens whose KV is in the table
    finish_reason: str | None = None
    all_keys: list[int] = field(default_factory=list)  # prompt_keys + output_ids, kept up to date
    queued_at: float = 0.0
    queue_s: float | None = None  # arrival in the engine -> first admission
    media_wait_s: float | None = None  # arrival in the decoder -> its embeddings read (media requests)
    # Structured output: the grammar's state after output_ids (workers/decoder/grammar.py); kept through
    # preemption, as output_ids are.
    matcher: LLMatcher | None = None

    def __post_init__(self) -> None:
        self.all_keys = list(self.prompt_keys)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def keys(self) -> list[int]:
        return self.all_keys  # not rebuilt per step: prompts can be thousands of tokens

    def add_output(self, token: int) -> None:
        self.output_ids.append(token)
        self.all_keys.append(token)

    def sampling_row(self, eos_token_ids: Iterable[int]) -> SamplingRow:
        """Its options and history for the token it samples next (stops banned below ``min_tokens``)."""
        params = self.request.sampling
        banned = sorted(stop_ids(params, eos_token_ids)) if len(self.output_ids) < params.min_tokens else []
        return sampling_row(params, self.prompt_ids, self.output_ids, banned)

    def token_ids(self, start: int, end: int) -> list[int]:
        prompt = len(self.prompt_ids)
        head = self.prompt_ids[start:end] if start < prompt else []
        tail = self.output_ids[max(start - prompt, 0) : end - prompt] if end > prompt else []
        return head + tail


@dataclass
class Scheduled:
    seq: Sequence
    num_new: int  # tokens computed this step: a prefill chunk, or 1 for a decode
    # A decode whose input is the previous step's sampled token, still on the device (the host appends it
    # while this step runs): the sequence's host state is one token behind until then.
    ahead: bool = False

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so its logits give the next token."""
        return self.ahead or self.seq.num_computed + self.num_new == self.seq.num_tokens


def positions(seq: Sequence, start: int, end: int) -> torch.Tensor:
    """M-RoPE positions [3, end - start] of tokens [start, end), on the host."""
    prompt_len = len(seq.prompt_ids)
    parts = [seq.positions[:, start : min(end, prompt_len)]]
    if end > prompt_len:  # generated tokens (a decode, or a recompute after preemption)
        tail = torch.arange(max(start, prompt_len), end) + seq.delta
        parts.append(tail.expand(3, -1))
    return torch.cat(parts, dim=1)


def slots(seq: Sequence, start: int, end: int, block_size: int) -> np.ndarray:
    """Where the k/v of tokens [start, end) of ``seq`` go."""
    at = np.arange(start, end)
    return np.asarray(seq.table.blocks, dtype=np.int64)[at // block_size] * block_size + at % block_size


def media_span(seq: Sequence, start: int, end: int) -> tuple[torch.Tensor, slice] | None:
    """Which of tokens [start, end) are media placeholders (bool [end - start]) and which media rows fill them
    (the rows before ``start`` are those of earlier chunks, or of a cached prefix); None where the span holds no
    placeholder (most spans of a step: decodes, text)."""
    prompt_end = min(end, len(seq.prompt_ids))
    if start >= prompt_end:
        return None
    part = seq.media_mask[start:prompt_end]
    if not part.any():
        return None
    mask = torch.zeros(end - start, dtype=torch.bool)
    mask[: prompt_end - start] = part
    first = int(seq.media_mask[:start].sum())
    return mask, slice(first, first + int(part.sum()))


def media_rows(seq: Sequence, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Which of tokens [start, end) are media placeholders (bool [end - start]) and their embeddings; None
    where the span holds no placeholder (most spans of a step: decodes, text)."""
    if seq.media_embeds is None or (found := media_span(seq, start, end)) is None:
        return None
    return found[0], seq.media_embeds[found[1]]


Span = tuple[Sequence, int, int]  # a sequence and the tokens [start, end) it computes this step


def step_embeddings(model: LanguageModel, spans: list[Span]) -> torch.Tensor:
    """Input embeddings of a step's tokens, span after span: token embeddings, media rows in the
    placeholders. All the ids go up in one copy and through one lookup, and all the media rows into their
    placeholders in one index copy: per span, those were four small device operations and their host
    calls, host time that a step with dozens of decodes spent before its forward could start. The ids were
    range-checked when the request was prepared (`LanguageModel.embed`'s check reads the device)."""
    ids: list[int] = []
    at: list[torch.Tensor] = []
    media: list[torch.Tensor] = []
    for seq, start, end in spans:
        if (found := media_rows(seq, start, end)) is not None:
            at.append(found[0].nonzero().squeeze(1) + len(ids))
            media.append(found[1])
        ids.extend(seq.token_ids(start, end))
    if not ids:  # every row of the step came from the device (`ModelRunner.run`'s ahead ids): nothing to pin
        return model.embed_tokens.weight.new_empty((0, model.embed_tokens.weight.shape[1]))
    embeds = model.embed_tokens(upload(torch.tensor(ids, dtype=torch.int64), model.device))
    if not media:
        return embeds
    index = upload(torch.cat(at), embeds.device)  # (a boolean index on the device would sync)
    rows = torch.cat([upload(part, embeds.device) for part in media]).to(embeds.dtype)
    return embeds.index_copy(0, index, rows)


def step_deepstack(spans: list[Span]) -> StepDeepStack | None:
    """The DeepStack input of a step's tokens, span after span as `step_embeddings` lays them out: the flat
    indices of the visual tokens and their sets' rows. A chunk takes only its own rows of each set, and a span
    past the visual rows (a decode, a prefix-cache hit's rest) none; None where no span has any."""
    at: list[torch.Tensor] = []
    sets: list[torch.Tensor] = []
    offset = 0
    for seq, start, end in spans:
        if seq.deepstack_embeds is not None and (found := media_span(seq, start, end)) is not None:
            at.append(found[0].nonzero().squeeze(1) + offset)
            sets.append(seq.deepstack_embeds[:, found[1]])
        offset += end - start
    if not at:
        return None
    return StepDeepStack(torch.cat(at), torch.cat([part.to(sets[0].device) for part in sets], dim=1))


def step_inputs(batch: list[Scheduled], rows: list[int], block_size: int) -> StepInputs:
    """A step's staged inputs, as a mixed graph takes them (and a tensor-parallel step's payload carries
    them). A one-token span (a decode) takes plain ints, as `decode_inputs` does; only prompt chunks build
    per-span arrays."""
    tokens = sum(item.num_new for item in batch)
    step_positions = np.empty((3, tokens), dtype=np.int64)
    step_slots = np.empty(tokens, dtype=np.int64)
    i = 0
    for item in batch:
        seq, start, end = item.seq, item.seq.num_computed, item.seq.num_computed + item.num_new
        if item.num_new == 1:
            prompt_len = len(seq.prompt_ids)
            step_positions[:, i] = seq.positions[:, start].tolist() if start < prompt_len else start + seq.delta
            step_slots[i] = seq.table.blocks[start // block_size] * block_size + start % block_size
        else:
            step_positions[:, i : i + item.num_new] = positions(seq, start, end).numpy()
            step_slots[i : i + item.num_new] = slots(seq, start, end, block_size)
        i += item.num_new
    return StepInputs(
        positions=step_positions,
        slots=step_slots,
        query_lens=[b.num_new for b in batch],
        context_lens=[b.seq.num_computed + b.num_new for b in batch],
        block_tables=[b.seq.table.blocks for b in batch],
        rows=rows,
    )


def decode_inputs(batch: list[Scheduled], block_size: int) -> tuple[StepInputs, list[int]]:
    """The staged inputs and token ids of a decode-graph step (ids: empty past what the host knows).

    Plain ints, not per-sequence tensors: building those would cost more than the step's GPU time."""
    ids, step_slots, context_lens, tables, step_positions = [], [], [], [], []
    for item in batch:
        seq, at = item.seq, item.seq.num_computed
        ids.extend(seq.token_ids(at, at + 1))
        step_slots.append(seq.table.blocks[at // block_size] * block_size + at % block_size)
        context_lens.append(at + 1)
        tables.append(seq.table.blocks)
        prompt_len = len(seq.prompt_ids)
        step_positions.append(seq.positions[:, at].tolist() if at < prompt_len else [at + seq.delta] * 3)
    inputs = StepInputs(
        positions=np.asarray(step_positions, dtype=np.int64).T,
        slots=np.asarray(step_slots, dtype=np.int64),
        query_lens=[1] * len(batch),
        context_lens=context_lens,
        block_tables=tables,
        rows=[],
    )
    return inputs, ids


def tp_payload(
    batch: list[Scheduled],
    rows: list[int],
    mode: int,
    block_size: int,
    media_dtype: torch.dtype,
    hidden: int,
    device_ids: torch.Tensor | None = None,
) -> StepPayload:
    """A step as every tensor-parallel rank needs it (each embeds the ids of its vocabulary shard).
    ``device_ids``: the input ids of the rows marked `ahead` (the first ones), not on the host yet: zeros
    stand in for them in ``ids``.
    Positions and slots as `step_inputs` builds them; the media mask is set only where a span holds media, and
    the DeepStack sets (Qwen3-VL) of the same media rows go with them."""
    staged = step_inputs(batch, rows, block_size)
    ids: list[int] = []
    mask = torch.zeros(staged.num_tokens, dtype=torch.bool)
    media, sets = [], []
    for item in batch:
        seq, start, end = item.seq, item.seq.num_computed, item.seq.num_computed + item.num_new
        if seq.media_embeds is not None and (found := media_span(seq, start, end)) is not None:
            mask[len(ids) : len(ids) + item.num_new] = found[0]
            media.append(seq.media_embeds[found[1]])
            if seq.deepstack_embeds is not None:
                sets.append(seq.deepstack_embeds[:, found[1]])
        ids.extend([0] * item.num_new if item.ahead else seq.token_ids(start, end))
    return StepPayload(
        mode=mode,
        slots=torch.from_numpy(staged.slots),
        ids=torch.tensor(ids, dtype=torch.int64),
        media_mask=mask,
        media_rows=torch.cat(media) if media else torch.empty((0, hidden), dtype=media_dtype),
        positions=torch.from_numpy(staged.positions),
        query_lens=staged.query_lens,
        context_lens=staged.context_lens,
        block_tables=[list(blocks) for blocks in staged.block_tables],
        rows=rows,
        device_ids=device_ids,
        deepstack=torch.cat([part.to(sets[0].device) for part in sets], dim=1) if sets else None,
    )
