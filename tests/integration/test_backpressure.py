"""A server at its limit of requests (or request bytes) in flight answers 503 at once, with Retry-After,
and serves again once requests leave."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.integration.conftest import Stack, serve
from tests.media import data_url, make_image

LIMITS = "max_requests_in_flight = 2\nmax_request_bytes_in_flight = 100000\nmax_request_bytes = 400000\n"


@pytest.fixture(scope="module")
def busy_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from serve(tmp_path_factory, "two-in-flight", server_toml=LIMITS)


def ask(stack: Stack, content: Any = "Tell me a long story.", **options: Any) -> Any:
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": content}],
        extra_body={"ignore_eos": True},
        **options,
    )


def in_flight(stack: Stack) -> Any:
    """A streaming request that stays in flight while its client does not read it."""
    stream = ask(stack, max_tokens=4000, stream=True)
    next(iter(stream))  # its first chunk: the gateway is serving it
    return stream


def refused(stack: Stack, content: Any = "hi") -> openai.InternalServerError:
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as raised:
        ask(stack, content, max_tokens=2)
    assert raised.value.status_code == 503 and time.monotonic() - started < 5
    assert raised.value.response.headers["Retry-After"] == "1"
    return raised.value


def wait_until_served(stack: Stack) -> None:
    """Until a small request is served: the requests whose clients left free their slots."""
    deadline = time.monotonic() + 30
    while True:
        try:
            ask(stack, max_tokens=1)
            return
        except openai.InternalServerError:
            assert time.monotonic() < deadline, "still refusing 30 s after the requests in flight left"
            time.sleep(0.2)  # the gateway notices a closed stream at its next write


def chunked_body(stack: Stack, **options: Any) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A chat request whose body is sent with Transfer-Encoding: chunked (no Content-Length)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, **options}
    host, port = stack.base_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {"Content-Type": "application/json"}
    connection.request("POST", "/v1/chat/completions", iter([json.dumps(body).encode()]), headers, encode_chunked=True)
    return connection, connection.getresponse()


def chunked_post(stack: Stack) -> int:
    connection, response = chunked_body(stack, max_tokens=2)
    response.read()
    connection.close()
    return response.status


def chunked_stream(stack: Stack) -> http.client.HTTPConnection:
    """A streaming request in chunks that stays in flight while its client does not read it."""
    connection, response = chunked_body(stack, max_tokens=4000, stream=True)
    assert response.status == 200 and response.readline().startswith(b"data: ")
    return connection


def test_a_body_over_max_request_bytes_gets_a_413_in_openais_shape(busy_stack: Stack) -> None:
    huge = [{"type": "image_url", "image_url": {"url": data_url(make_image(512, 512, seed=3))}}]  # ~800 kB
    with pytest.raises(openai.APIStatusError) as raised:
        ask(busy_stack, huge, max_tokens=2)
    assert raised.value.status_code == 413
    assert "max_request_bytes" in raised.value.message and "by URL" in raised.value.message


def test_requests_past_the_limits_are_refused_at_once_and_the_server_recovers(busy_stack: Stack) -> None:
    big = [{"type": "image_url", "image_url": {"url": data_url(make_image(256, 256, seed=9))}}]
    big.append({"type": "text", "text": "What is it?"})  # a body of ~200 kB
    first = in_flight(busy_stack)
    assert "would pass its limit" in refused(busy_stack, big).message  # 100 kB of bodies at most
    second = in_flight(busy_stack)  # a small one still fits
    assert "limit of 2 requests in flight" in refused(busy_stack).message
    body = b'{"prompt": "hi"}'  # the text route too, its body unread
    request = urllib.request.Request(
        busy_stack.base_url + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(request, timeout=30)
    assert raw.value.code == 503
    first.close()  # the clients leave; their slots free as the gateway sees them go
    second.close()
    wait_until_served(busy_stack)
    # A body in chunks (no Content-Length) counts as max_request_bytes until read: refused beside another...
    lone = in_flight(busy_stack)
    assert chunked_post(busy_stack) == 503
    lone.close()
    wait_until_served(busy_stack)
    streaming = chunked_stream(busy_stack)  # ...let in alone, and once read counted at its size: another fits
    assert ask(busy_stack, max_tokens=1).choices[0].finish_reason == "length"
    streaming.close()
    alone = ask(busy_stack, big, max_tokens=2)  # alone, a body over the bytes limit is served
    assert alone.choices[0].finish_reason == "length"
    assert busy_stack.metrics()["vlm_gateway_requests_refused_busy_total"] >= 3
