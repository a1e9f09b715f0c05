"""Reasoning output on the real stack, official client: a Qwen3-VL checkpoint whose template opens `<think>`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from openai import OpenAI
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from common.config import load_config
from tests.integration.conftest import Stack, serve
from workers.models.synth import generate_checkpoint

THINK_END = 151668  # `</think>`, an added (non-special) token of Qwen3's tokenizer
MESSAGES = [{"role": "user", "content": "What is two and two?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model = generate_checkpoint(tmp_path_factory.mktemp("thinking") / "tiny", "tiny", 0, "qwen3_vl", thinking=True)
    yield from serve(tmp_path_factory, "thinking", f'[model]\npath = "{model}"\n')


@pytest.fixture(scope="module")
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(stack: Stack) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(load_config(stack.config_path).model_path()))


def _forced(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """Random weights never close the thinking on their own: sampling among a few words and `</think>`, all
    biased far above the rest, closes it somewhere in most answers, with words on both sides in some."""
    words = [tokenizer(w, add_special_tokens=False)["input_ids"] for w in (" the", " of", " and", " to", ".")]
    assert all(len(w) == 1 for w in words)
    bias = {str(w[0]): 100 for w in words} | {str(THINK_END): 100}
    return dict(messages=MESSAGES, max_tokens=16, temperature=1.0, seed=7, n=8, logit_bias=bias)


def _expected(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> tuple[str, str | None]:
    """What the token ids say: reasoning before the first `</think>`, content after it (null if empty or absent)."""
    if THINK_END not in ids:
        return tokenizer.decode(ids, skip_special_tokens=True), None
    end = ids.index(THINK_END)
    content = tokenizer.decode(ids[end + 1 :], skip_special_tokens=True)
    return tokenizer.decode(ids[:end], skip_special_tokens=True), content or None


def test_reasoning_content_and_content_are_what_the_token_ids_say(
    client: OpenAI, tokenizer: PreTrainedTokenizerBase
) -> None:
    reply = client.chat.completions.create(model="", **_forced(tokenizer), extra_body={"return_token_ids": True})
    both = 0
    for choice in reply.choices:
        ids: list[int] = choice.token_ids  # type: ignore[attr-defined]
        reasoning, content = _expected(tokenizer, ids)
        assert choice.message.reasoning_content == reasoning  # type: ignore[attr-defined]
        assert choice.message.content == content
        both += bool(reasoning) and bool(content)
    assert both, "no answer had both reasoning and content: the test proves nothing"


def test_streamed_reasoning_and_content_are_the_whole_answers(
    client: OpenAI, tokenizer: PreTrainedTokenizerBase
) -> None:
    whole = client.chat.completions.create(model="", **_forced(tokenizer))
    stream = client.chat.completions.create(model="", **_forced(tokenizer), stream=True)
    reasoning = [""] * len(whole.choices)
    content = [""] * len(whole.choices)
    for chunk in stream:
        for choice in chunk.choices:
            piece = getattr(choice.delta, "reasoning_content", None) or ""
            assert "</think>" not in piece  # (content may hold a later one: only the first closes the thinking)
            reasoning[choice.index] += piece
            content[choice.index] += choice.delta.content or ""
    for choice in whole.choices:
        assert reasoning[choice.index] == choice.message.reasoning_content  # type: ignore[attr-defined]
        assert content[choice.index] == (choice.message.content or "")
    assert any(r and c for r, c in zip(reasoning, content, strict=True))


def test_an_answer_cut_inside_the_thinking_is_all_reasoning(client: OpenAI, tokenizer: PreTrainedTokenizerBase) -> None:
    reply = client.chat.completions.create(
        model="", messages=MESSAGES, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = reply.choices[0]
    ids: list[int] = choice.token_ids  # type: ignore[attr-defined]
    assert THINK_END not in ids and choice.finish_reason == "length"
    assert choice.message.content is None
    assert choice.message.reasoning_content == tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]


def test_enable_thinking_false_reaches_the_template_and_leaves_only_content(
    client: OpenAI, tokenizer: PreTrainedTokenizerBase
) -> None:
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text.endswith("<think>\n\n</think>\n\n")
    closed = tokenizer(text, add_special_tokens=False)["input_ids"]
    reply = client.chat.completions.create(
        model="",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        extra_body={"return_token_ids": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    choice = reply.choices[0]
    assert reply.usage is not None and reply.usage.prompt_tokens == len(closed)
    assert choice.message.reasoning_content is None  # type: ignore[attr-defined]
    assert choice.message.content == tokenizer.decode(choice.token_ids, skip_special_tokens=True)  # type: ignore[attr-defined]
