"""Units on separate hosts (issue 31's acceptance, on this machine): network namespaces over veth stand for hosts
(`tests.netns`). The pd unit runs in A; encoder units in B, C and later D, each alone in its namespace, bound on
tcp:// under CurveZMQ. A finds them by the name ``vlm-encoders`` in its own /etc/hosts, as a pod finds a headless
Service's pods. Greedy answers (text, images, a video, three turns, streamed) equal the one-host stack's; strangers
get nothing; an encoder added to the name is used and one removed is drained, with no restart; under load, an
encoder killed, a link down and a lossy, slow network (`tests.netem`) fail no request. Skipped without root or
iproute2."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
import zmq.auth
from openai import OpenAI

from benchmarks.media import data_url as media_url
from benchmarks.media import jpeg_bytes, mjpeg_avi, video_frames
from common.config import Config, load_config
from common.protocol import (
    CacheAcquire,
    CacheAcquireResult,
    CacheRelease,
    MediaInput,
    StatsRequest,
    StatsResult,
    encode,
)
from common.tensor_ref import ShmAttachments, read_tensor
from common.transport import Transport
from tests.integration.conftest import REPO, STOPPING, Stack, stack_config, wait_listening
from tests.media import data_url, make_image
from tests.netem import available as netem_available
from tests.netns import Host, Network, available
from workers.fetcher.image import ImageProcessorSpec
from workers.fetcher.media import load_media
from workers.fetcher.video import VideoProcessorSpec

pytestmark = pytest.mark.skipif(bool(available()), reason=available() or "namespaces are available")

PORT = 7100  # every encoder unit's, each on its own host
NAME = "vlm-encoders"


@dataclass
class Units:
    network: Network
    pd: Stack
    encoders: dict[str, Stack]  # host label -> its unit (no gateway: its supervisord and config)
    keys: Path
    start_unit: Callable[[str], None]

    def name_encoders(self, *labels: str) -> None:
        """A's /etc/hosts: ``vlm-encoders`` is these hosts."""
        self.network.hosts["a"].hosts({NAME: [self.network.hosts[label].address for label in labels]})

    def label(self, host: str) -> str:
        return f"0@{self.network.hosts[host].address}:{PORT}"


def start(host: Host, config: Path, name: str) -> subprocess.Popen[bytes]:
    (REPO / "run").mkdir(exist_ok=True)
    with open(REPO / "run" / f"serve-{name}.log", "wb") as log:
        env = {**os.environ, "VLM_CONFIG": str(config)}
        return subprocess.Popen(host.exec_argv(str(REPO / "ops/serve")), env=env, stdout=log, stderr=log)


@pytest.fixture(scope="module")
def units(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Units]:
    keys = tmp_path_factory.mktemp("netns-keys")
    subprocess.run([sys.executable, "-m", "ops.cli", "keys", "--dir", str(keys)], check=True, capture_output=True)
    shared = f'[security]\nkeys_dir = "{keys}"\n[encoder]\ncount = 1\nresolve_every_s = 1.0\n'
    with Network() as network:
        a = network.add("a")
        for label in "bcd":
            network.add(label)
        encoders: dict[str, Stack] = {}

        def start_encoder_unit(label: str) -> None:
            host = network.hosts[label]
            endpoints = f'[endpoints]\n"encoder.0" = "tcp://0.0.0.0:{PORT}"\n'
            server = 'role = "encoder"\n'
            config = stack_config(
                tmp_path_factory.mktemp(f"unit-{label}"), STOPPING.free_port(), shared + endpoints, server
            )
            encoders[label] = Stack("", config, start(host, config, f"netns-{label}"))
            wait_listening(host.address, PORT, encoders[label].process)

        try:
            for label in "bc":  # (one after the other: the first makes the demo checkpoint, if none is there)
                start_encoder_unit(label)
            a.hosts({NAME: [network.hosts["b"].address, network.hosts["c"].address]})
            port = STOPPING.free_port()
            endpoints = f'[endpoints]\n"encoder.0" = "tcp://{NAME}:{PORT}"\n'
            server = f'role = "pd"\nhost = "{a.address}"\n'
            config = stack_config(tmp_path_factory.mktemp("unit-a"), port, shared + endpoints, server)
            pd = Stack(f"http://{a.address}:{port}", config, start(a, config, "netns-a"))
            try:
                pd.wait_healthy()
                yield Units(network, pd, encoders, keys, start_encoder_unit)
            finally:
                stop(pd.process, *(unit.process for unit in encoders.values()))
        finally:
            stop(*(unit.process for unit in encoders.values()))


def stop(*processes: subprocess.Popen[bytes]) -> None:
    """SIGTERM to every unit at once (each supervisord stops its programs), then wait for them all."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def ask(stack: Stack, messages: list[dict[str, Any]], stream: bool = False) -> tuple[str, list[float]]:
    """The greedy answer's text and its tokens' logprobs."""
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    args: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": 10, "temperature": 0, "logprobs": True}
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        return choice.message.content or "", [t.logprob for t in choice.logprobs.content]  # type: ignore[union-attr]
    text, logprobs = "", []
    for chunk in client.chat.completions.create(**args, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            logprobs += (
                [t.logprob for t in (chunk.choices[0].logprobs.content or [])] if chunk.choices[0].logprobs else []
            )
    return text, logprobs


def same_answer(ours: tuple[str, list[float]], one_host: tuple[str, list[float]]) -> bool:
    """The same greedy text, and logprobs within float rounding (a prefix cached by one stack and not the other
    computes the prompt in other chunks)."""
    return (
        ours[0] == one_host[0]
        and len(ours[1]) == len(one_host[1])
        and max((abs(x - y) for x, y in zip(ours[1], one_host[1], strict=True)), default=0.0) < 1e-4
    )


def images(*seeds: int) -> list[dict[str, Any]]:
    return [{"type": "image_url", "image_url": {"url": data_url(make_image(120, 96, seed=s))}} for s in seeds]


def encoded(stack: Stack, label: str) -> float:
    return stack.metrics().get(f'vlm_encoder_images_encoded_total{{encoder="{label}"}}', -1.0)


def test_pd_and_encoders_on_other_hosts_answer_as_one_host(units: Units, stack: Stack) -> None:
    first = [{"role": "user", "content": [*images(51, 52, 53), {"type": "text", "text": "Compare them."}]}]
    before = {host: encoded(units.pd, units.label(host)) for host in "bc"}
    assert same_answer(ask(units.pd, first), ask(stack, first))
    assert all(encoded(units.pd, units.label(host)) > before[host] for host in "bc")  # (three jobs: both took some)
    text = [{"role": "user", "content": "Say something about the sea."}]
    assert same_answer(ask(units.pd, text, stream=True), ask(stack, text, stream=True))
    turns = [*first, {"role": "assistant", "content": ask(stack, first)[0]}]
    turns.append({"role": "user", "content": [*images(54), {"type": "text", "text": "And this one?"}]})
    turns += [{"role": "assistant", "content": ask(stack, turns)[0]}, {"role": "user", "content": "Once more."}]
    assert same_answer(ask(units.pd, turns, stream=True), ask(stack, turns, stream=True))
    clip = mjpeg_avi([jpeg_bytes(f) for f in video_frames(160, 112, 16, seed=55)], 160, 112, 8)
    video = {"type": "video_url", "video_url": {"url": media_url(clip, "video/x-msvideo"), "fps": 4}}
    moving = [{"role": "user", "content": [video, {"type": "text", "text": "What happens?"}]}]
    assert same_answer(ask(units.pd, moving), ask(stack, moving))
    media = [*images(51, 52, 53, 54), video]
    digests = embedding_digests(units.pd, media)
    assert len(set(digests)) == len(media)  # (five media, five embeddings: none empty or zeroed alike)
    assert digests == embedding_digests(stack, media)


def embedding_digests(stack: Stack, media: list[dict[str, Any]]) -> list[str]:
    """The SHA-256 of each media part's embedding in ``stack``'s cache: named as its fetcher names it, and read from
    the pool as its decoder reads it (`CacheAcquire`)."""
    cfg = load_config(stack.config_path)
    model = cfg.model_path()
    items = [
        MediaInput("image", part["image_url"]["url"])
        if part["type"] == "image_url"
        else MediaInput("video", part["video_url"]["url"], fps=part["video_url"]["fps"])
        for part in media
    ]
    specs = ImageProcessorSpec.from_dir(model), VideoProcessorSpec.from_dir(model)
    hashes = [load_media(item, *specs, cfg.fetcher, str(model.resolve())).content_hash for item in items]
    transport, attachments = Transport(cfg, "decoder"), ShmAttachments()
    try:
        cache = transport.channel(zmq.DEALER, "cache", bind=False)
        cache.send(CacheAcquire("digests", "digests", hashes))
        assert cache.sock.poll(10_000), "the cache daemon did not answer"
        _, result = cache.recv()
        assert isinstance(result, CacheAcquireResult) and result.status == 200, result
        rows = [read_tensor(ref, attachments).contiguous().view(torch.uint8) for ref in result.refs]
        digests = [hashlib.sha256(part.numpy().tobytes()).hexdigest() for part in rows]
        cache.send(CacheRelease("digests"))
        return digests
    finally:
        transport.close()


def encoder_stats(units: Units, host: str) -> dict[str, float] | None:
    """An encoder unit's counters, asked directly (over CURVE, as the gateway would); None if it does not answer."""
    cfg = Config()
    cfg.security.keys_dir = str(units.keys)
    address = f"tcp://{units.network.hosts[host].address}:{PORT}"
    cfg.endpoints = {"encoder.0": address}
    transport = Transport(cfg, "gateway")
    try:
        channel = transport.channel(zmq.DEALER, "encoder.0", bind=False)
        channel.send(StatsRequest("direct"))
        if not channel.sock.poll(3000):
            return None
        _, answer = channel.recv()
        return answer.counters if isinstance(answer, StatsResult) else None
    finally:
        transport.close()


def test_a_client_without_our_keys_gets_nothing_and_is_counted(units: Units) -> None:
    b = units.network.hosts["b"]
    ctx = zmq.Context()
    try:
        for curve in (False, True):
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            if curve:  # a key of its own, unknown to us, aimed at the encoders' real public key
                sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
                sock.curve_serverkey = zmq.auth.load_certificate(str(units.keys / "public" / "encoder.key"))[0]
            sock.connect(f"tcp://{b.address}:{PORT}")
            sock.send(encode(StatsRequest("stranger")))
            assert not sock.poll(1500)
            sock.close()
    finally:
        ctx.destroy(linger=0)
    stats = encoder_stats(units, "b")
    assert stats is not None and stats["security_denied"] >= 1


def wait_for(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.2)


def test_an_encoder_added_to_the_name_is_used_and_one_removed_is_drained(units: Units) -> None:
    pids = {name: units.pd.pid(name) for name in ("gateway", "fetcher-0", "cache", "decoder")}
    units.start_unit("d")
    units.name_encoders("b", "c", "d")
    wait_for(lambda: encoded(units.pd, units.label("d")) >= 0)  # (the gateway dials it: the name was looked up)
    wait_for(lambda: units.pd.metrics().get('vlm_fetcher_encoders_live{fetcher="0"}') == 3)
    content = [*images(61, 62, 63), {"type": "text", "text": "?"}]
    ask(units.pd, [{"role": "user", "content": content}])
    assert encoded(units.pd, units.label("d")) >= 1  # three jobs over three idle encoders: one each
    units.name_encoders("b", "d")
    wait_for(lambda: units.pd.metrics().get('vlm_fetcher_encoders_live{fetcher="0"}') == 2)
    c_before = encoder_stats(units, "c")
    assert c_before is not None  # (drained, not stopped: it still answers whoever asks)
    for seed in (64, 67):
        ask(units.pd, [{"role": "user", "content": [*images(seed, seed + 1, seed + 2), {"type": "text", "text": "?"}]}])
    c_after = encoder_stats(units, "c")
    assert c_after is not None and c_after["images_encoded"] == c_before["images_encoded"]
    assert {name: units.pd.pid(name) for name in pids} == pids  # nothing restarted
    units.name_encoders("b", "c", "d")  # (back as it was, for the next test)
    wait_for(lambda: units.pd.metrics().get('vlm_fetcher_encoders_live{fetcher="0"}') == 3)


def first_token_s(stack: Stack, messages: list[dict[str, Any]]) -> float:
    """Seconds to the first streamed token of a greedy answer, read to its end."""
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    started, first = time.monotonic(), None
    args: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True}
    for chunk in client.chat.completions.create(**args):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic() - started
    if first is None:
        raise RuntimeError("no token came")
    return first


class Load:
    """Four clients asking about two new images each, over and over, while in the block: each request's time to first
    token is kept under the phase it began in (``phase``, set as the load goes on), and each failure."""

    def __init__(self, units: Units, phase: str, seed: int) -> None:
        """``seed``: the first image's (each load its own, so that its images are in no cache yet)."""
        self.units, self.phase, self.seed = units, phase, seed
        self.ttfts: dict[str, list[float]] = {phase: []}
        self.failed: list[str] = []
        self.stopping = threading.Event()
        self.pool = concurrent.futures.ThreadPoolExecutor(4)

    def __enter__(self) -> Load:
        self.running = [self.pool.submit(self.client, self.seed + 10 * k) for k in range(4)]
        return self

    def __exit__(self, *_: object) -> None:
        self.stopping.set()
        for future in self.running:
            future.result()
        self.pool.shutdown()

    def enter(self, phase: str) -> None:
        self.ttfts[phase] = []
        self.phase = phase

    def client(self, seed: int) -> None:
        while not self.stopping.is_set():
            try:
                kept = self.ttfts[self.phase]
                kept.append(first_token_s(self.units.pd, [{"role": "user", "content": [*images(seed, seed + 1)]}]))
            except Exception as exc:  # a failed request: counted, and the load goes on
                self.failed.append(repr(exc))
            seed += 100

    def verdict(self, record: str) -> None:
        """Writes each phase's times to first token into ``run/RECORD`` (what the load saw; not judged), then
        fails if a request failed or a phase had none succeed."""
        summary = "; ".join(f"{phase}: {percentiles(seconds)}" for phase, seconds in self.ttfts.items())
        (REPO / "run" / record).write_text(summary + "\n")
        assert all(self.ttfts.values()), f"a phase had no request succeed: {summary}; {self.failed[:3]}"
        assert not self.failed, f"{len(self.failed)} failed ({self.failed[:3]}); {summary}"


def test_under_load_a_killed_encoder_and_a_link_down_fail_no_request(units: Units) -> None:
    b = units.network.hosts["b"]
    with Load(units, "encoder killed", seed=1000) as load:
        time.sleep(2)
        os.kill(units.encoders["b"].pid("encoder-0"), signal.SIGKILL)  # (supervisord there restarts it)
        time.sleep(5)
        load.enter("link down")
        b.link(False)
        time.sleep(10)
        b.link(True)
        load.enter("link back")
        time.sleep(3)
    load.verdict("netns-chaos.txt")


def test_under_load_slow_lossy_links_fail_no_request(units: Units) -> None:
    """Every link between the pd unit and the encoder units 20 ms slower and losing 1% of its packets, each way."""
    if netem_available():
        pytest.skip(netem_available())
    encoded_before = images_encoded(units.pd)
    lossy = units.network.slow_lossy_links("a", delay_ms=20, loss=0.01)
    with lossy as wire, Load(units, "slow, lossy", seed=900_000) as load:
        time.sleep(10)
    assert wire[0].startswith("carried") and int(wire[0].split()[1]) > 1000, wire
    # (two new images a request: the encoders, across the wire, made every embedding the load asked for)
    assert images_encoded(units.pd) - encoded_before >= 2 * len(load.ttfts["slow, lossy"])
    load.ttfts[f"slow, lossy (the wire {wire[0]})"] = load.ttfts.pop("slow, lossy")
    load.verdict("netns-lossy.txt")


def images_encoded(stack: Stack) -> float:
    """By all the stack's encoders, as its gateway counts them."""
    return sum(v for k, v in stack.metrics().items() if k.startswith("vlm_encoder_images_encoded_total{"))


def percentiles(seconds: list[float]) -> str:
    ordered = sorted(seconds) or [float("nan")]
    return (
        f"{len(seconds)} requests, time to first token p50 {ordered[len(ordered) // 2]:.2f} s, "
        f"p99 {ordered[int(len(ordered) * 0.99)]:.2f} s, max {ordered[-1]:.2f} s"
    )
