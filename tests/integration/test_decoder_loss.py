"""A decoder killed while non-streamed answers are half made: their clients have seen nothing, so the gateway
generates them again from their start (issue 30: nothing a client sees when one stage dies). Each completes with
the greedy tokens of the same request on the undisturbed stack, its usage counted once."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import openai
from openai import OpenAI

from tests.integration.conftest import Stack
from tests.integration.test_faults import ANSWER_BOUND_S, wait_restarted

WHOLE_TOKENS = 64  # long enough that a kill while tokens flow lands mid-answer


@dataclass
class Whole:
    """One non-streamed answer: its token ids, usage, and error ("" when it completed)."""

    token_ids: list[int]
    completion_tokens: int
    error: str = ""


def whole_one(client: OpenAI, model: str, topic: int) -> Whole:
    try:
        response = client.chat.completions.create(
            model=model,
            max_tokens=WHOLE_TOKENS,
            temperature=0,
            extra_body={"min_tokens": WHOLE_TOKENS, "return_token_ids": True},
            messages=[{"role": "user", "content": f"Tell me about topic number {topic}."}],
        )
    except openai.APIError as exc:
        return Whole([], -1, f"{getattr(exc, 'status_code', '?')}: {exc.message}")
    choice = response.choices[0]
    usage = response.usage.completion_tokens if response.usage is not None else -1
    return Whole(list(getattr(choice, "token_ids", None) or []), usage)


def tokens_generated(stack: Stack) -> float:
    return stack.metrics().get("vlm_decoder_generated_tokens_total", 0.0)


def test_a_decoder_killed_mid_answer_fails_no_non_streamed_request(stack: Stack) -> None:
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=ANSWER_BOUND_S + 30)
    model = client.models.list().data[0].id
    topics = list(range(900, 912))
    restarted = stack.metrics().get("vlm_gateway_requests_restarted_total", 0.0)
    victim, before = stack.pid("decoder"), tokens_generated(stack)
    with ThreadPoolExecutor(len(topics)) as pool:
        futures = [pool.submit(whole_one, client, model, t) for t in topics]
        deadline = time.monotonic() + ANSWER_BOUND_S
        while tokens_generated(stack) < before + len(topics):  # (tokens flowing: answers are half made)
            assert time.monotonic() < deadline, "no token was generated"
            time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        through = [f.result(timeout=ANSWER_BOUND_S + 60) for f in futures]
    wait_restarted(stack, "decoder", victim)
    assert stack.metrics().get("vlm_gateway_requests_restarted_total", 0.0) > restarted  # (mid-answer ones)
    reference = [whole_one(client, model, t) for t in topics]
    assert not [r for r in through if r.error], through
    for got, want in zip(through, reference, strict=True):
        assert got.token_ids == want.token_ids and len(got.token_ids) == WHOLE_TOKENS, (got, want)
        assert got.completion_tokens == WHOLE_TOKENS, got  # (usage once, not the lost tokens as well)
