"""One choice of a chat completion as it streams in: text deltas, stop strings, logprobs."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from common.protocol import TokenDelta
from gateway.detokenize import IncrementalDetokenizer
from gateway.reasoning import ReasoningSplitter


@dataclass
class ChoiceUpdate:
    text: str
    logprobs: list[dict[str, Any]]
    finish_reason: str | None
    token_ids: list[int]

    def then(self, later: ChoiceUpdate) -> ChoiceUpdate:
        """This update followed by ``later``, as one."""
        return ChoiceUpdate(
            self.text + later.text,
            self.logprobs + later.logprobs,
            later.finish_reason or self.finish_reason,
            self.token_ids + later.token_ids,
        )


@dataclass
class ChoiceStream:
    index: int
    request_id: str
    tokenizer: PreTrainedTokenizerBase
    stop: list[str]
    prompt_index: int = 0  # which prompt of a batch (/v1/completions) it answers
    include_stop: bool = False  # the stop string found ends the text, included (vLLM's include_stop_str_in_output)
    skip_special_tokens: bool = True
    reasoning: ReasoningSplitter | None = None  # a chat choice of a checkpoint that thinks (`gateway.reasoning`)
    detok: IncrementalDetokenizer = field(init=False)
    special_ids: frozenset[int] = field(init=False)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # emitted so far
    held: str = ""  # decoded but held back: it may be the start of a stop string
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        self.detok = IncrementalDetokenizer(self.tokenizer, self.skip_special_tokens)
        self.special_ids = _special_ids(self.tokenizer)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def restart(self) -> None:
        """Back to before its first token: the request is being generated again from its start (its decoder
        was lost while the client, not streaming, had seen nothing), so what came so far is dropped."""
        reasoning = self.reasoning
        if reasoning is not None:  # (a fresh splitter, as the prompt left it)
            reasoning = ReasoningSplitter(reasoning.tokens, reasoning.started_thinking)
        fresh = ChoiceStream(
            self.index,
            self.request_id,
            self.tokenizer,
            self.stop,
            self.prompt_index,
            self.include_stop,
            self.skip_special_tokens,
            reasoning,
        )
        self.__dict__.update(fresh.__dict__)

    def feed(self, delta: TokenDelta) -> ChoiceUpdate:
        final = delta.finish_reason is not None
        self.token_ids.extend(delta.token_ids)
        self.prompt_tokens, self.completion_tokens = delta.prompt_tokens, delta.completion_tokens
        pending = self.held + self.detok.push(delta.token_ids, final=final)
        entries = self._logprob_entries(delta)
        self.logprobs.extend(entries)
        cut = self._stop_at(pending)
        if cut is not None:  # a stop string: the text ends at it, whatever the decoder does next
            self.held = ""
            self.finish_reason = "stop"
            return self._emit(pending[:cut], entries, delta.token_ids)
        if final:
            self.held = ""
            self.finish_reason = delta.finish_reason
            return self._emit(pending, entries, delta.token_ids)
        keep = min(len(pending), max((len(s) for s in self.stop), default=1) - 1)
        self.held = pending[len(pending) - keep :] if keep else ""
        return self._emit(pending[: len(pending) - keep], entries, delta.token_ids)

    def _stop_at(self, pending: str) -> int | None:
        """Where the text ends for the first stop string in ``pending``: before it, or after it when included."""
        found = [(i, len(s)) for i, s in ((pending.find(s), s) for s in self.stop) if i >= 0]
        if not found:
            return None
        at, length = min(found)
        return at + length if self.include_stop else at

    def _emit(self, text: str, entries: list[dict[str, Any]], token_ids: list[int]) -> ChoiceUpdate:
        self.text += text
        return ChoiceUpdate(text, entries, self.finish_reason, token_ids)

    def _logprob_entries(self, delta: TokenDelta) -> list[dict[str, Any]]:
        """OpenAI's ``logprobs.content`` items for the delta's tokens (empty when not asked)."""
        if delta.logprobs is None:
            return []
        tops = delta.top_logprobs or [[] for _ in delta.token_ids]
        return [
            {**self._token(token, logprob), "top_logprobs": [self._token(int(t), lp) for t, lp in top]}
            for token, logprob, top in zip(delta.token_ids, delta.logprobs, tops, strict=True)
        ]

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.tokenizer.decode([token_id])
        spelled = None if token_id in self.special_ids else self.tokenizer.convert_ids_to_tokens(token_id)
        return {"token": text, "logprob": logprob, "bytes": token_bytes(spelled, text)}


@functools.cache
def _special_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The tokenizer's special token ids, worked out once per tokenizer (transformers builds the list on every
    call). Cached by the tokenizer itself, not its id(): an id can be reused once a tokenizer is freed."""
    return frozenset(tokenizer.all_special_ids)


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table, which Qwen2's tokenizer uses) -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def token_bytes(spelled: str | None, text: str) -> list[int]:
    """The token's own bytes, as OpenAI gives them: a token holding part of a UTF-8 character decodes to U+FFFD
    alone, but its bytes are the character's, so a client can join them. Byte-level BPE vocabularies spell
    each byte with one printable character (``spelled``: the vocabulary's spelling, None for a special token);
    other tokens (special ones, other tokenizers' vocabularies) give their text's."""
    table = _byte_of_char()
    if not isinstance(spelled, str) or not all(c in table for c in spelled):
        return list(text.encode("utf-8"))
    return [table[c] for c in spelled]
