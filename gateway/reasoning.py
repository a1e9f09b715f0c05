"""Reasoning output: a thinking checkpoint's ``<think>...</think>`` text as ``reasoning_content``, the rest ``content``.

The behaviour is vLLM's ``qwen3`` reasoning parser's: text before the first ``</think>`` is reasoning (a ``<think>``
the model writes itself is dropped), text after it is content, neither stripped of whitespace; an answer that never
closes the block (cut by max_tokens) is all reasoning with ``content`` null; a prompt that closed the block itself
(Qwen3's ``enable_thinking=false``: ``<think>\\n\\n</think>\\n\\n``) leaves the whole answer as content.

Which checkpoints think: both tags must be single tokens of the vocabulary (Qwen3's tokenizer has them as added,
non-special tokens, so they survive ``skip_special_tokens``), and the chat template's generation prompt must open
a think block, in one of the two styles Qwen ships: left open (Qwen3-VL "Thinking": the prompt ends in
``<think>\\n``, so the answer starts inside the thinking), or, with ``enable_thinking=false``, closed empty (Qwen3's
hybrid templates, whose model opens the block itself otherwise). The vocabulary alone says nothing (every Qwen3
tokenizer has the tags, Instruct checkpoints' too), nor does the template's text (an Instruct template may mention
``</think>`` to strip it from history), so the rule renders a probe conversation both ways and looks at the tokens.

Per request, the generation prompt (the tokens after the last ``<|im_start|>``, so that a closed block in the
history does not count) decides where the answer starts: after an open ``<think>``, or with no tag (the hybrid
template, thinking on), inside the thinking; after a ``</think>``, in the content.

The split works on the detokenized text pieces that `gateway.choice.ChoiceStream` emits, guided by the token ids:
a tag is looked for in the text only once its token id has been generated (so a tag spelled out of ordinary
tokens, or text merely mentioning it, does not end the thinking), and while it is awaited a text tail that may be
the tag's start is held back, so a tag split across pieces (by the detokenizer's or the stop strings' hold-back) is
still found. Tool calls are parsed afterwards, in ``content`` alone: a ``<tool_call>`` inside the thinking is no call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

THINK_START = "<think>"
THINK_END = "</think>"
TURN_START = "<|im_start|>"
_PROBE = [{"role": "user", "content": "Hello"}]


@dataclass(frozen=True)
class ThinkTokens:
    start: int
    end: int
    turn_start: int | None  # where a message (and so the generation prompt) begins; None: the whole prompt counts


@dataclass
class ReasoningPiece:
    """What a piece of an answer's text holds of the thinking and of the content."""

    reasoning: str = ""
    content: str = ""

    def delta(self) -> dict[str, Any]:
        """OpenAI's streamed ``delta``: the non-empty parts."""
        return {k: v for k, v in (("reasoning_content", self.reasoning), ("content", self.content)) if v}


def _single_token(tokenizer: PreTrainedTokenizerBase, text: str) -> int | None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else None


def think_tokens(tokenizer: PreTrainedTokenizerBase) -> ThinkTokens | None:
    """The think tags' token ids, where both are single tokens of the vocabulary."""
    start, end = _single_token(tokenizer, THINK_START), _single_token(tokenizer, THINK_END)
    if start is None or end is None:
        return None
    return ThinkTokens(start, end, _single_token(tokenizer, TURN_START))


def generation_prompt(prompt_ids: list[int], tokens: ThinkTokens) -> list[int]:
    """The prompt's last message (the generation prompt, or the final message continued)."""
    if tokens.turn_start is None or tokens.turn_start not in prompt_ids:
        return prompt_ids
    last = len(prompt_ids) - 1 - prompt_ids[::-1].index(tokens.turn_start)
    return prompt_ids[last:]


def starts_thinking(prompt_ids: list[int], tokens: ThinkTokens) -> bool:
    """Whether the answer to this prompt starts inside the thinking: unless its generation prompt closed the block."""
    for token in reversed(generation_prompt(prompt_ids, tokens)):
        if token == tokens.start:
            return True
        if token == tokens.end:
            return False
    return True  # no tag: the model opens the block itself (Qwen3's hybrid templates, thinking on)


@dataclass(frozen=True)
class ThinkingTemplate:
    """A checkpoint whose chat template thinks: makes each chat choice's splitter."""

    tokens: ThinkTokens

    def splitter(self, prompt_ids: list[int]) -> ReasoningSplitter:
        return ReasoningSplitter(self.tokens, starts_thinking(prompt_ids, self.tokens))


def thinking_template(tokenizer: PreTrainedTokenizerBase, chat_template: str) -> ThinkingTemplate | None:
    """The checkpoint's reasoning split, or None where its template does not think (see the module's doc)."""
    tokens = think_tokens(tokenizer)
    if tokens is None:
        return None
    for variables in ({}, {"enable_thinking": False}):
        try:
            text = tokenizer.apply_chat_template(
                _PROBE, chat_template=chat_template, tokenize=False, add_generation_prompt=True, **variables
            )
        except (TemplateError, ValueError):  # a template that wants more than one user message: no probe
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if tokens.start in generation_prompt(list(ids), tokens):
            return ThinkingTemplate(tokens)
    return None


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ReasoningSplitter:
    """One choice's answer, split as it streams: ``feed`` each text piece with the token ids it came with."""

    tokens: ThinkTokens
    started_thinking: bool  # the prompt left the answer inside the thinking
    thinking: bool = field(init=False)  # still inside it
    start_id_seen: bool = False
    start_dropped: bool = False  # the model's own <think> was dropped from the text
    end_id_seen: bool = False
    held: str = ""  # text that may be the start of an awaited tag

    def __post_init__(self) -> None:
        self.thinking = self.started_thinking

    def feed(self, text: str, token_ids: list[int], final: bool = False) -> ReasoningPiece:
        if not self.thinking:
            return ReasoningPiece(content=text)
        self.start_id_seen = self.start_id_seen or self.tokens.start in token_ids
        self.end_id_seen = self.end_id_seen or self.tokens.end in token_ids
        pending, self.held = self.held + text, ""
        if self.start_id_seen and not self.start_dropped:
            at = pending.find(THINK_START)
            if at >= 0:  # (vLLM drops what came before it too)
                pending, self.start_dropped = pending[at + len(THINK_START) :], True
        if self.end_id_seen:
            at = pending.find(THINK_END)
            if at >= 0:
                self.thinking = False
                return ReasoningPiece(pending[:at], pending[at + len(THINK_END) :])
        if not final:
            awaited = [THINK_END] if self.end_id_seen else []
            if self.start_id_seen and not self.start_dropped:
                awaited.append(THINK_START)
            keep = max((_partial_tail(pending, tag) for tag in awaited), default=0)
            pending, self.held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        return ReasoningPiece(reasoning=pending)

    def message(self, text: str, token_ids: list[int]) -> dict[str, Any]:
        """A whole answer's ``message`` fields, as vLLM's non-streaming response has them: ``content`` null when
        empty or never reached (the thinking not closed), ``reasoning_content`` null when the prompt closed it."""
        piece = ReasoningSplitter(self.tokens, self.started_thinking).feed(text, token_ids, final=True)
        if not self.started_thinking:
            return {"content": piece.content, "reasoning_content": None}
        return {"content": piece.content or None, "reasoning_content": piece.reasoning}
