"""Hypothesis-made request bodies against the real stack (seeded: the same cases every run): chat and text
completions of a valid-ish shape with fields of the wrong type, extreme numbers, odd unicode, odd content parts,
media bytes random, truncated or of the wrong type, images at the size limits, raw non-JSON and invalid UTF-8
bodies, wrong Content-Types. Every case gets a 200 (a stream to its ``[DONE]``) or an OpenAI-shaped error that
says what is wrong (a 4xx; 503 only for overload), in time, on a connection that is answered; afterwards every
process runs with the same pid, /health is 200 and nothing is in flight. (test_mutated_requests mutates one
fixed valid request; this explores shapes it cannot reach.)"""

from __future__ import annotations

import base64
import http.client
import io
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.integration.conftest import Stack
from tests.media import make_image

EXAMPLES = 200


def fixed_examples(count: int) -> settings:
    """The fuzz suites' settings: the same ``count`` cases every run (a fixed seed, no example database), however
    slowly a stack under test answers."""
    return settings(
        max_examples=count, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )


ANSWER_BOUND_S = 30.0
PROCESSES = ("gateway", "fetcher-0", "encoder-0", "cache", "decoder")

# ----------------------------------------------------------------------------- media


def encoded(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


SIDES = [1, 2, 3, 27, 28, 29, 56, 300]  # tiny, around one patch, and extreme aspect ratios (300 x 1)


@st.composite
def image_bytes(draw: st.DrawFn) -> bytes:
    width, height = draw(st.sampled_from(SIDES)), draw(st.sampled_from(SIDES))
    whole = encoded(
        make_image(width, height, seed=draw(st.integers(0, 3))), draw(st.sampled_from(["PNG", "JPEG", "GIF"]))
    )
    return draw(
        st.sampled_from(["whole", "truncated", "random", "flipped"]).flatmap(
            lambda how: {
                "whole": st.just(whole),
                "truncated": st.integers(0, len(whole) - 1).map(lambda n: whole[:n]),
                "random": st.binary(max_size=200),
                "flipped": st.integers(0, len(whole) - 1).map(
                    lambda n: whole[:n] + bytes([whole[n] ^ 0xFF]) + whole[n + 1 :]
                ),
            }[how]
        )
    )


MIMES = ["image/png", "image/jpeg", "image/gif", "image/webp", "image/svg+xml", "text/plain", "video/mp4", "", "x"]
media_urls = st.one_of(
    st.builds(
        lambda mime, data, b64: (
            f"data:{mime};base64,{base64.b64encode(data).decode()}" if b64 else f"data:{mime},{data!r}"
        ),
        st.sampled_from(MIMES),
        image_bytes(),
        st.booleans(),
    ),
    st.builds(lambda mime, tail: f"data:{mime};base64,{tail}", st.sampled_from(MIMES), st.text(max_size=12)),
    st.sampled_from(
        ["", "data:", "data:image/png;base64,", "http://127.0.0.1:1/x.png", "file:///etc/passwd", "gopher://x", "\x00"]
    ),
    st.text(max_size=20),
)
odd = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=10),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
media_fields = st.fixed_dictionaries(
    {"url": media_urls}, optional={"detail": odd, "min_pixels": odd, "max_pixels": odd, "fps": odd}
)
parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=40) | odd}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": media_fields | odd}),
    st.fixed_dictionaries({"type": st.just("video_url"), "video_url": media_fields | odd}),
    st.fixed_dictionaries({"type": st.sampled_from(["input_audio", "image", "", "file"])}, optional={"image_url": odd}),
    st.dictionaries(st.text(max_size=6), odd, max_size=3),
    odd,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "user", "system", "assistant", "tool", "developer", "robot"]) | odd},
        optional={"content": st.text(max_size=60) | st.lists(parts, max_size=3) | odd, "name": odd},
    ),
    max_size=3,
)
# (never a large valid count: a long answer on a 2-core machine would only test patience)
small_tokens = st.integers(-2, 4) | st.sampled_from([10**30, 2**63, 2**64, -(2**63), 1.5, "3", None, True, [], {}])
common_options = {
    "temperature": st.floats(-1, 3) | odd,
    "top_p": st.floats(-1, 2) | odd,
    "n": st.integers(-1, 3) | st.just(10**6) | odd,
    "stream": st.booleans() | odd,
    "stop": st.lists(st.text(max_size=4), max_size=5) | odd,
    "seed": odd,
    "logprobs": st.booleans() | odd,
    "top_logprobs": st.integers(-1, 30) | odd,
    "presence_penalty": st.floats() | odd,
    "logit_bias": st.dictionaries(st.text(max_size=6), st.floats() | odd, max_size=2) | odd,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": odd}) | odd,
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "x"])})
    | odd,
    "model": odd,
}
chat_bodies = st.fixed_dictionaries(
    {"messages": messages, "max_tokens": small_tokens},
    optional={**common_options, "max_completion_tokens": small_tokens},
)
completion_bodies = st.fixed_dictionaries(
    {
        "prompt": st.text(max_size=40)
        | st.lists(st.integers(-5, 200_000), max_size=6)
        | st.lists(odd, max_size=3)
        | odd,
        "max_tokens": small_tokens,
    },
    optional={**common_options, "echo": odd, "suffix": odd, "best_of": odd},
)
CONTENT_TYPES = [
    "application/json",
    "application/json",
    "application/json; charset=latin-1",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "",
]
raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.text(max_size=40).map(str.encode),
    st.sampled_from(
        [
            b"",
            b"null",
            b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3"}], "max_tokens": 2}',
            b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}], "max_tokens": 2}',
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2',
            b'\xef\xbb\xbf{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}',
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}',
            b'{"prompt": "hi", "max_tokens": Infinity}',
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "max_tokens": "x"}',
        ]
    ),
)


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """(path, Content-Type, body)."""
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/chat/completions", "/v1/completions"]))
    kind = draw(st.sampled_from(["json", "json", "json", "raw"]))
    if kind == "raw":
        body = draw(raw_bodies)
    else:
        value = draw(chat_bodies if path == "/v1/chat/completions" else completion_bodies)
        body = json.dumps(value, allow_nan=True).encode("utf-8", "surrogatepass")
    return path, draw(st.sampled_from(CONTENT_TYPES)), body


# ----------------------------------------------------------------------------- the run


def exchange(stack: Stack, path: str, content_type: str, body: bytes) -> tuple[int, bytes, float]:
    """Status, whole body and seconds; a dropped connection or a timeout raises."""
    host, port = stack.base_url.removeprefix("http://").split(":")
    started = time.monotonic()
    conn = http.client.HTTPConnection(host, int(port), timeout=ANSWER_BOUND_S + 30)
    try:
        headers = {"Content-Type": content_type} if content_type else {}
        conn.request("POST", path, body, headers)
        response = conn.getresponse()
        return response.status, response.read(), time.monotonic() - started
    finally:
        conn.close()


def judged(stack: Stack, case: tuple[str, str, bytes]) -> tuple[Any, ...] | None:
    """None if the answer is good; else what was wrong with it."""
    try:
        status, raw, elapsed = exchange(stack, *case)
    except (OSError, http.client.HTTPException) as exc:
        return "no answer", repr(exc), case[0], case[1], case[2][:300]
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    error = answer.get("error") if isinstance(answer, dict) else None
    shaped = isinstance(error, dict) and bool(error.get("message")) and {"type", "code", "param"} <= set(error)
    if status == 200:
        good = answer is not None or raw.rstrip().endswith(b"data: [DONE]")
    else:
        good = (400 <= status < 500 or status == 503) and shaped
    if good and elapsed <= ANSWER_BOUND_S:
        return None
    return status, round(elapsed, 1), raw[:300], case[0], case[1], case[2][:300]


def test_hypothesis_requests_get_an_answer_or_a_clean_error(stack: Stack) -> None:
    pids = {p: stack.pid(p) for p in PROCESSES}
    made: list[tuple[str, str, bytes]] = []

    @fixed_examples(EXAMPLES)
    @given(cases())
    def collect(case: tuple[str, str, bytes]) -> None:
        made.append(case)

    collect()
    with ThreadPoolExecutor(6) as pool:  # (one at a time, they would mostly wait on a 2-core machine)
        wrong = [w for w in pool.map(lambda case: judged(stack, case), made) if w is not None]
    assert not wrong, wrong
    assert {p: stack.pid(p) for p in PROCESSES} == pids
    assert stack.get_json("/health")[0] == 200
    deadline = time.monotonic() + 30
    while (busy := stack.metrics().get("vlm_gateway_requests_in_flight", 0)) != 0:
        assert time.monotonic() < deadline, f"{busy} requests still in flight"
        time.sleep(0.2)
    while (leased := stack.metrics().get("vlm_cache_leased_requests", 0)) != 0:
        assert time.monotonic() < deadline, f"{leased} requests still hold cache leases"
        time.sleep(0.2)
