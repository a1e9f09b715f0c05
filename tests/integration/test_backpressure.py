"""A server at its limit of requests in flight answers 503 at once, with Retry-After, and serves again
once a request leaves."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import openai
import pytest
from openai import OpenAI

from tests.integration.conftest import Stack, serve


@pytest.fixture(scope="module")
def busy_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from serve(tmp_path_factory, "one-in-flight", server_toml="max_requests_in_flight = 1\n")


def ask(stack: Stack, **options: object) -> object:
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        extra_body={"ignore_eos": True},
        **options,  # type: ignore[arg-type]
    )


def test_a_request_past_the_limit_is_refused_at_once_and_the_server_recovers(busy_stack: Stack) -> None:
    streaming = ask(busy_stack, max_tokens=4000, stream=True)
    next(iter(streaming))  # type: ignore[call-overload]  # the first chunk: this request is in flight
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError, match="limit of 1 requests in flight") as refused:
        ask(busy_stack, max_tokens=2)
    assert refused.value.status_code == 503 and time.monotonic() - started < 5
    assert refused.value.response.headers["Retry-After"] == "1"
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'  # the raw route too, body unread
    request = urllib.request.Request(
        busy_stack.base_url + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(request, timeout=30)
    assert raw.value.code == 503
    streaming.close()  # type: ignore[attr-defined]  # the client leaves; its slot frees as the gateway sees it
    deadline = time.monotonic() + 30
    while True:
        try:
            reply = ask(busy_stack, max_tokens=2)
            break
        except openai.InternalServerError:
            assert time.monotonic() < deadline, "still refusing 30 s after the only request left"
            time.sleep(0.2)
    assert reply.choices[0].finish_reason == "length"  # type: ignore[attr-defined]
    assert busy_stack.metrics()["vlm_gateway_requests_refused_busy_total"] >= 2
