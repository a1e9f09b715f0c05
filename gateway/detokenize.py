"""Incremental detokenization: text deltas from a growing list of token ids."""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedTokenizerBase


def fast_decode(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=...)``, straight from the Rust tokenizer where that is the
    same thing (no clean-up pass): transformers' wrapper costs more than the decoding of a few tokens, and
    the gateway decodes on every token of every stream."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Emits only text that can no longer change: a trailing partial UTF-8 character is held back.

    Each push decodes a short window twice: the tokens from ``prefix_offset`` up to what was emitted (the
    context that makes a tokenizer decode the next piece as it would in the whole text: a leading space,
    say) and the same plus the new tokens; the difference is the new text. So a push costs a few tokens'
    decoding however long the answer grows. A tokenizer whose decoding of the longer window does not extend
    the shorter one falls back to decoding everything (the emitted text stays a prefix of the whole)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True) -> None:
        self.decode = fast_decode(tokenizer, skip_special_tokens)
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # the window's first token
        self.read_offset = 0  # tokens before this one are emitted
        self.emitted = 0  # characters emitted

    def push(self, token_ids: list[int], final: bool = False) -> str:
        self.token_ids.extend(token_ids)
        before = self.decode(self.token_ids[self.prefix_offset : self.read_offset])
        after = self.decode(self.token_ids[self.prefix_offset :])
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""  # nothing new yet, or a character still incomplete: wait for the next token
        consistent = after.startswith(before)
        delta = after[len(before) :] if consistent else self.decode(self.token_ids)[self.emitted :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.emitted += len(delta)
        return delta
