"""Bad input gets an OpenAI-shaped 4xx that names the problem; the stack keeps serving."""

from __future__ import annotations

import base64
import http.client
import json
import re
import time
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

from tests.integration.conftest import MediaServer, Stack
from tests.media import data_url, make_image


def post(
    stack: Stack, body: bytes | dict[str, Any], timeout: float = 60, path: str = "/v1/chat/completions"
) -> tuple[int, dict[str, Any], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(stack.base_url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw), raw
    except json.JSONDecodeError:
        return status, {}, raw


def chat(content: Any, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def image(url: str) -> list[dict[str, Any]]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]


def assert_error(status: int, body: dict[str, Any], expected_status: int, *needles: str) -> None:
    assert status == expected_status, body
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    for needle in needles:
        assert needle.lower() in error["message"].lower(), error["message"]


CASES = {
    "malformed_json": (b'{"messages": [', 400, ("not valid JSON",)),
    "not_an_object": (b"[1, 2]", 400, ("JSON object",)),
    "no_messages": ({"messages": []}, 400, ("messages",)),
    "missing_messages": ({"max_tokens": 3}, 400, ("messages", "required")),
    "unknown_content_type": (chat([{"type": "audio_url", "audio_url": {"url": "x"}}]), 400, ("audio_url",)),
    "bad_role": ({"messages": [{"role": "robot", "content": "hi"}]}, 400, ("role",)),
    "negative_max_tokens": (chat("hi", max_tokens=-1), 400, ("max_tokens",)),
    "temperature_out_of_range": (chat("hi", temperature=7), 400, ("temperature",)),
    "unknown_model": ({**chat("hi"), "model": "gpt-17"}, 404, ("gpt-17",)),
    "undecodable_image": (
        chat(image("data:image/png;base64," + base64.b64encode(b"definitely not an image" * 10).decode())),
        400,
        ("image",),
    ),
    "bad_base64": (chat(image("data:image/png;base64,@@@not-base64@@@")), 400, ("base64",)),
    "unsupported_scheme": (chat(image("ftp://example.com/cat.png")), 400, ("scheme",)),
    # options that would change the answer are refused by name, never ignored
    "unknown_response_format": (chat("hi", response_format={"type": "xml"}), 400, ("response_format",)),
    "json_schema_that_cannot_compile": (
        chat("hi", response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
        400,
        ("response_format", "foo"),
    ),
    "regex_spelling_an_added_token": (
        chat("hi", structured_outputs={"regex": "yes<\\|im_end\\|>"}),
        400,
        ("<|im_end|>", "by id"),
    ),
    # (Qwen2-VL's template renders no tools: auto, the default with tools, cannot be honoured)
    "tools": (chat("hi", tools=[{"type": "function", "function": {"name": "f"}}]), 400, ("renders tools",)),
    "tool_choice_required": (chat("hi", tool_choice="required"), 400, ("tool_choice", "needs tools")),
    "legacy_functions": (chat("hi", functions=[{"name": "f"}]), 400, ("function calling",)),
    "audio_output": (chat("hi", modalities=["text", "audio"]), 400, ("text output",)),
    "logit_bias_key": (chat("hi", logit_bias={"the": 5}), 400, ("logit_bias", "token ids")),
    "logit_bias_value": (chat("hi", logit_bias={"5": 101}), 400, ("logit_bias",)),
    "logit_bias_outside_vocabulary": (chat("hi", logit_bias={"999999999": 1}), 400, ("logit_bias", "[0,")),
    "unpaired_surrogate": (
        b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}',
        400,
        ("messages.0.content", "surrogate"),
    ),
    # Python's JSON parser takes these; they are no number any option can mean
    "nan_temperature": (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, ("finite",)),
    "nested_too_deep": (b'{"messages": [], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, ("too deeply",)),
    # bodies of a MiB and more are parsed off the event loop: the same answers from there
    "nested_too_deep_large": (b'{"messages": [], "x": ' + b"[" * 600_000 + b"]" * 600_000 + b"}", 400, ("too deeply",)),
    "malformed_json_large": (b'{"messages": [], "x": "' + b"a" * 1_200_000 + b'"', 400, ("not valid JSON",)),
    # integers past 64 bits could not cross a socket (msgpack): refused by name, not a 500
    "seed_past_64_bits": (chat("hi", seed=2**70), 400, ("seed", "9223372036854775807")),
    "max_tokens_past_64_bits": (chat("hi", max_tokens=10**30), 400, ("max_tokens",)),
    "stop_token_id_past_64_bits": (chat("hi", stop_token_ids=[10**30]), 400, ("stop_token_ids",)),
    "image_pixels_past_64_bits": (
        chat([{"type": "image_url", "image_url": {"url": "http://example.com/a.png", "max_pixels": 10**30}}]),
        400,
        ("max_pixels",),
    ),
}


def test_routes_it_does_not_serve_answer_in_openais_shape(stack: Stack) -> None:
    status, body, _ = post(stack, {"input": "hi"}, path="/v1/embeddings")
    assert_error(status, body, 404, "not served", "/v1/chat/completions")
    request = urllib.request.Request(stack.base_url + "/v1/chat/completions")  # a GET
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=30)
    assert_error(raised.value.code, json.loads(raised.value.read()), 405, "not allowed", "POST")


def test_models_retrieve(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)
    name = client.models.list().data[0].id
    assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-17")


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_request(stack: Stack, name: str) -> None:
    body, expected, needles = CASES[name]
    status, reply, _ = post(stack, body)
    assert_error(status, reply, expected, *needles)


def test_unreachable_and_missing_urls(stack: Stack, media_server: MediaServer) -> None:
    status, reply, _ = post(stack, chat(image("http://127.0.0.1:9/nothing.png")))
    assert_error(status, reply, 400, "cannot fetch")
    status, reply, _ = post(stack, chat(image(media_server.base_url + "/missing.png")))
    assert_error(status, reply, 400, "404")


def test_prompt_longer_than_the_context(stack: Stack) -> None:
    status, reply, _ = post(stack, chat("lorem ipsum dolor " * 20000))
    # OpenAI's code and words, which clients (LiteLLM, LangChain) match to trim the history and retry
    assert_error(status, reply, 400, "maximum context length is")
    assert reply["error"]["code"] == "context_length_exceeded"


def test_image_tokens_beyond_the_context_are_refused_before_encoding(stack: Stack) -> None:
    # Many images push the prompt past the context even though the text is short.
    picture = data_url(make_image(600, 600, seed=77))
    parts = [{"type": "image_url", "image_url": {"url": picture}} for _ in range(16)]
    status, reply, _ = post(stack, chat([*parts, {"type": "text", "text": "hi"}], max_tokens=2))
    if status == 200:  # the demo model's context fits them: then the answer must be a real one
        assert reply["usage"]["prompt_tokens"] > 16 * 400
    else:
        assert_error(status, reply, 400, "context")


def test_stream_ends_with_done(stack: Stack) -> None:
    status, _, raw = post(stack, chat("Say something.", stream=True))
    assert status == 200
    events = [line for line in raw.decode().split("\n\n") if line.strip()]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    with_usage = chat("Say something.", stream=True, stream_options={"include_usage": True})
    status, _, raw = post(stack, with_usage)
    bodies = [json.loads(e.removeprefix("data: ")) for e in raw.decode().split("\n\n")[:-2] if e.strip()]
    # OpenAI's shape: usage null on every chunk but the last, which has it and no choices
    assert all(b["usage"] is None and b["choices"] for b in bodies[:-1])
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["completion_tokens"] > 0


def test_still_serving_after_bad_input(stack: Stack) -> None:
    status, reply, _ = post(stack, chat(image(data_url(make_image(50, 40, seed=9)))))
    assert status == 200, reply
    assert reply["choices"][0]["finish_reason"] in ("stop", "length")


def wait_for(stack: Stack, name: str, predicate: Any, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while not predicate(value := stack.metrics().get(name, 0.0)):
        assert time.monotonic() < deadline, f"{name} stayed at {value}"
        time.sleep(0.1)
    return value


def hang_up_after_first_bytes(stack: Stack, body: dict[str, Any]) -> None:
    host, port = stack.base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    if body.get("stream"):
        response = conn.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data: ")  # the stream has begun
    else:
        wait_for(stack, "vlm_decoder_requests_running", lambda v: v >= 1, 10)  # it is generating
    conn.sock.shutdown(2)  # type: ignore[union-attr]
    conn.close()


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_releases_every_stage(stack: Stack, stream: bool) -> None:
    before = stack.metrics().get("vlm_gateway_requests_disconnected_total", 0.0)
    picture = data_url(make_image(120, 120, seed=31 + stream))
    body = chat(image(picture), stream=stream, max_tokens=3000, ignore_eos=True)
    hang_up_after_first_bytes(stack, body)
    hung_up = time.monotonic()
    # Within a second (plus one heartbeat report) the decoder runs nothing and the cache leases nothing.
    wait_for(stack, "vlm_decoder_requests_running", lambda v: v == 0, 1.5)
    wait_for(stack, "vlm_cache_leased_requests", lambda v: v == 0, 1.5)
    assert time.monotonic() - hung_up < 3.0
    wait_for(stack, "vlm_gateway_requests_disconnected_total", lambda v: v > before, 5)
    status, reply, _ = post(stack, chat("Still there?"))
    assert status == 200, reply


def test_metrics_parse_as_prometheus_and_move(stack: Stack) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.metrics import UNDOCUMENTED

    def families() -> dict[str, Any]:
        with urllib.request.urlopen(stack.base_url + "/metrics", timeout=10) as r:
            return {f.name: f for f in text_string_to_metric_families(r.read().decode())}

    def sample(fams: dict[str, Any], name: str, suffix: str = "", **labels: str) -> float:
        return next(s.value for s in fams[name].samples if s.name == name + suffix and s.labels == labels)

    before = families()
    image = [{"type": "image_url", "image_url": {"url": data_url(make_image(90, 70, seed=73101))}}]
    assert post(stack, chat([*image, {"type": "text", "text": "Count the stars."}]))[0] == 200
    after = families()
    for name in (
        "vlm_time_to_first_token_seconds",
        "vlm_inter_token_latency_seconds",
        "vlm_e2e_request_latency_seconds",
    ):
        assert after[name].type == "histogram"
    count = "vlm_time_to_first_token_seconds"
    assert sample(after, count, "_count") == sample(before, count, "_count") + 1
    count = "vlm_request_queue_seconds"
    assert sample(after, count, "_count") == sample(before, count, "_count") + 1
    assert after["vlm_gateway_requests"].type == "counter"
    assert after["vlm_decoder_kv_usage"].type == "gauge"
    assert "vlm_cache_commits" in after and "vlm_decoder_prefix_hit_tokens" in after
    # the vision path's own processes, asked by the gateway: the new image was loaded once and encoded once
    grew = {
        (name, role): sample(after, name, "_total", **{role: "0"}) - sample(before, name, "_total", **{role: "0"})
        for name, role in (("vlm_fetcher_items_loaded", "fetcher"), ("vlm_encoder_images_encoded", "encoder"))
    }
    assert set(grew.values()) == {1.0}, grew
    assert after["vlm_encoder_busy_seconds"].type == "counter"
    assert sample(after, "vlm_fetcher_encoders_live", fetcher="0") == 1
    undocumented = sorted(name for name, family in after.items() if family.documentation in ("", UNDOCUMENTED))
    assert not undocumented, f"families without a HELP line of their own: {undocumented}"


def test_completion_prompt_ids_past_64_bits_are_refused_by_name(stack: Stack) -> None:
    status, body, _ = post(stack, {"prompt": [5, 10**30], "max_tokens": 2}, path="/v1/completions")
    assert_error(status, body, 400, "prompt")
    assert body["error"]["param"] == "prompt.1"


def test_escaped_surrogate_pairs_are_ordinary_text(stack: Stack) -> None:
    body = b'{"messages": [{"role": "user", "content": "smile \\ud83d\\ude00"}], "max_tokens": 2}'
    status, reply, _ = post(stack, body)
    assert status == 200, reply


def test_a_large_inline_image_is_parsed_and_answered(stack: Stack) -> None:
    """Over a MiB of JSON (a noisy 900x700 PNG, inline): parsed in a worker thread, answered as usual."""
    noise = make_image(900, 700, seed=11)
    body = json.dumps(chat(image(data_url(noise)))).encode()
    assert len(body) > 1 << 20
    status, reply, _ = post(stack, body)
    assert status == 200, reply
    assert reply["choices"][0]["finish_reason"] == "length"


def test_every_answer_has_a_request_id_and_a_refusal_is_logged_with_it(stack: Stack, client: Any) -> None:
    fine = client.chat.completions.with_raw_response.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    ours = fine.headers["x-request-id"]
    assert re.fullmatch("[0-9a-f]{32}", ours) and fine.parse().id == f"chatcmpl-{ours}"  # (what workers log)
    streamed = client.chat.completions.with_raw_response.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
    )
    assert re.fullmatch("[0-9a-f]{32}", streamed.headers["x-request-id"])
    request = urllib.request.Request(
        stack.base_url + "/v1/chat/completions",
        json.dumps(chat(image("ftp://nowhere/x.png"))).encode(),
        {"Content-Type": "application/json", "X-Request-Id": "proxy-42"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 400
    rid = refused.value.headers["x-request-id"]
    log = stack.run_dir / "logs" / "gateway.log"
    deadline = time.monotonic() + 10
    while rid not in log.read_text():  # (supervisord copies the process's output into the file)
        assert time.monotonic() < deadline, f"request {rid} is not in {log}"
        time.sleep(0.1)
    line = next(line for line in log.read_text().splitlines() if rid in line)
    assert "400" in line and "X-Request-Id proxy-42" in line and "ftp" in line, line
