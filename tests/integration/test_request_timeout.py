"""``[server] request_timeout_s`` on a stack started process by process: a generation that outlives it ends
with a 504 in OpenAI's shape (before a stream starts) or an in-band error event that ends the stream (after),
and the request is stopped everywhere: nothing stays in flight in the gateway or running in the decoder."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator

import pytest
from openai import APIStatusError, OpenAI

from common.config import load_config
from tests.integration.conftest import Stack, hand_started_stack

TIMEOUT_S = 1.5
# The demo model decodes a few hundred tokens a second on a CPU: 20,000 forced tokens take far longer.
LONG = {"max_tokens": 20_000, "extra_body": {"min_tokens": 20_000}}


@pytest.fixture(scope="module")
def base_url(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("timeout")
    model = load_config(stack.config_path).model_path()
    with hand_started_stack(root, model, server=f"request_timeout_s = {TIMEOUT_S}\n") as url:
        yield url


def gauges(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in lines if line[:1] != "#")}


def wait_idle(base_url: str, timeout_s: float = 20.0) -> dict[str, float]:
    """The gateway's and the decoder's gauges once both are back to no request (the decoder reports its
    own with each heartbeat, so it lags by up to one)."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = gauges(base_url)
        idle = values["vlm_gateway_requests_in_flight"] == 0 and values.get("vlm_decoder_requests_running") == 0
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.2)  # a test waiting on another process's heartbeat


def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def test_a_request_past_the_timeout_gets_504_and_stops(base_url: str) -> None:
    openai = client(base_url)
    started = time.monotonic()
    with pytest.raises(APIStatusError) as caught:
        openai.completions.create(model=openai.models.list().data[0].id, prompt="Tell a long story.", **LONG)
    assert caught.value.status_code == 504
    assert caught.value.response.headers["x-should-retry"] == "false"  # (it would only run out again)
    assert caught.value.body["code"] == "timeout"  # type: ignore[index]
    assert "timed out" in caught.value.body["message"]  # type: ignore[index]
    assert TIMEOUT_S <= time.monotonic() - started < TIMEOUT_S + 10
    values = wait_idle(base_url)
    assert values["vlm_gateway_requests_in_flight"] == 0
    assert values["vlm_decoder_requests_running"] == 0


def test_a_stream_past_the_timeout_ends_with_an_error_event_after_its_tokens(base_url: str) -> None:
    openai = client(base_url)
    model = openai.models.list().data[0].id
    request = urllib.request.Request(
        base_url + "/v1/completions",
        data=json.dumps({"model": model, "prompt": "Tell a long story.", "stream": True, **flat(LONG)}).encode(),
        headers={"Content-Type": "application/json"},
    )
    events = []
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        for line in response:
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
    assert events[-1] == b"[DONE]"
    *chunks, error = [json.loads(e) for e in events[:-1]]
    assert len(chunks) > 2 and all(c["choices"][0]["finish_reason"] is None for c in chunks)  # tokens came first
    assert error["error"]["code"] == "timeout", error
    values = wait_idle(base_url)
    assert values["vlm_gateway_requests_in_flight"] == 0
    assert values["vlm_decoder_requests_running"] == 0


def flat(options: dict[str, object]) -> dict[str, object]:
    """The openai client's ``extra_body`` merged into the JSON body, as the client sends it."""
    body = {k: v for k, v in options.items() if k != "extra_body"}
    return {**body, **options.get("extra_body", {})}  # type: ignore[dict-item]


def test_the_timeout_does_not_cut_a_request_that_ends_in_time(base_url: str) -> None:
    openai = client(base_url)
    model = openai.models.list().data[0].id
    reply = openai.completions.create(model=model, prompt="Hi", max_tokens=8, extra_body={"min_tokens": 8})
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 8
