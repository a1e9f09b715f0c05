"""``[server] max_queue_wait_s``: while a backlog of admitted requests (at least 2, and a quarter of those in flight)
has waited that long for its first answer, a new request is refused at once with 503 + Retry-After; one straggler
alone refuses nothing; once nothing waits, requests are served again."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import openai
import pytest
from openai import OpenAI

from tests.integration.conftest import Stack, serve


@pytest.fixture(scope="module")
def queue_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from serve(tmp_path_factory, "queue-wait", server_toml="max_queue_wait_s = 1.0\n")


@pytest.fixture
def silent_url() -> Iterator[str]:
    """An HTTP server that takes connections and never answers: a request for its image waits (the fetcher's
    http_timeout_s, 5 s in the test stacks) before it gets any answer."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []

    def hold() -> None:
        with contextlib.suppress(OSError):  # (the listener closed: the test is over)
            while True:
                held.append(listener.accept()[0])

    threading.Thread(target=hold, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/image.png"
    finally:
        listener.close()
        for connection in held:
            connection.close()


def ask(stack: Stack, content: object) -> object:
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": content}], max_tokens=2
    )


def waiting_in_threads(stack: Stack, silent_url: str, count: int) -> tuple[list[threading.Thread], list[Exception]]:
    """``count`` requests whose image never comes, each in its own thread: they wait until the fetcher gives up."""
    waiting = [{"type": "image_url", "image_url": {"url": silent_url}}, {"type": "text", "text": "what is it?"}]
    errors: list[Exception] = []

    def stuck() -> None:
        try:
            ask(stack, waiting)
        except openai.APIStatusError as exc:  # (its image never comes: a 4xx after the fetcher's timeout)
            errors.append(exc)

    threads = [threading.Thread(target=stuck) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads, errors


def test_one_straggler_past_the_limit_turns_nothing_away(queue_stack: Stack, silent_url: str) -> None:
    threads, errors = waiting_in_threads(queue_stack, silent_url, 1)
    time.sleep(2.0)  # past max_queue_wait_s, within the fetcher's timeout
    assert ask(queue_stack, "hi").choices  # (the old rule, the oldest request's wait, refused it)
    threads[0].join(timeout=60)
    assert errors and errors[0].status_code < 500


def test_a_backlog_waiting_past_the_limit_turns_new_ones_away(queue_stack: Stack, silent_url: str) -> None:
    threads, errors = waiting_in_threads(queue_stack, silent_url, 2)
    time.sleep(2.0)  # past max_queue_wait_s, within the fetcher's timeout
    with pytest.raises(openai.InternalServerError) as refused:
        ask(queue_stack, "hi")
    assert refused.value.status_code == 503
    assert refused.value.response.headers["Retry-After"] == "1"
    assert "max_queue_wait_s" in refused.value.message
    for thread in threads:
        thread.join(timeout=60)
    assert len(errors) == 2 and all(e.status_code < 500 for e in errors)
    assert ask(queue_stack, "hi").choices  # nothing waits any more
