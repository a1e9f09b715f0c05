"""``kill -9`` of a worker mid-flight: supervisord restarts it, every request ends, serving continues."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from openai import OpenAI

from benchmarks.hf_chat import HfChat
from common.config import load_config
from tests.integration.conftest import Stack, serve
from tests.integration.test_chat_parity import NEW_TOKENS, ask, image_part
from tests.media import data_url, make_image

ANSWER_BOUND_S = 90.0
KILL_TOKENS = 16
# Enough tokens that the stream is still going when the gateway is frozen after its first chunk.
STALL_TOKENS = 512


def one_request(client: OpenAI, model: str, seed: int) -> tuple[str, float, float]:
    """(outcome, seconds taken, monotonic end time)."""
    started = time.monotonic()
    picture = data_url(make_image(320 + seed % 7 * 16, 240, seed=seed))
    try:
        response = client.chat.completions.create(
            model=model,
            max_tokens=16,
            temperature=0,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": picture}},
                        {"type": "text", "text": "Describe it."},
                    ],
                }
            ],
        )
        outcome = f"ok:{response.choices[0].finish_reason}"
    except openai.APIStatusError as exc:
        body: Any = exc.body
        assert exc.status_code in (500, 502, 503, 504), exc
        assert isinstance(body, dict) and body.get("message"), body  # a clean, explained error
        outcome = f"error:{exc.status_code}"
    return outcome, time.monotonic() - started, time.monotonic()


def requests_through_a_kill(
    client: OpenAI, model: str, victim: int, seeds: list[int]
) -> tuple[list[tuple[str, float, float]], float]:
    """An image request per seed, all at once, and ``kill -9`` of ``victim`` 0.3 s in: each request's
    ``one_request`` outcome, and the monotonic time of the kill."""
    with ThreadPoolExecutor(len(seeds)) as pool:
        futures = [pool.submit(one_request, client, model, s) for s in seeds]
        time.sleep(0.3)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        return [f.result(timeout=ANSWER_BOUND_S + 60) for f in futures], killed_at


def wait_restarted(stack: Stack, program: str, old_pid: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if stack.pid(program) not in (0, old_pid) and stack.get_json("/health")[0] == 200:
                return
        except ValueError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{program} was not restarted by supervisord within {timeout_s}s")


def cache_gauges_settle(stack: Stack, timeout_s: float = 30.0) -> dict[str, float]:
    """The cache daemon's gauges once no request holds a lease and no slot waits for an encoder."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = stack.metrics()
        held = metrics.get("vlm_cache_leased_requests", -1), metrics.get("vlm_cache_pending_entries", -1)
        if held == (0, 0) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.2)


def test_health_says_when_no_encoder_is_live(stack: Stack) -> None:
    # (it said "ok" with the encoder down, while requests with images waited a minute for one)
    stack.ctl("stop", "encoder:encoder-0")
    try:
        deadline = time.monotonic() + 20
        while (reply := stack.get_json("/health"))[0] != 503:
            assert time.monotonic() < deadline, reply
            time.sleep(0.2)  # the fetcher calls it dead after dead_after_s, and says so at its next heartbeat
        assert reply[1]["encoders"] == 0 and reply[1]["status"] == "degraded"
    finally:
        stack.ctl("start", "encoder:encoder-0")
    wait_restarted(stack, "encoder-0", 0)
    assert stack.get_json("/health")[1]["encoders"] == 1


def test_with_every_encoder_down_past_the_hold_image_requests_fail_at_once(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # (each waited encode_timeout_s for an encoder before, a minute by default, while a crash loop went on)
    running = serve(tmp_path_factory, "no-encoder", "[liveness]\nhold_lost_requests_s = 1.0\n")
    stack = next(running)
    try:
        client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        stack.ctl("stop", "encoder:encoder-0")
        deadline = time.monotonic() + 20
        while stack.get_json("/health")[0] != 503:  # the fetcher has called it dead
            assert time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(1.5)  # past the hold
        picture = {"type": "image_url", "image_url": {"url": data_url(make_image(64, 48, seed=31_337))}}
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as failed:
            client.chat.completions.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [picture]}])
        assert time.monotonic() - started < 10  # the fixture's encode_timeout_s is 30
        assert failed.value.status_code == 503, failed.value
        assert "vision encoder unavailable: no worker has been live" in failed.value.message, failed.value.message
        stack.ctl("start", "encoder:encoder-0")
        wait_restarted(stack, "encoder-0", 0)
        assert one_request(client, model, seed=31_338)[0].startswith("ok:")
    finally:
        next(running, None)


@dataclass
class Streamed:
    """One streamed image request: the token ids received (in chunk order), its usage, and how it ended."""

    seed: int
    token_ids: list[int] = field(default_factory=list)
    completion_tokens: int = -1
    error: str = ""  # "" when it completed
    ended: float = 0.0  # monotonic


def stream_one(client: OpenAI, model: str, seed: int) -> Streamed:
    """An image request, streamed with its token ids and usage (``KILL_TOKENS`` greedy tokens)."""
    picture = data_url(make_image(320 + seed % 7 * 16, 240, seed=seed))
    result = Streamed(seed)
    try:
        stream = client.chat.completions.create(
            model=model,
            max_tokens=KILL_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"min_tokens": KILL_TOKENS, "return_token_ids": True},
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": picture}},
                        {"type": "text", "text": "Describe it."},
                    ],
                }
            ],
        )
        for chunk in stream:
            for choice in chunk.choices:
                result.token_ids += getattr(choice, "token_ids", None) or []
            if chunk.usage is not None:
                result.completion_tokens = chunk.usage.completion_tokens
    except openai.APIError as exc:  # (an explained error: before the first token a status, after it in-band)
        result.error = f"{getattr(exc, 'status_code', 'in-band')}: {exc.message}"
    result.ended = time.monotonic()
    return result


def stream_all(client: OpenAI, model: str, seeds: list[int], victim: int | None = None) -> tuple[list[Streamed], float]:
    """``stream_one`` for every seed at once, and (``victim``) its ``kill -9`` 0.3 s in: the results and the
    monotonic time of the kill."""
    with ThreadPoolExecutor(len(seeds)) as pool:
        futures = [pool.submit(stream_one, client, model, s) for s in seeds]
        killed_at = time.monotonic()
        if victim is not None:
            time.sleep(0.3)
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
        return [f.result(timeout=ANSWER_BOUND_S + 60) for f in futures], killed_at


@pytest.mark.parametrize("program", ["encoder-0", "fetcher-0", "cache", "decoder"])
def test_kill_9_mid_flight(stack: Stack, program: str) -> None:
    """``kill -9`` of one process under streamed image load. The fetcher's, the cache daemon's or an encoder's
    death fails no request: each gets the same greedy tokens as the same request on the undisturbed stack
    afterwards, with no chunk twice and its usage equal to the tokens received. A decoder's death fails only
    requests that had streamed tokens. Afterwards no lease or reserved slot is left behind, and — unless the
    cache daemon itself died — an image encoded before the kill is still a cache hit."""
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=ANSWER_BOUND_S + 30)
    model = client.models.list().data[0].id
    warm_seed = zlib.crc32(f"warm/{program}".encode()) % 1000 + 20_000
    assert one_request(client, model, warm_seed)[0].startswith("ok:")
    seeds = [zlib.crc32(f"{program}/{i}".encode()) % 10_000 + 1000 for i in range(12)]
    victim = stack.pid(program)
    started = time.monotonic()
    through, killed_at = stream_all(client, model, seeds, victim)
    assert all(r.ended - started < ANSWER_BOUND_S for r in through), through
    assert any(r.ended > killed_at for r in through), "no request was in flight at the kill"
    wait_restarted(stack, program, victim)
    reference, _ = stream_all(client, model, seeds)  # (undisturbed: the same images, cache hits or encoded again)
    assert not [r for r in reference if r.error], reference
    for got, want in zip(through, reference, strict=True):
        if got.error:
            assert program == "decoder" and got.token_ids, (program, got)  # (only a decoder loses streamed work)
            continue
        assert got.token_ids == want.token_ids, (program, got, want)  # (a chunk twice would show here)
        assert got.completion_tokens == len(got.token_ids) == KILL_TOKENS, got
    # The stack serves again: a new image end to end.
    outcome, _, _ = one_request(client, model, seed=zlib.crc32(program.encode()) % 1000)
    assert outcome.startswith("ok:"), outcome
    settled = cache_gauges_settle(stack)
    cache = {k: v for k, v in settled.items() if k.startswith("vlm_cache")}
    assert settled["vlm_cache_leased_requests"] == 0 and settled["vlm_cache_pending_entries"] == 0, cache
    if program != "cache":  # the daemon's pool is the cache: only its own death loses it
        hits = settled.get("vlm_cache_hits_total", 0.0)
        assert one_request(client, model, warm_seed)[0].startswith("ok:")
        assert stack.metrics().get("vlm_cache_hits_total", 0.0) == hits + 1


def test_a_fetcher_killed_before_its_encodes_ran_fails_nothing(stack: Stack) -> None:
    """Image requests handed to the decoder while the only encoder is frozen (SIGSTOP), then ``kill -9`` of their
    fetcher: the slots it reserved are never filled by it. Its restarted incarnation says so to the cache daemon
    (`FetcherStarted`), which fails them at once; the decoder's requests come back to the gateway as
    ``media_unavailable`` and are fetched and encoded again. Every request gets the greedy tokens it gets on the
    undisturbed stack, well before ``[cache] pending_ttl_s`` would have freed those slots."""
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=ANSWER_BOUND_S + 30)
    model = client.models.list().data[0].id
    seeds = [zlib.crc32(f"orphans/{i}".encode()) % 10_000 + 40_000 for i in range(6)]
    reissued = stack.metrics().get("vlm_gateway_requests_reissued_total", 0.0)
    encoder, fetcher = stack.pid("encoder-0"), stack.pid("fetcher-0")
    os.kill(encoder, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(len(seeds)) as pool:
            futures = [pool.submit(stream_one, client, model, s) for s in seeds]
            deadline = time.monotonic() + 30
            while stack.metrics().get("vlm_decoder_requests_waiting_for_media", 0.0) < len(seeds):
                assert time.monotonic() < deadline, "the fetcher handed fewer requests to the decoder than were sent"
                time.sleep(0.1)
            os.kill(fetcher, signal.SIGKILL)
            started = time.monotonic()
            while stack.pid("fetcher-0") in (0, fetcher):
                assert time.monotonic() < deadline + 30, "fetcher-0 was not restarted"
                time.sleep(0.2)
            time.sleep(2.0)  # (its `FetcherStarted` reaches the daemon while the encoder is still frozen)
            os.kill(encoder, signal.SIGCONT)
            through = [f.result(timeout=ANSWER_BOUND_S) for f in futures]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(encoder, signal.SIGCONT)
    pending_ttl_s = load_config(stack.config_path).cache.pending_ttl_s
    assert max(r.ended for r in through) - started < pending_ttl_s, through
    reference, _ = stream_all(client, model, seeds)
    for got, want in zip(through, reference, strict=True):
        assert not got.error and not want.error, (got, want)
        assert got.token_ids == want.token_ids and got.completion_tokens == len(got.token_ids), (got, want)
    assert stack.metrics()["vlm_gateway_requests_reissued_total"] >= reissued + 1
    settled = cache_gauges_settle(stack)
    cache = {k: v for k, v in settled.items() if k.startswith("vlm_cache")}
    assert settled["vlm_cache_leased_requests"] == 0 and settled["vlm_cache_pending_entries"] == 0, cache


def test_a_lone_decoder_lost_before_the_first_token_answers_after_its_restart(stack: Stack, hf: HfChat) -> None:
    """The only decoder frozen (SIGSTOP: its socket takes requests, it answers nothing): a text request and
    two image requests sent meanwhile are held by the gateway once it is called dead (``dead_after_s``), not
    failed; killed then, the decoder is restarted by supervisord, and each held request is answered by the new
    process exactly as transformers answers it (``hold_lost_requests_s``, 30 s by default)."""
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=ANSWER_BOUND_S)
    question = {"type": "text", "text": "What is in this picture?"}
    conversations: list[list[dict[str, Any]]] = [[{"role": "user", "content": "Count to five, slowly."}]]
    conversations += [
        [{"role": "user", "content": [image_part(data_url(make_image(80 + 16 * k, 64, seed=90 + k))), question]}]
        for k in range(2)
    ]
    reissued = stack.metrics().get("vlm_gateway_requests_reissued_total", 0.0)
    victim = stack.pid("decoder")
    os.kill(victim, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(len(conversations)) as pool:
            futures = [pool.submit(ask, client, messages) for messages in conversations]
            deadline = time.monotonic() + 30
            while stack.metrics().get("vlm_gateway_requests_held", 0.0) < len(conversations):
                assert time.monotonic() < deadline, "the gateway held fewer requests than were sent"
                assert not any(f.done() for f in futures), [f.exception() for f in futures if f.done()]
                time.sleep(0.1)
            os.kill(victim, signal.SIGKILL)
            responses = [f.result() for f in futures]
    finally:
        with contextlib.suppress(ProcessLookupError):  # (gone once killed; a failed assertion must not leave it frozen)
            os.kill(victim, signal.SIGCONT)
    wait_restarted(stack, "decoder", victim)
    for response, messages in zip(responses, conversations, strict=True):
        assert response.choices[0].token_ids == hf.generate(messages, NEW_TOKENS)[0]
    metrics = stack.metrics()
    assert metrics["vlm_gateway_requests_reissued_total"] == reissued + len(conversations), metrics
    assert metrics["vlm_gateway_requests_held"] == 0


def test_a_gateway_stalled_past_dead_after_s_keeps_its_live_decoder(stack: Stack) -> None:
    """The gateway's own process frozen (SIGSTOP) for longer than ``dead_after_s`` while a stream is mid-answer,
    the decoder and fetcher alive and heartbeating all along: once it runs again, the stream goes on to its end
    with the tokens an undisturbed run gives, and no decoder replica or fetcher is taken for dead (the time the
    gateway could not read their heartbeats is not theirs: `common.liveness.LivenessClock`)."""
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=ANSWER_BOUND_S)
    model = client.models.list().data[0].id
    liveness = load_config(stack.config_path).liveness
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
    request = {"model": model, "messages": messages, "max_tokens": STALL_TOKENS, "temperature": 0}
    before = stack.metrics()
    log = stack.run_dir / "logs" / "gateway.log"
    logged = log.stat().st_size
    gateway = stack.pid("gateway")
    pieces: list[str] = []
    stream = client.chat.completions.create(**request, stream=True, extra_body={"min_tokens": STALL_TOKENS})
    chunks = iter(stream)
    pieces.append(next(chunks).choices[0].delta.content or "")  # (mid-answer: the stream has begun)
    os.kill(gateway, signal.SIGSTOP)
    try:
        time.sleep(liveness.dead_after_s + 2)
    finally:
        os.kill(gateway, signal.SIGCONT)
    finish = None
    for chunk in chunks:  # (an error event would raise here: "the decoder is not responding")
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    undisturbed = client.chat.completions.create(**request, extra_body={"min_tokens": STALL_TOKENS})
    assert finish == "length" and "".join(pieces) == undisturbed.choices[0].message.content, (pieces, undisturbed)
    after = stack.metrics()
    for moved in ("vlm_gateway_replicas_lost_total", "vlm_gateway_requests_reissued_total"):
        assert after[moved] == before[moved], (moved, before, after)
    with open(log, "rb") as text:
        text.seek(logged)
        since = text.read().decode(errors="replace")
    assert "not responding" not in since and "silent for" not in since, since
    assert stack.pid("gateway") == gateway  # (not restarted: the same process judged, after its stall)


def test_a_fetcher_stalled_past_dead_after_s_keeps_its_live_encoder(stack: Stack) -> None:
    """The fetcher's own process frozen (SIGSTOP) for longer than ``dead_after_s`` with an image request sent
    to it meanwhile, its encoder alive all along: once it runs again, the request is answered as an undisturbed
    run answers it, and the fetcher takes its encoder for dead at no point (it could not ping it nor read its
    answers while frozen: `common.liveness.LivenessClock`, ticked by the fetcher's heartbeat)."""
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=ANSWER_BOUND_S)
    liveness = load_config(stack.config_path).liveness
    picture = image_part(data_url(make_image(96, 80, seed=4242)))
    messages: list[dict[str, Any]] = [{"role": "user", "content": [picture, {"type": "text", "text": "What is it?"}]}]
    log = stack.run_dir / "logs" / "fetcher-0.log"
    logged = log.stat().st_size
    fetcher = stack.pid("fetcher-0")
    os.kill(fetcher, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(ask, client, messages)  # (it waits in the frozen fetcher's socket)
            time.sleep(liveness.dead_after_s + 2)
            assert not answer.done(), answer.exception()
            os.kill(fetcher, signal.SIGCONT)
            stalled = answer.result(timeout=ANSWER_BOUND_S)
    finally:
        with contextlib.suppress(ProcessLookupError):  # (a failed assertion must not leave it frozen)
            os.kill(fetcher, signal.SIGCONT)
    undisturbed = ask(client, messages)
    assert stalled.choices[0].finish_reason == "length", stalled
    assert stalled.choices[0].token_ids == undisturbed.choices[0].token_ids, (stalled, undisturbed)
    with open(log, "rb") as text:
        text.seek(logged)
        since = text.read().decode(errors="replace")
    assert "silent for" not in since, since
    assert stack.pid("fetcher-0") == fetcher  # (not restarted: the same process judged, after its stall)


def test_every_process_watches_its_own_loop(stack: Stack) -> None:
    """Each serving process arms the stall watchdog (`common.lifecycle.StallWatchdog`, tested on a real loop in
    tests/unit/test_stall_watchdog.py): a hung one ends itself for supervisord to restart."""
    limit = load_config(stack.config_path).liveness.stall_exit_s
    logs = {path.stem: path.read_text() for path in (stack.run_dir / "logs").glob("*.log")}
    announced = f"every thread's stack logged) if its loop stalls for {limit:g} s"
    for program in ("gateway", "fetcher-0", "encoder-0", "cache", "decoder"):
        assert announced in logs.get(program, ""), (program, sorted(logs))
