"""A choice's text as tokens arrive: stop strings end it exactly, nothing after them leaks."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from common.protocol import TokenDelta
from gateway.choice import ChoiceStream
from workers.models.synth import generate_checkpoint


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    path: Path = generate_checkpoint(tmp_path_factory.mktemp("choice") / "tiny", "tiny", seed=0)
    return AutoTokenizer.from_pretrained(str(path))


def feed_all(choice: ChoiceStream, ids: list[int], final_reason: str = "length") -> list[str]:
    pieces = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        update = choice.feed(TokenDelta("r", [token], final_reason if last else None, 5, i + 1))
        pieces.append(update.text)
        if choice.finished:
            break
    return pieces


def test_text_without_stop_strings_is_the_decoded_text(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]
    choice = ChoiceStream(0, "r", tokenizer, [])
    assert "".join(feed_all(choice, ids)) == tokenizer.decode(ids)
    assert choice.finish_reason == "length"


@pytest.mark.parametrize("stop", ["brown", "ox ju", "dog.", "lazy d"])
def test_stop_string_ends_the_text_before_it(tokenizer: PreTrainedTokenizerBase, stop: str) -> None:
    text = "The quick brown fox jumps over the lazy dog. And more text follows here."
    ids = tokenizer(text)["input_ids"]
    choice = ChoiceStream(0, "r", tokenizer, ["never-there", stop])
    pieces = feed_all(choice, ids)
    assert "".join(pieces) == text[: text.index(stop)]
    assert choice.text == text[: text.index(stop)]
    assert choice.finish_reason == "stop"
    assert len(pieces) < len(ids)  # it ended early


def test_earliest_of_several_stop_strings_wins(tokenizer: PreTrainedTokenizerBase) -> None:
    text = "alpha beta gamma delta"
    choice = ChoiceStream(0, "r", tokenizer, ["delta", "beta"])
    assert "".join(feed_all(choice, tokenizer(text)["input_ids"])) == "alpha "


@pytest.mark.parametrize("text", ["日本語 é 🙂", "plain words", "<|im_start|>x"])
def test_logprob_bytes_are_the_tokens_own(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    # A token with part of a character decodes to U+FFFD alone; its bytes, joined, give the text back (OpenAI's)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    delta = TokenDelta("r", ids, "length", 3, len(ids), logprobs=[-1.0] * len(ids))
    entries = ChoiceStream(0, "r", tokenizer, [], skip_special_tokens=False).feed(delta).logprobs
    assert bytes(b for e in entries for b in e["bytes"]).decode() == text
    if "日" in text:
        assert any(e["token"] == "\ufffd" for e in entries)  # (the case: split characters)


def test_logprob_entries(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer("hello world")["input_ids"][:2]
    choice = ChoiceStream(0, "r", tokenizer, [])
    delta = TokenDelta("r", ids, "length", 3, 2, logprobs=[-0.5, -1.5], top_logprobs=[[[ids[0], -0.5]], [[7, -0.25]]])
    update = choice.feed(delta)
    assert [e["logprob"] for e in update.logprobs] == [-0.5, -1.5]
    assert update.logprobs[0]["token"] == tokenizer.decode([ids[0]])
    assert update.logprobs[0]["bytes"] == list(tokenizer.decode([ids[0]]).encode())
    assert update.logprobs[1]["top_logprobs"] == [
        {"token": tokenizer.decode([7]), "logprob": -0.25, "bytes": list(tokenizer.decode([7]).encode())}
    ]


def test_updates_taken_together_equal_the_stream_one_by_one(tokenizer: PreTrainedTokenizerBase) -> None:
    """The gateway merges the updates that queued up into one chunk (`ChoiceUpdate.then`): text, token ids
    and logprob entries concatenate in order, and the last update's finish reason is the merged one's."""
    ids = tokenizer("Merged chunks read exactly like single ones.")["input_ids"]
    one_by_one = ChoiceStream(0, "r", tokenizer, [])
    updates = [
        one_by_one.feed(TokenDelta("r", [t], "stop" if i == len(ids) - 1 else None, 5, i + 1, logprobs=[-0.5 * i]))
        for i, t in enumerate(ids)
    ]
    merged = updates[0]
    for update in updates[1:]:
        merged = merged.then(update)
    assert merged.text == tokenizer.decode(ids) and merged.token_ids == ids
    assert [e["logprob"] for e in merged.logprobs] == [-0.5 * i for i in range(len(ids))]
    assert merged.finish_reason == "stop" and updates[0].then(updates[1]).finish_reason is None


def test_a_restarted_choice_is_as_if_new(tokenizer: PreTrainedTokenizerBase) -> None:
    """A non-streamed choice generated again after its decoder was lost: what came before counts for nothing
    (text, token ids, logprobs, usage, a stop string's held text), and the answer is the second run's alone."""
    ids = tokenizer.encode("Hello world, this is a test.")
    fresh = ChoiceStream(0, "r", tokenizer, ["test"])
    want = "".join(feed_all(fresh, ids))
    choice = ChoiceStream(0, "r", tokenizer, ["test"])
    choice.feed(TokenDelta("r", ids[:4], None, prompt_tokens=7, completion_tokens=4))
    choice.restart()
    assert (choice.text, choice.token_ids, choice.completion_tokens, choice.finish_reason) == ("", [], 0, None)
    assert "".join(feed_all(choice, ids)) == want and choice.text == fresh.text
    assert choice.token_ids == fresh.token_ids and choice.finish_reason == fresh.finish_reason
