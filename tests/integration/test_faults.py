"""``kill -9`` of a worker mid-flight: supervisord restarts it, every request ends, serving continues."""

from __future__ import annotations

import os
import signal
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.integration.conftest import Stack
from tests.media import data_url, make_image

ANSWER_BOUND_S = 90.0


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
        time.sleep(0.5)
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


@pytest.mark.parametrize("program", ["encoder-0", "fetcher-0", "cache", "decoder"])
def test_kill_9_mid_flight(stack: Stack, program: str) -> None:
    """Every request ends (answered or failed with an explained 5xx) within the bound; afterwards no lease
    or reserved slot is left behind, and — unless the cache daemon itself died — an image encoded before
    the kill is still a cache hit."""
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=ANSWER_BOUND_S + 30)
    model = client.models.list().data[0].id
    warm_seed = zlib.crc32(f"warm/{program}".encode()) % 1000 + 20_000
    assert one_request(client, model, warm_seed)[0].startswith("ok:")
    seeds = [zlib.crc32(f"{program}/{i}".encode()) % 10_000 + 1000 for i in range(12)]
    victim = stack.pid(program)
    outcomes, killed_at = requests_through_a_kill(client, model, victim, seeds)
    assert all(elapsed < ANSWER_BOUND_S for _, elapsed, _ in outcomes), outcomes
    assert any(end > killed_at for _, _, end in outcomes), "no request was in flight at the kill"
    wait_restarted(stack, program, victim)
    # The stack serves again: a new image end to end.
    outcome, _, _ = one_request(client, model, seed=zlib.crc32(program.encode()) % 1000)
    assert outcome.startswith("ok:"), outcome
    settled = cache_gauges_settle(stack)
    assert settled["vlm_cache_leased_requests"] == 0 and settled["vlm_cache_pending_entries"] == 0, settled
    if program != "cache":  # the daemon's pool is the cache: only its own death loses it
        hits = settled.get("vlm_cache_hits_total", 0.0)
        assert one_request(client, model, warm_seed)[0].startswith("ok:")
        assert stack.metrics().get("vlm_cache_hits_total", 0.0) == hits + 1
