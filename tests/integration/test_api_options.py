"""OpenAI request options through the real stack: each one changes the answer as the API says."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.integration.conftest import Stack

MESSAGES = [{"role": "user", "content": "Write a few words about rivers and mountains."}]


@pytest.fixture(scope="module")
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def create(client: OpenAI, **options: Any) -> Any:
    extra = options.pop("extra_body", {})
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=options.pop("messages", MESSAGES),
        max_tokens=options.pop("max_tokens", 24),
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
        **options,
    )


def test_n_greedy_choices_are_identical_and_indexed(client: OpenAI) -> None:
    reply = create(client, n=3, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in reply.choices}) == 1
    assert reply.usage.completion_tokens == 3 * 24


def test_n_seeded_samples_differ_and_reproduce(client: OpenAI) -> None:
    first = create(client, n=2, temperature=1.0, seed=11)
    again = create(client, n=2, temperature=1.0, seed=11)
    other = create(client, n=2, temperature=1.0, seed=12)
    ids = [c.token_ids for c in first.choices]
    assert ids[0] != ids[1]
    assert ids == [c.token_ids for c in again.choices]
    assert ids != [c.token_ids for c in other.choices]


def test_n_streams_every_choice(client: OpenAI) -> None:
    stream = create(client, n=2, temperature=0, stream=True)
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts[0] == texts[1] != "" and finishes == {0: "length", 1: "length"}


def test_stop_strings_cut_the_text(client: OpenAI) -> None:
    free = create(client, temperature=0).choices[0].message.content
    stop = free[len(free) // 3 : len(free) // 3 + 4]
    assert stop.strip() and stop in free
    expected = free[: free.index(stop)]
    reply = create(client, temperature=0, stop=[stop, "\u2603never"])
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == "stop"
    streamed = create(client, temperature=0, stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_top_logprobs_without_logprobs_is_refused(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        create(client, top_logprobs=3)
    with pytest.raises(openai.BadRequestError, match="n"):
        create(client, n=100)
