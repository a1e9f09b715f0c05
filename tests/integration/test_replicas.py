"""Two data-parallel decoder replicas through the whole stack: text-only requests may go to either,
requests with images only to replica 1 (``media_replicas = [1]``). Each answers as transformers does, the
gateway spreads concurrent requests by load, keeps a conversation on one replica, and a replica that dies
costs only its own requests: the other goes on serving, and supervisord brings the dead one back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from benchmarks.gateway_load import StandInDecoder, free_port
from benchmarks.hf_chat import HfChat
from common.config import load_config
from gateway.prompt import PromptBuilder
from gateway.replicas import prefix_affinity
from gateway.schema import ChatMessage
from tests.integration.conftest import REPO, Stack, serve
from tests.integration.test_chat_parity import NEW_TOKENS, ask, check_parity, image_part
from tests.integration.test_faults import ANSWER_BOUND_S, one_request, requests_through_a_kill, wait_restarted
from tests.media import data_url, make_image

FINISHED = 'vlm_decoder_requests_finished_total{replica="%d"}'
FALLBACKS = 'vlm_gateway_replica_fallback_requests_total{replica="%d"}'
ROUTED = 'vlm_gateway_replica_requests_routed_total{replica="%d"}'
REISSUED = 'vlm_gateway_replica_reissued_requests_total{replica="%d"}'


@pytest.fixture(scope="module")
def dp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from serve(tmp_path_factory, "dp2", "[decoder]\nreplicas = 2\nmedia_replicas = [1]\n")


def finished(stack: Stack, at_least: float = 0.0, timeout_s: float = 10.0) -> tuple[float, float]:
    """Each replica's finished requests, once they add up to ``at_least`` (the decoders report their
    counters with each heartbeat, so /metrics may lag an answer by one)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = stack.metrics()
        counts = metrics.get(FINISHED % 0, 0.0), metrics.get(FINISHED % 1, 0.0)
        if sum(counts) >= at_least or time.monotonic() > deadline:
            return counts
        time.sleep(0.1)


def routed(stack: Stack) -> tuple[float, float]:
    """The requests the gateway has sent to each replica (counted as it sends them: no lag)."""
    metrics = stack.metrics()
    return metrics.get(ROUTED % 0, 0.0), metrics.get(ROUTED % 1, 0.0)


def opening_for_each_replica(stack: Stack) -> dict[int, str]:
    """A long opening (> 256 tokens) of a conversation for each of two replicas, that the gateway sends
    there while the loads are equal (it prefers the replica a prompt's opening names)."""
    prompts = PromptBuilder(load_config(stack.config_path).model_path())
    openings: dict[int, str] = {}
    for k in range(64):
        opening = f"Conversation {k} opens at length. " + "The next turns repeat this opening. " * 40
        user = [ChatMessage(role="user", content=opening)]
        openings.setdefault(prefix_affinity(prompts.build(user).token_ids, []) % 2, opening)
        if len(openings) == 2:
            return openings
    raise AssertionError("64 openings, all preferring one replica")


def test_each_replica_answers_like_transformers_and_images_go_to_theirs(dp2: Stack) -> None:
    assert dp2.pid("decoder") > 0 and dp2.pid("decoder-1") > 0
    # /health answers 200 once every kind of request has a live replica (here: once replica 1 is), so
    # replica 0 may still be loading then; both must report live soon after.
    deadline = time.monotonic() + 60
    while True:
        status, body = dp2.get_json("/health")
        if body.get("decoders") == {"decoder": True, "decoder-1": True} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status == 200 and body["decoders"] == {"decoder": True, "decoder-1": True}, body
    client = OpenAI(base_url=dp2.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    hf = HfChat(load_config(dp2.config_path).model_path())
    before = finished(dp2)
    for replica, opening in sorted(opening_for_each_replica(dp2).items()):  # each answers as transformers does
        check_parity(client, hf, [{"role": "user", "content": opening + " Write a haiku about it."}])
        after_text = finished(dp2, sum(before) + 1)
        assert after_text[replica] == before[replica] + 1 and sum(after_text) == sum(before) + 1, after_text
        before = after_text
    pictures = [
        image_part(data_url(make_image(200, 60, seed=32))),
        {"type": "text", "text": "Compare this one"},
        image_part(data_url(make_image(64, 256, seed=33))),
        {"type": "text", "text": "with that one."},
    ]
    check_parity(client, hf, [{"role": "user", "content": pictures}])
    model = client.models.list().data[0].id
    assert [one_request(client, model, seed)[0] for seed in (40, 41, 42)] == ["ok:length"] * 3
    after_image = finished(dp2, sum(after_text) + 4)
    assert after_image[0] == after_text[0] and after_image[1] == after_text[1] + 4, (after_text, after_image)
    metrics = dp2.metrics()  # the gateway's side of it: where it sent them, none left in flight
    for replica in (0, 1):
        assert metrics[f'vlm_gateway_replica_requests_routed_total{{replica="{replica}"}}'] == after_image[replica]
        assert metrics[f'vlm_gateway_replica_requests_in_flight{{replica="{replica}"}}'] == 0


def test_concurrent_requests_spread_and_a_conversation_stays(dp2: Stack) -> None:
    client = OpenAI(base_url=dp2.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    def ask(prompt: str) -> None:
        client.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0, model=model
        )

    before = finished(dp2)
    with ThreadPoolExecutor(8) as pool:  # the least loaded replica takes each: neither can take them all
        list(pool.map(ask, [f"Tell me fact {k} about owls." for k in range(8)]))
    spread = finished(dp2, sum(before) + 8)
    assert spread[0] > before[0] and spread[1] > before[1], (before, spread)
    # Two conversations whose openings prefer different replicas: each stays on its own (one request at a
    # time, so the loads are equal; without the preference both would go to one replica).
    counts = spread
    for replica, opening in sorted(opening_for_each_replica(dp2).items()):
        for turn in range(3):
            ask(opening + f" Question {turn}?")
        after = finished(dp2, sum(counts) + 3)
        grew = [after[r] - counts[r] for r in (0, 1)]
        assert grew[replica] == 3 and grew[1 - replica] == 0, (replica, grew)
        counts = after


def test_losing_a_replica_costs_only_its_requests(dp2: Stack) -> None:
    """kill -9 of replica 1 mid-flight: its image requests end with an answer (every one sent again) or an
    explained 5xx within the bound, and supervisord restarts it. Then replica 1 stopped: /health lists it
    down, text goes to replica 0 alone and is answered, and so is an image request (``kind_fallback``:
    replica 0 takes images while no replica for them is live); started again, images go to replica 1 again."""
    client = OpenAI(base_url=dp2.base_url + "/v1", api_key="unused", max_retries=0, timeout=ANSWER_BOUND_S + 30)
    model = client.models.list().data[0].id
    victim = dp2.pid("decoder-1")
    reissued = dp2.metrics().get(REISSUED % 1, 0.0)
    outcomes, _ = requests_through_a_kill(client, model, victim, [500 + i for i in range(4)])
    assert all(elapsed < ANSWER_BOUND_S for _, elapsed, _ in outcomes), outcomes
    # Those that no token had come for when it died were sent again, and answered (which ones had is timing).
    reissued = dp2.metrics().get(REISSUED % 1, 0.0) - reissued
    assert sum(outcome.startswith("ok:") for outcome, _, _ in outcomes) >= reissued, (outcomes, reissued)
    wait_restarted(dp2, "decoder-1", victim, timeout_s=120)

    dp2.ctl("stop", "decoder-1")
    deadline = time.monotonic() + 30
    while (health := dp2.get_json("/health"))[1]["decoders"]["decoder-1"] and time.monotonic() < deadline:
        time.sleep(0.2)
    status, body = health
    assert status == 200 and body["decoders"] == {"decoder": True, "decoder-1": False}, health
    for k in range(6):  # without the liveness check some of these would go to replica 1 (affinity, equal loads)
        reply = client.chat.completions.create(
            messages=[{"role": "user", "content": f"Still there, number {k}?"}],
            max_tokens=8,
            temperature=0,
            model=model,
        )
        assert reply.choices[0].finish_reason == "length"
    before = routed(dp2)
    fallbacks = dp2.metrics().get(FALLBACKS % 0, 0.0)  # (the kill's re-issued requests may have gone there too)
    outcome, _, _ = one_request(client, model, seed=778)
    assert outcome.startswith("ok:"), outcome
    assert routed(dp2) == (before[0] + 1, before[1]), before  # the image request, on replica 0
    assert dp2.metrics()[FALLBACKS % 0] == fallbacks + 1
    dp2.ctl("start", "decoder-1")
    dp2.wait_healthy()
    deadline = time.monotonic() + 30
    while not dp2.get_json("/health")[1]["decoders"]["decoder-1"]:
        assert time.monotonic() < deadline, "replica 1 is not back"
        time.sleep(0.2)
    before = routed(dp2)
    outcome, _, _ = one_request(client, model, seed=777)
    assert outcome.startswith("ok:"), outcome
    assert routed(dp2) == (before[0], before[1] + 1), before  # images on replica 1 again
    assert dp2.metrics()[FALLBACKS % 0] == fallbacks + 1


def test_a_stalled_replicas_requests_are_sent_again(dp2: Stack) -> None:
    """Replica 1 stopped (SIGSTOP: its socket still takes requests, it answers nothing): a text request and
    the image requests sent to it meanwhile go again to replica 0 once replica 1 has been silent for
    ``dead_after_s``, and are answered as transformers answers them; none fails. Resumed, replica 1 runs none
    of them (each was aborted there) and takes images again."""
    client = OpenAI(base_url=dp2.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    hf = HfChat(load_config(dp2.config_path).model_path())
    question = {"type": "text", "text": "What is in this picture?"}
    conversations = [
        [{"role": "user", "content": [image_part(data_url(make_image(96 + 16 * k, 64, seed=60 + k))), question]}]
        for k in range(3)
    ]
    before_routed, before_finished = routed(dp2), finished(dp2)
    before_reissued = [dp2.metrics().get(REISSUED % r, 0.0) for r in (0, 1)]
    before_lost = dp2.metrics()["vlm_gateway_replicas_lost_total"]
    # A text request too, whose opening prefers replica 1 (sent first: the loads are equal then).
    conversations.insert(0, [{"role": "user", "content": opening_for_each_replica(dp2)[1] + " Go on."}])
    victim = dp2.pid("decoder-1")
    os.kill(victim, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(len(conversations)) as pool:
            futures = [pool.submit(ask, client, conversations[0])]
            deadline = time.monotonic() + 10
            while routed(dp2)[1] == before_routed[1]:
                assert time.monotonic() < deadline, "the text request did not go to replica 1"
                time.sleep(0.05)
            futures += [pool.submit(ask, client, messages) for messages in conversations[1:]]
            responses = [f.result() for f in futures]
    finally:
        os.kill(victim, signal.SIGCONT)
    metrics = dp2.metrics()
    # Each request sent to replica 1 (all four, unless this machine took dead_after_s to send the images: then
    # those went straight to replica 0) was sent again, to replica 0, which answered all four.
    at_1 = routed(dp2)[1] - before_routed[1]
    assert 1 <= at_1 <= 4 and routed(dp2)[0] == before_routed[0] + 4, (before_routed, routed(dp2))
    assert [metrics[REISSUED % r] - before_reissued[r] for r in (0, 1)] == [0, at_1], (before_reissued, metrics)
    assert metrics["vlm_gateway_replicas_lost_total"] == before_lost + 1  # (once, however many ticks found it)
    for response, messages in zip(responses, conversations, strict=True):
        assert response.choices[0].token_ids == hf.generate(messages, NEW_TOKENS)[0]
    deadline = time.monotonic() + 30
    while not dp2.get_json("/health")[1]["decoders"]["decoder-1"]:
        assert time.monotonic() < deadline, "replica 1 is not live again after SIGCONT"
        time.sleep(0.2)
    outcome, _, _ = one_request(client, client.models.list().data[0].id, seed=61)
    assert outcome == "ok:length", outcome
    # Replica 1 finished the one request above and none of those it held when it stopped.
    after = finished(dp2, sum(before_finished) + 5)
    assert after == (before_finished[0] + 4, before_finished[1] + 1), (before_finished, after)


@pytest.fixture  # (one test's: it stops after it, not beside dp2 until the module's end)
def dp2tp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from serve(tmp_path_factory, "dp2tp2", "[decoder]\nreplicas = 2\ntensor_parallel = 2\ntp_timeout_s = 30.0\n")


def test_replicas_of_two_tensor_parallel_ranks_each(dp2tp2: Stack) -> None:
    """replicas = 2 with tensor_parallel = 2: four decoder processes, two gloo groups that never meet; each
    replica answers as transformers does."""
    assert all(dp2tp2.pid(p) > 0 for p in ("decoder", "decoder-rank-1", "decoder-1", "decoder-1-rank-1"))
    client = OpenAI(base_url=dp2tp2.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    hf = HfChat(load_config(dp2tp2.config_path).model_path())
    for replica, opening in sorted(opening_for_each_replica(dp2tp2).items()):
        before = finished(dp2tp2)
        check_parity(client, hf, [{"role": "user", "content": opening + " Write a haiku about it."}])
        after = finished(dp2tp2, sum(before) + 1)
        assert after[replica] == before[replica] + 1, (replica, before, after)


def test_a_replica_that_never_starts_is_reported_not_waited_for(tmp_path: Path) -> None:
    """The gateway with a stand-in for replica 0 only (replica 1, the one for images, never runs, as under
    a static ops/vlm.conf) and no ``kind_fallback``: text is answered; once the start-up grace
    (request_timeout_s) has passed, an image request is refused at once with a 503 that says so, instead of
    waiting to time out."""
    port = free_port()
    config = tmp_path / "vlm.toml"
    config.write_text(
        f'run_dir = "{tmp_path / "run"}"\n[server]\nport = {port}\nrequest_timeout_s = 3.0\n'
        "[decoder]\nreplicas = 2\nmedia_replicas = [1]\nkind_fallback = false\n"
    )
    cfg = load_config(config, env={})
    cfg.run_path.mkdir()
    decoder = StandInDecoder((cfg.decoder_endpoint(0), cfg.endpoint("gateway")), 0.01, cfg.liveness.heartbeat_s)
    decoder.thread.start()
    env = {**os.environ, "VLM_CONFIG": str(config)}
    gateway = subprocess.Popen([sys.executable, "-m", "gateway"], env=env, cwd=REPO)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
        deadline = time.monotonic() + 60
        while True:  # up: answering (its health stays 503: no replica for images, no fetcher)
            try:
                model = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline and gateway.poll() is None, "the gateway did not come up"
                time.sleep(0.2)
        reply = client.chat.completions.create(
            messages=[{"role": "user", "content": "Hello?"}], max_tokens=3, model=model
        )
        assert reply.choices[0].finish_reason == "length"
        time.sleep(cfg.server.request_timeout_s + 0.5)
        picture = [image_part(data_url(make_image(32, 32, seed=9))), {"type": "text", "text": "What is it?"}]
        started = time.monotonic()
        try:
            client.chat.completions.create(messages=[{"role": "user", "content": picture}], max_tokens=3, model=model)
            raise AssertionError("an image request was taken for a replica that never started")
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and exc.response.headers.get("retry-after") == "1", exc
            assert "decoder replica 1 has not started in the 3 s" in str(exc.body), exc.body
        assert time.monotonic() - started < 2.0  # at once, not at the request's time-out (3 s)
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
        decoder.stop.set()
        decoder.thread.join(timeout=10)


def test_the_choices_of_one_request_share_a_replica(dp2: Stack) -> None:
    """n = 4: one replica computes the shared prompt once for all four (by load alone, the third and fourth
    would go to the other replica)."""
    client = OpenAI(base_url=dp2.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    routed = 'vlm_gateway_replica_requests_routed_total{replica="%d"}'
    before = [dp2.metrics()[routed % r] for r in (0, 1)]
    reply = client.chat.completions.create(
        messages=[{"role": "user", "content": "Four takes on a haiku, please."}], n=4, max_tokens=8, model=model
    )
    assert len(reply.choices) == 4
    grew = sorted(dp2.metrics()[routed % r] - before[r] for r in (0, 1))
    assert grew == [0, 4], grew
