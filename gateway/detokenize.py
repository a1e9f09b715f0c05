"""Incremental detokenization: text deltas from a growing list of token ids."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    """Emits only text that can no longer change: a trailing partial UTF-8 character is held back."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.emitted = ""
        # Decode from a recent offset only, so a long answer does not cost O(n^2).
        self.prefix_offset = 0
        self.prefix_text = ""

    def push(self, token_ids: list[int], final: bool = False) -> str:
        self.token_ids.extend(token_ids)
        window = self.token_ids[self.prefix_offset :]
        text = self.prefix_text + self.tokenizer.decode(window, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return ""
        delta = text[len(self.emitted) :]
        self.emitted = text
        if len(window) > 32:  # move the window forward on a settled boundary
            self.prefix_offset = len(self.token_ids)
            self.prefix_text = text
        return delta
