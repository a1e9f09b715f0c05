"""Incremental detokenization against decoding the whole answer at once: the deltas, joined, are exactly
the text; no delta ends inside a character; and a push costs a short window whatever the answer's length."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gateway.detokenize import IncrementalDetokenizer
from workers.models.synth import generate_checkpoint

TEXT = (
    "Plain words, then naïve café déjà vu; 日本語のテキスト and 中文 mixed in; emoji 🙂👍🏽🇫🇷 and a "
    "zero-width joiner 👩‍💻; code `x = {'a': [1, 2]}`\n\ttabs, newlines\n\nand ΑΒΓ αβγ, Привет, مرحبا."
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    path: Path = generate_checkpoint(tmp_path_factory.mktemp("detok") / "tiny", "tiny", seed=0)
    return AutoTokenizer.from_pretrained(str(path))


def stream(tokenizer: PreTrainedTokenizerBase, ids: list[int], rng: random.Random) -> list[str]:
    """Deltas of ``ids`` pushed in random groups of 1-4 tokens, the last push final."""
    detok, deltas, at = IncrementalDetokenizer(tokenizer), [], 0
    while at < len(ids):
        step = rng.randint(1, 4)
        deltas.append(detok.push(ids[at : at + step], final=at + step >= len(ids)))
        at += step
    return deltas


def test_multilingual_text_streams_to_exactly_its_decoding(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer(TEXT * 3)["input_ids"]
    for seed in range(5):
        deltas = stream(tokenizer, ids, random.Random(seed))
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
        assert not any(d.endswith("\ufffd") for d in deltas[:-1])  # no half character was let out


def test_any_token_sequence_streams_to_its_decoding(tokenizer: PreTrainedTokenizerBase) -> None:
    """Arbitrary ids: special tokens (skipped), lone bytes of multi-byte characters, invalid UTF-8."""
    specials = list(tokenizer.all_special_ids)
    rng = random.Random(7)
    for _ in range(40):
        ids = [rng.choice(specials) if rng.random() < 0.05 else rng.randrange(tokenizer.vocab_size) for _ in range(120)]
        assert "".join(stream(tokenizer, ids, rng)) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_push_decodes_a_short_window(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer(TEXT * 20)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    windows = []
    for token in ids:
        detok.push([token])
        windows.append(len(detok.token_ids) - detok.prefix_offset)
    assert len(ids) > 1000 and max(windows) <= 8, max(windows)
