"""Valid requests with random fields replaced, removed or added (wrong types, extremes, lone surrogates,
unreachable or forbidden media): every answer is a success or an OpenAI-shaped 4xx, never a 5xx, never
slow, and a streamed success ends with ``[DONE]``. Seeded: the same requests every run."""

from __future__ import annotations

import copy
import json
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tests.integration.conftest import Stack
from tests.integration.test_errors import post
from tests.media import data_url, make_image

REQUESTS = 200
ANSWER_BOUND_S = 30.0
ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2**63, -(2**63) - 1, 1e308, -0.0, 0.5, "", "x", "\ud800", "é" * 3, [], [1], {},
    {"a": 1}, [[[]]], "0" * 10_000, [{"type": "text"}], [{"type": "image_url", "image_url": {}}],
    [{"type": "video_url", "video_url": {"url": "x"}}], "data:image/png;base64,AAAA",
    "http://127.0.0.1:1/x.png", "file:///etc/passwd",
]  # fmt: skip
ADDED_KEYS = ["extra", "tools", "response_format", "functions", "n", "best_of", "echo", "stream"]


def valid_bodies() -> dict[str, dict[str, Any]]:
    picture = data_url(make_image(64, 48, seed=5))
    content = [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": picture}}]
    chat = {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}],
        "max_tokens": 4, "max_completion_tokens": 4, "temperature": 0.5, "top_p": 0.9, "n": 1, "stop": ["x"],
        "logprobs": True, "top_logprobs": 2, "seed": 3, "presence_penalty": 0.1, "logit_bias": {"5": 1.0},
        "stream_options": {"include_usage": True}, "user": "u",
    }  # fmt: skip
    text = {"prompt": "Hello", "max_tokens": 4, "echo": False, "logprobs": 1, "n": 1, "suffix": None}
    return {"/v1/chat/completions": chat, "/v1/completions": text}


def places(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield at
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        yield from places(inner, (*at, key))


def mutated(body: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    body = copy.deepcopy(body)
    for _ in range(rng.randint(1, 3)):
        where = rng.choice([p for p in places(body) if p])
        parent = body
        for key in where[:-1]:
            parent = parent[key]
        roll = rng.random()
        if roll < 0.6:
            parent[where[-1]] = copy.deepcopy(rng.choice(ODD_VALUES))
        elif isinstance(parent, dict) and roll < 0.8:
            del parent[where[-1]]
        elif isinstance(parent, dict):
            parent[rng.choice(ADDED_KEYS)] = copy.deepcopy(rng.choice(ODD_VALUES))
    if rng.random() < 0.5:
        body["stream"] = True
    return body


def judged(stack: Stack, path: str, body: dict[str, Any]) -> tuple[Any, ...] | None:
    """None if the answer is good (a success, streamed to its ``[DONE]``, or an OpenAI-shaped 4xx, in time);
    else what was wrong with it."""
    started = time.monotonic()
    status, answer, raw = post(stack, body, timeout=ANSWER_BOUND_S + 30, path=path)
    elapsed = time.monotonic() - started
    error = answer.get("error") if isinstance(answer, dict) else None
    shaped = isinstance(error, dict) and bool(error.get("message")) and {"type", "code", "param"} <= set(error)
    if status == 200:
        good = body.get("stream") is not True or raw.rstrip().endswith(b"data: [DONE]")
    else:
        good = 400 <= status < 500 and shaped
    if good and elapsed <= ANSWER_BOUND_S:
        return None
    return status, round(elapsed, 1), raw[:300], json.dumps(body)[:300]


def test_mutated_requests_get_an_answer_or_a_clear_4xx(stack: Stack) -> None:
    """Eight at a time (one by one they took 100 s on a 2-core machine, mostly waiting)."""
    rng = random.Random(20261130)
    bodies = valid_bodies()
    requests = []
    for _ in range(REQUESTS):
        path = rng.choice(sorted(bodies))
        requests.append((path, mutated(bodies[path], rng)))
    with ThreadPoolExecutor(8) as pool:
        wrong = [w for w in pool.map(lambda request: judged(stack, *request), requests) if w is not None]
    assert not wrong, wrong
