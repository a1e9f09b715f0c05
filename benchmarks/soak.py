"""Soak and chaos harness, and the overload (burst) run.

    python -m benchmarks.soak --duration 1200 --chaos-every 60 --out results/soak.json        # starts a CPU stack
    python -m benchmarks.soak --url http://127.0.0.1:8000 --config ops/vlm.toml --duration 600 --out soak.json
    python -m benchmarks.soak --burst --burst-s 30 --out overload.json                          # overload

Soak: ``--concurrency`` clients send mixed traffic for ``--duration`` seconds, every request drawn from the seed:
text, one to three images, short videos, streamed or not, ``n`` of 1 or 2, clients that hang up after the first
chunk, and bad inputs (each must get its 4xx). With ``--chaos-every S`` (mean seconds between events; 0: none) a
random stage gets ``kill -9``, or SIGSTOP then SIGCONT ``--hang-s`` later (a hang, for the liveness watchdogs), by
its pid from supervisord. Every ``--sample-every`` seconds it samples each process's RSS and open fds, the
deployment's /dev/shm bytes, the decoder's KV blocks in use and the cache daemon's leases and pending entries (the
gateway's /metrics) and GPU memory, every probe bounded (`benchmarks.soak_stack.Sampler`). The traffic stops, the
stack drains, and `benchmarks.soak_verdict` judges the records and samples (its docstring says how). Exit 1 with the
reasons when the run fails.

Burst (``--burst``): the sustainable rate (``--sustainable-rate``, else measured: ``--burst-workload`` requests
closed-loop at ``--concurrency`` for ``--measure-s``), a request's latency alone (the median of a few, one at a
time), then Poisson arrivals at ``--burst-factor`` x that rate for ``--burst-s``, then requests one at a time for
``--tail-s``; every body built before it starts (`BodyPool`). It fails if the burst was sent under 90% of the rate
asked (the harness's fault, said so), a request went unanswered by its deadline, a refusal was not a 503 with
Retry-After within ``--refuse-within-s``, the one-at-a-time latency was not back within ``--recover-factor`` x the
pre-burst one ``--recover-within-s`` after the burst, or a resource still grew after it.

Writes ``--out`` (config, summary, verdict, chaos events, every request, every sample) and a plot beside it
(``.png``): each resource over time, chaos events marked.

How long a run takes: a soak about ``--duration`` plus the stack's start (a 7B checkpoint's stack takes over a
minute to load), its last requests, the drain and the stop: about ``--duration`` + 2 minutes on the H200, so a device
call for ``--duration 480`` needs about 10 to 11 minutes. ``--time-bound`` prints the longest a run of the options
given may take before it must be stopped (every wait at its limit); `benchmarks.gpu` uses it as the part's timeout.
SIGTERM or Ctrl-C stops a run and the stack it started (no JSON then).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from benchmarks import media, soak_verdict
from benchmarks.serve import _error_text, _read_stream, environment
from benchmarks.soak_stack import PROBE_TIMEOUT_S, START_WAIT_S, STOP_WAIT_S, Sampler, Stack, start_stack
from benchmarks.workloads import WorkloadOptions, seed3img_request, text_request, video_request

Record = dict[str, Any]
KINDS = ("text", "images", "video", "bad")
BAD_INPUTS = ("not_json", "unknown_model", "broken_image", "negative_max_tokens", "no_messages")
# A try that never reached a server (the gateway down: connection refused, or reset before any response byte) is
# made again after a back-off, as OpenAI's clients do with connection errors, until the request's deadline.
NOT_CONNECTED = (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError, aiohttp.ClientConnectionResetError)
RETRY_FIRST_S, RETRY_CAP_S = 0.2, 2.0
BEFORE_BURST = 5  # requests one at a time before the burst: the latency alone
BACK_WAIT_S = 120.0  # how long a chaos event waits for its stage to run again
WRITE_S = 60.0  # the last sample, the JSON and the plot


# ---------------------------------------------------------------------------------------- traffic
@dataclass
class Request:
    """One drawn request: its body (bytes: a bad one may not be JSON), how it is read, what status it expects."""

    index: int
    kind: str
    body: bytes
    stream: bool
    n: int
    hang_up: bool
    expect: str  # "2xx" or "4xx"


def _body(messages: list[dict[str, Any]], max_tokens: int, stream: bool, n: int, **extra: Any) -> bytes:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream, "n": n, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


def _bad_body(rng: np.random.Generator) -> tuple[str, bytes]:
    case = BAD_INPUTS[int(rng.integers(len(BAD_INPUTS)))]
    hello = [{"role": "user", "content": "hello"}]
    if case == "not_json":
        return case, b'{"messages": [{"role": "user", "content": "hel'
    if case == "unknown_model":
        return case, _body(hello, 4, False, 1, model="no-such-model")
    if case == "broken_image":
        part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAAAbm90IGFuIGltYWdl"}}
        return case, _body([{"role": "user", "content": [part, {"type": "text", "text": "what?"}]}], 4, False, 1)
    if case == "negative_max_tokens":
        return case, _body(hello, -3, False, 1)
    return case, _body([], 4, False, 1)


def draw(seed: int, index: int, opts: WorkloadOptions, max_tokens: int, weights: list[float]) -> Request:
    """Request ``index`` of the soak's traffic, the same for the same seed."""
    rng = np.random.default_rng([seed, 31, index])
    kind = KINDS[int(rng.choice(len(KINDS), p=np.array(weights) / sum(weights)))]
    stream = bool(rng.random() < 0.5)
    n = 2 if rng.random() < 0.2 else 1
    hang_up = stream and bool(rng.random() < 0.15)
    tokens = int(rng.integers(max(1, max_tokens // 2), max_tokens + 1))
    if kind == "bad":
        case, body = _bad_body(rng)
        return Request(index, f"bad:{case}", body, False, 1, False, "4xx")
    if kind == "text":
        messages = text_request(opts, index).messages
    elif kind == "video":
        messages = video_request(opts, index).messages
    else:
        spec = seed3img_request(opts, index)
        images = int(rng.integers(1, 4))
        parts = spec.messages[0]["content"]
        messages = [{"role": "user", "content": [*parts[:images], parts[-1]]}]
    return Request(index, kind, _body(messages, tokens, stream, n, ignore_eos=True), stream, n, hang_up, "2xx")


def new_record(req: Request, t0: float) -> Record:
    return {
        "index": req.index,
        "kind": req.kind,
        "stream": req.stream,
        "n": req.n,
        "hang_up": req.hang_up,
        "hung_up": False,
        "expect": req.expect,
        "status": None,
        "error": None,
        "retry_after": None,
        "error_code": None,
        "timed_out": False,
        "start_s": time.perf_counter() - t0,
        "end_s": None,
        "output_tokens": None,
        "chunks": 0,
        "retries": 0,  # tries made again because the one before never reached a server
    }


def connect_retry_delay(error: BaseException, responded: bool, retries: int) -> float | None:
    """Seconds to wait before trying a request again whose last try failed with ``error`` after ``retries`` such
    retries; None: not again. Only a try that never reached a server is made again (exponential back-off from
    ``RETRY_FIRST_S`` up to ``RETRY_CAP_S``); a request that got a response, whole or in part, never is."""
    if responded or not isinstance(error, NOT_CONNECTED):
        return None
    return min(RETRY_FIRST_S * 2.0**retries, RETRY_CAP_S)


async def send(http: aiohttp.ClientSession, url: str, req: Request, t0: float, deadline_s: float) -> Record:
    """One request, tried again while it cannot reach a server (`connect_retry_delay`); a failure of any kind
    becomes the record's error, a missed deadline ``timed_out``."""
    record = new_record(req, t0)
    last_error = ""
    try:
        async with asyncio.timeout(deadline_s):
            while True:
                try:
                    await _try(http, url, req, record)
                    break
                except aiohttp.ClientError as exc:
                    delay = connect_retry_delay(exc, record["status"] is not None, record["retries"])
                    if delay is None:
                        raise
                    last_error = f"{type(exc).__name__}: {exc}"
                    record["retries"] += 1
                    await asyncio.sleep(delay)
    except TimeoutError:
        record["timed_out"] = True
        record["error"] = f"no answer within the deadline ({deadline_s:.0f} s)"
        if record["status"] is None and last_error:
            record["error"] += f"; never reached a server in {record['retries'] + 1} tries ({last_error})"
    except aiohttp.ClientError as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # one odd reply must not end the run
        record["error"] = f"unexpected {type(exc).__name__}: {exc}"
    record["end_s"] = time.perf_counter() - t0
    return record


async def _try(http: aiohttp.ClientSession, url: str, req: Request, record: Record) -> None:
    async with http.post(url, data=req.body, headers={"Content-Type": "application/json"}) as response:
        record["status"] = response.status
        record["retry_after"] = response.headers.get("Retry-After")
        if response.status != 200:
            raw = await response.read()
            record["error"], record["error_code"] = _error_text(raw), _error_code(raw)
        elif req.stream:
            await _read(response, record, req.hang_up)
        else:
            _check_answer(record, await response.json(content_type=None), req.n)


async def _read(response: aiohttp.ClientResponse, record: Record, hang_up: bool) -> None:
    if not hang_up:
        times: list[float] = []
        await _read_stream(response, record, times, [])
        record["chunks"] = len(times)
        if record["output_tokens"] is None and record["error"] is None:
            record["output_tokens"] = len(times)
        return
    async for raw in response.content:  # the first data line, then the client goes away
        if raw.startswith(b"data:"):
            if raw.startswith(b'data: {"error"'):  # (a failure, not an answer to hang up on)
                record["error"] = _error_text(raw[5:].strip())
                break
            record["hung_up"] = True
            record["error"] = "the client hung up (on purpose)"
            break
    else:
        record["error"] = "the stream ended before its first event"
    response.close()


def _error_code(raw: bytes) -> str | None:
    """The ``code`` of an OpenAI-shaped error body (``server_busy``: the gateway's refusal at its limits)."""
    try:
        error = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


def retry_after_s(record: Record) -> float:
    """How long a client waits before its next request: a 429 or 503's Retry-After (at most 10 s), as OpenAI's clients
    do; else 0. (Without it a closed loop would send thousands of requests into a stage's restart.)"""
    if record["status"] not in (429, 503):
        return 0.0
    try:
        return min(max(float(record["retry_after"] or 0), 0.0), 10.0)
    except ValueError:
        return 0.0


def _check_answer(record: Record, body: Any, n: int) -> None:
    choices = body.get("choices") if isinstance(body, dict) else None
    if not choices or len(choices) != n:
        record["error"] = f"expected {n} choices, got {body!r:.300}"
        return
    record["output_tokens"] = (body.get("usage") or {}).get("completion_tokens")


# ---------------------------------------------------------------------------------------- chaos and samples
@dataclass
class Chaos:
    """Kills and hangs of random stages at random times (exponential gaps of mean ``every_s``)."""

    stack: Stack
    rng: np.random.Generator
    every_s: float
    hang_s: tuple[float, float]
    stages: list[str]
    t0: float
    events: list[dict[str, Any]] = field(default_factory=list)

    def _choose(self) -> tuple[str, int] | None:
        running = [p for p in self.stack.processes() if p.pid and any(p.name.startswith(s) for s in self.stages)]
        if not running:
            return None
        chosen = running[int(self.rng.integers(len(running)))]
        return chosen.name, chosen.pid

    async def run(self, until_s: float) -> None:
        while True:
            gap = float(self.rng.exponential(self.every_s))
            if time.perf_counter() - self.t0 + gap >= until_s:
                return  # (at once: the soak waits for this task once its traffic ends)
            await asyncio.sleep(gap)
            chosen = await asyncio.to_thread(self._choose)
            if chosen is None:
                continue
            name, pid = chosen
            action = "kill" if self.rng.random() < 0.5 else "hang"
            event = {"at_s": time.perf_counter() - self.t0, "stage": name, "action": action, "pid": pid}
            self.events.append(event)
            print(f"chaos: {action} {name} (pid {pid}) at {event['at_s']:.1f}s", file=sys.stderr)
            with contextlib.suppress(ProcessLookupError):
                if action == "kill":
                    os.kill(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGSTOP)
                    try:
                        await asyncio.sleep(float(self.rng.uniform(*self.hang_s)))
                    finally:  # (also when the soak is stopped mid-hang: a stopped process would outlive its stack)
                        os.kill(pid, signal.SIGCONT)
                    event["resumed_s"] = time.perf_counter() - self.t0
            event["back_s"] = await self._back(name, pid if action == "kill" else 0)

    async def _back(self, name: str, killed_pid: int, timeout_s: float = BACK_WAIT_S) -> float | None:
        """When the stage ran again (a killed one: as a new process) and the stack was healthy (None: not within
        ``timeout_s``)."""

        def back() -> bool:
            return self.stack.pid(name) not in (0, killed_pid) and self.stack.healthy()

        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            with contextlib.suppress(Exception):
                if await asyncio.to_thread(back):
                    return time.perf_counter() - self.t0
            await asyncio.sleep(0.5)
        return None


async def sampler(
    stack: Stack, t0: float, every_s: float, samples: list[dict[str, Any]], probe_timeout_s: float = PROBE_TIMEOUT_S
) -> None:
    """A sample every ``every_s`` until cancelled, whatever a probe does (`Sampler`: one that fails or does not
    answer within ``probe_timeout_s`` is recorded as missing)."""
    probes = Sampler(stack, probe_timeout_s)
    while True:
        started = time.perf_counter()
        samples.append(await probes.sample(started - t0))
        await asyncio.sleep(max(0.0, every_s - (time.perf_counter() - started)))


async def drain(stack: Stack, timeout_s: float) -> dict[str, float]:
    """The gauges once the traffic has stopped: polled until every one of ``IDLE_ZERO`` reads 0, or ``timeout_s``
    (``drained_after_s``: how long that took; None: not within it)."""
    started = time.perf_counter()
    while True:
        gauges = await asyncio.to_thread(stack.metrics)
        waited = time.perf_counter() - started
        if gauges and all(gauges.get(k, 0) == 0 for k in soak_verdict.IDLE_ZERO):
            return {**gauges, "drained_after_s": waited}
        if waited > timeout_s:
            return {**gauges, "drained_after_s": None}
        await asyncio.sleep(1.0)


# ---------------------------------------------------------------------------------------- the soak
@dataclass
class Harness:
    args: argparse.Namespace
    stack: Stack
    http: aiohttp.ClientSession
    t0: float
    records: list[Record] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    sent: int = 0  # requests begun: each must end as a record (the JSON's "every request accounted for")

    @property
    def url(self) -> str:
        return self.stack.base_url + "/v1/chat/completions"

    @property
    def deadline_s(self) -> float:
        """A request must be answered within the stack's request deadline plus a grace for the last chunks."""
        return self.args.request_timeout + self.args.deadline_grace

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def one(self, req: Request) -> Record:
        self.sent += 1
        record = await send(self.http, self.url, req, self.t0, self.deadline_s)
        self.records.append(record)
        return record


def workload_options(args: argparse.Namespace) -> WorkloadOptions:
    return WorkloadOptions(
        seed=args.seed, image_scale=args.image_scale, prompt_tokens=args.prompt_tokens, video_frames=args.video_frames
    )


async def soak(h: Harness) -> dict[str, Any]:
    args = h.args
    opts = workload_options(args)
    weights = [float(w) for w in args.mix.split(",")]
    counter = iter(range(10**9))

    async def client() -> None:
        while h.now() < args.duration:
            record = await h.one(draw(args.seed, next(counter), opts, args.max_tokens, weights))
            await asyncio.sleep(retry_after_s(record))

    chaos = Chaos(
        h.stack, np.random.default_rng([args.seed, 71]), args.chaos_every, tuple(args.hang_s), args.chaos_stages, h.t0
    )
    background = [asyncio.create_task(sampler(h.stack, h.t0, args.sample_every, h.samples))]
    if args.chaos_every > 0:
        background.append(asyncio.create_task(chaos.run(args.duration - args.hang_s[1])))
    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    traffic_end = h.now()
    background[0].cancel()
    if len(background) > 1:  # (a hang in progress ends first: its SIGCONT must be sent)
        await background[1]
    idle = await drain(h.stack, args.drain_s)
    h.samples.append(await Sampler(h.stack).sample(h.now()))
    resources = soak_verdict.judge_resources(h.samples, traffic_end, args.warmup_s)
    verdict = soak_verdict.judge(
        h.records,
        chaos.events,
        resources,
        idle,
        recovery_s=args.recovery_s,
        deadline_s=h.deadline_s,
        strict=args.strict,
    )
    return {"verdict": verdict, "events": chaos.events, "resources": resources, "traffic_end_s": traffic_end}


# ---------------------------------------------------------------------------------------- overload
VARIANT = "@@variant@@"  # (no base64 data URL and no word of the filler text holds an "@")
# Below any image's own pixel count (media.MIN_SIDE squared): an image's min_pixels then changes no resize.
IMAGE_VARIANTS = media.MIN_SIDE**2 - 1
BODY_POOL_BUILD_S = 60.0  # the most building the pool may take (full-size seed3img bodies, one core)
SENT_SHARE = 0.9  # a burst sent at less than this share of the rate asked says nothing of the server


@dataclass
class BodyPool:
    """The overload run's request bodies (``--burst-workload``'s, not streamed), built before it starts: building
    a seed3img body (three full-size images drawn and encoded) on the sending loop capped the sender at about ten
    requests a second, far below a burst's rate. ``--body-pool`` distinct bodies are sent in turn, each pass as a
    new variant the server has not seen, so that every request is the cache miss the workload is meant to be: a
    seed3img body's images carry the variant as their ``min_pixels`` (the fetcher's decoded-image memo and the
    embedding cache both key on an image's pixel budget too; a budget below the image's pixels changes no resize:
    the same decode, patches and encoder work), a text body's prompt begins with it (no prefix-cache hit)."""

    workload: str
    bodies: list[list[bytes]]  # each body split where its variant goes

    @classmethod
    def build(cls, args: argparse.Namespace) -> BodyPool:
        opts = workload_options(args)
        bodies = []
        for index in range(args.body_pool):
            if args.burst_workload == "seed3img":
                messages = seed3img_request(opts, index).messages
                for part in messages[0]["content"]:
                    if part["type"] == "image_url":
                        part["image_url"]["min_pixels"] = VARIANT
                marker = json.dumps(VARIANT).encode()
            else:
                messages = text_request(opts, index).messages
                messages[0]["content"] = f"{VARIANT} {messages[0]['content']}"
                marker = VARIANT.encode()
            bodies.append(_body(messages, args.max_tokens, False, 1, ignore_eos=True).split(marker))
        return cls(args.burst_workload, bodies)

    @property
    def distinct(self) -> int:
        """How many requests differ before they repeat (and the cache may hold one)."""
        return len(self.bodies) * IMAGE_VARIANTS if self.workload == "seed3img" else 10**9

    def request(self, index: int) -> Request:
        variant = index // len(self.bodies)
        if self.workload == "seed3img":
            fill = str(variant % IMAGE_VARIANTS + 1).encode()
        else:
            fill = f"Request {index}.".encode()
        return Request(index, self.workload, fill.join(self.bodies[index % len(self.bodies)]), False, 1, False, "2xx")


async def measure_rate(h: Harness, pool: BodyPool, counter: Any) -> float:
    """Requests completed per second, closed loop at ``--concurrency`` for ``--measure-s``; a client refused waits out
    the Retry-After, as OpenAI's clients do (the summary counts such refusals: at its own closed-loop load a server
    should refuse none)."""
    done = 0
    end = h.now() + h.args.measure_s

    async def client() -> None:
        nonlocal done
        while h.now() < end:
            record = await h.one(pool.request(next(counter)))
            record["phase"] = "measure"
            done += record["error"] is None
            await asyncio.sleep(retry_after_s(record))

    started = h.now()
    await asyncio.gather(*(client() for _ in range(h.args.concurrency)))
    return done / (h.now() - started)


async def one_at_a_time(
    h: Harness, pool: BodyPool, counter: Any, until_s: float, phase: str, count: int | None = None
) -> list[Record]:
    out: list[Record] = []
    while h.now() < until_s and (count is None or len(out) < count):
        record = await h.one(pool.request(next(counter)))
        record["phase"] = phase
        out.append(record)
        if record["error"] is not None:
            await asyncio.sleep(0.5)
    return out


async def send_burst(h: Harness, pool: BodyPool, counter: Any, rate: float) -> tuple[list[asyncio.Task[Record]], float]:
    """Poisson arrivals at ``rate`` for ``--burst-s``, each request's body ready (`BodyPool`): the tasks, and the
    latest a request was begun past its planned arrival."""
    args = h.args
    gaps = np.random.default_rng([args.seed, 5]).exponential(1.0 / rate, size=10**6)
    tasks, late, at, start = [], 0.0, h.now(), h.now()
    for gap in gaps:
        at += float(gap)
        if at >= start + args.burst_s:
            break
        await asyncio.sleep(max(0.0, at - h.now()))
        late = max(late, h.now() - at)
        tasks.append(asyncio.create_task(h.one(pool.request(next(counter)))))
    return tasks, late


def sent_rate(burst: list[Record], burst_start: float, burst_s: float) -> float:
    """Requests a second the burst really began: its requests over the time from its start to its last one's
    start (at least ``burst_s``: a sender on time spreads them over the whole burst)."""
    if not burst:
        return 0.0
    return len(burst) / max(burst_s, max(r["start_s"] for r in burst) - burst_start)


async def overload(h: Harness) -> dict[str, Any]:
    args = h.args
    counter = iter(range(10**9))
    background = asyncio.create_task(sampler(h.stack, h.t0, args.sample_every, h.samples))
    pool = await asyncio.to_thread(BodyPool.build, args)
    rate = args.sustainable_rate or await measure_rate(h, pool, counter)
    alone = await one_at_a_time(h, pool, counter, float("inf"), "before", count=BEFORE_BURST)
    baseline = float(np.median([r["end_s"] - r["start_s"] for r in alone if r["error"] is None] or [float("nan")]))
    burst_start = h.now()
    tasks, late = await send_burst(h, pool, counter, args.burst_factor * rate)
    burst_end = h.now()
    after = await one_at_a_time(h, pool, counter, burst_end + args.tail_s, "after")
    burst = await asyncio.gather(*tasks)
    for record in burst:
        record["phase"] = "burst"
    background.cancel()
    recovered = recovered_at(after, baseline * args.recover_factor)
    resources = soak_verdict.judge_resources(h.samples, h.now(), burst_end + args.recover_within_s)
    made = next(counter)  # (requests made, every phase)
    summary = {
        "sustainable_rate": rate,
        "burst_rate": args.burst_factor * rate,
        "burst_sent_rate": sent_rate(burst, burst_start, args.burst_s),
        "burst_latest_send_s": late,
        "burst_requests": len(burst),
        "repeated_requests": max(0, made - pool.distinct),  # (sent again as they were: a cache may have held them)
        "burst_start_s": burst_start,
        "burst_end_s": burst_end,
        "latency_alone_s": baseline,
        "refused_while_measuring": sum(r["status"] == 503 for r in h.records if r.get("phase") == "measure"),
        "recovered_after_s": None if recovered is None else recovered - burst_end,
        "peak_rss_mib": _peak_rss(h.samples),
    }
    verdict = _overload_verdict(args, h, burst, recovered, burst_end, resources, summary)
    return {"verdict": verdict, "events": [], "resources": resources, "overload": summary}


def recovered_at(after: list[Record], bound_s: float) -> float | None:
    """When the one-at-a-time requests were back near their pre-burst latency: the end of the first one from which
    on every one was answered within ``bound_s``."""
    good_from = None
    for record in after:
        if record["error"] is None and record["end_s"] - record["start_s"] <= bound_s:
            good_from = record["end_s"] if good_from is None else good_from
        else:
            good_from = None
    return good_from


def _overload_verdict(
    args: argparse.Namespace,
    h: Harness,
    burst: list[Record],
    recovered_at: float | None,
    burst_end: float,
    resources: dict[str, dict[str, Any]],
    summary: dict[str, Any],
) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for r in h.records:
        r["outcome"] = soak_verdict.outcome(r, [], 0.0, h.deadline_s)
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    slow_refusals = [r for r in burst if r["status"] == 503 and r["end_s"] - r["start_s"] > args.refuse_within_s]
    bare = [r for r in burst if r["status"] == 503 and not r["retry_after"]]
    reasons = [f"{counts[k]} requests {k}" for k in ("lost", "unexpected") if counts.get(k)]
    if slow_refusals:
        reasons.append(f"{len(slow_refusals)} refusals took over {args.refuse_within_s} s")
    if bare:
        reasons.append(f"{len(bare)} 503s without Retry-After")
    if recovered_at is None or recovered_at - burst_end > args.recover_within_s:
        reasons.append(
            f"latency not back within {args.recover_factor}x the pre-burst one {args.recover_within_s} s "
            "after the burst"
        )
    reasons += [f"{name} still grows after the burst" for name, g in resources.items() if not g["ok"]]
    sent_ok = summary["burst_sent_rate"] >= SENT_SHARE * summary["burst_rate"]
    if not sent_ok:  # (first: whatever else it found, the server was not loaded as asked)
        reasons.insert(
            0,
            f"the harness sent {summary['burst_sent_rate']:.1f} requests/s of the {summary['burst_rate']:.1f} asked "
            f"(under {SENT_SHARE:.0%}): the server was not loaded as asked, so this run judges the harness, not it",
        )
    return {
        "ok": not reasons,
        "burst_sent_as_asked": sent_ok,
        "reasons": reasons,
        "outcomes": counts,
        "refused_in_burst": sum(r["status"] == 503 for r in burst),
        "served_in_burst": sum(r["error"] is None for r in burst),
    }


def _peak_rss(samples: list[dict[str, Any]]) -> dict[str, float]:
    peak: dict[str, float] = {}
    for s in samples:
        for name, p in s["processes"].items():
            peak[name] = max(peak.get(name, 0.0), p["rss_mib"])
    return peak


# ---------------------------------------------------------------------------------------- output
def summarise(records: list[Record]) -> dict[str, Any]:
    by_kind: dict[str, dict[str, int]] = {}
    for r in records:
        kind = by_kind.setdefault(r["kind"].split(":")[0], {})
        kind[r.get("outcome", "?")] = kind.get(r.get("outcome", "?"), 0) + 1
    answered = [r for r in records if r["error"] is None]
    return {
        "requests": len(records),
        "answered": len(answered),
        "output_tokens": sum(r["output_tokens"] or 0 for r in answered),
        "by_kind": by_kind,
        "streamed": sum(r["stream"] for r in records),
        "hung_up": sum(r["hung_up"] for r in records),
        "connect_retries": sum(r.get("retries", 0) for r in records),
        "retried_requests": sum(r.get("retries", 0) > 0 for r in records),
    }


def annotate(records: list[Record], events: list[dict[str, Any]]) -> None:
    """Each record's chaos event nearest before its start (None: none yet)."""
    for r in records:
        before = [e for e in events if e["at_s"] <= r["start_s"]]
        r["chaos_before"] = max(before, key=lambda e: e["at_s"]) if before else None


def plot(path: Path, samples: list[dict[str, Any]], events: list[dict[str, Any]], marks: list[float]) -> None:
    """Each resource over time, one panel a kind; chaos events as vertical lines (red: kill, orange: hang)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, dict[str, list[soak_verdict.Point]]] = {}
    for name, points in soak_verdict.series(samples).items():
        kind, _, label = name.partition(":")
        # (a restarted process's series joins its predecessor's line: one line a process)
        groups.setdefault(kind, {}).setdefault(label.split("#")[0] or kind, []).extend(points)
    fig, axes = plt.subplots(len(groups) or 1, 1, figsize=(11, 2.6 * max(1, len(groups))), sharex=True, squeeze=False)
    for ax, (kind, lines) in zip(axes[:, 0], sorted(groups.items()), strict=False):
        for label, points in sorted(lines.items()):
            ax.plot([t for t, _ in points], [v for _, v in points], label=label, linewidth=1)
        for e in events:
            ax.axvline(e["at_s"], color="red" if e["action"] == "kill" else "orange", alpha=0.6, linewidth=0.8)
        for t in marks:
            ax.axvline(t, color="black", linestyle="--", linewidth=0.8)
        ax.set_ylabel(kind)
        ax.legend(fontsize=6, loc="upper left", ncol=4)
    axes[-1, 0].set_xlabel("run time (s); red: kill -9, orange: SIGSTOP/SIGCONT, dashed: phases")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_bound_s(args: argparse.Namespace) -> float:
    """The longest a run of these options may take, every wait at its limit: the stack's start, the traffic (its last
    requests up to their deadline; a soak's last chaos event waiting for its stage; the burst's measuring, one at a
    time requests, burst and tail), the drain, the stack's stop and the output."""
    start = 0.0 if args.url else START_WAIT_S
    deadline = args.request_timeout + args.deadline_grace
    if args.burst:
        measure = 0.0 if args.sustainable_rate else args.measure_s + deadline
        traffic = BODY_POOL_BUILD_S + measure + BEFORE_BURST * deadline + args.burst_s + args.tail_s + deadline
    else:
        traffic = args.duration + max(deadline, args.hang_s[1] + BACK_WAIT_S) + args.drain_s
    return start + traffic + STOP_WAIT_S + WRITE_S


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running stack (else one is started on --model)")
    p.add_argument("--config", help="the running stack's settings file: its supervisord (chaos, pids) and /dev/shm")
    p.add_argument("--model", default="", help="checkpoint to start the stack on (default: the tiny demo one)")
    p.add_argument("--stack-toml", default="", help="extra TOML sections for the stack it starts")
    p.add_argument("--server-toml", default="", help="extra [server] lines for it (e.g. 'max_queue_wait_s = 2')")
    p.add_argument("--stack-dir", help="where the started stack's settings and logs go (default: a temp dir)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of traffic")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=4, help="clients, each sending its next request at once")
    p.add_argument("--mix", default="4,3,1,1", help="weights of text, images, video, bad inputs")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--image-scale", type=float, default=0.1, help="shrinks every image and frame (1: full size)")
    p.add_argument("--prompt-tokens", type=int, default=120)
    p.add_argument("--video-frames", type=int, default=4)
    p.add_argument("--chaos-every", type=float, default=0.0, help="mean seconds between chaos events (0: none)")
    p.add_argument("--chaos-stages", nargs="+", default=["fetcher", "cache", "encoder", "decoder", "gateway"])
    p.add_argument("--hang-s", type=float, nargs=2, default=[2.0, 6.0], help="a hang's length, uniform in [a, b]")
    p.add_argument("--recovery-s", type=float, default=20.0, help="a failure this soon after an event is chaos's")
    p.add_argument("--request-timeout", type=float, default=60.0, help="[server] request_timeout_s of the stack")
    p.add_argument("--deadline-grace", type=float, default=15.0, help="seconds past it before a request is lost")
    p.add_argument("--sample-every", type=float, default=3.0)
    p.add_argument("--warmup-s", type=float, default=30.0, help="samples before this are not judged")
    p.add_argument(
        "--drain-s",
        type=float,
        default=150.0,
        help="how long the load gauges may take to reach 0 once the traffic stops (past [cache] lease_ttl_s: a lease "
        "never released lapses by then)",
    )
    p.add_argument("--strict", action="store_true", help="fail on requests that failed with chaos too")
    p.add_argument("--burst", action="store_true", help="the overload run instead of the soak")
    p.add_argument("--burst-workload", choices=["seed3img", "text"], default="seed3img")
    p.add_argument(
        "--body-pool", type=int, default=32, help="distinct bodies built before the overload run, sent in turn"
    )
    p.add_argument("--sustainable-rate", type=float, help="requests/s (default: measured)")
    p.add_argument("--measure-s", type=float, default=30.0)
    p.add_argument("--burst-factor", type=float, default=10.0)
    p.add_argument("--burst-s", type=float, default=30.0)
    p.add_argument("--tail-s", type=float, default=40.0, help="one-at-a-time requests after the burst")
    p.add_argument("--refuse-within-s", type=float, default=5.0)
    p.add_argument("--recover-factor", type=float, default=2.0)
    p.add_argument("--recover-within-s", type=float, default=10.0)
    p.add_argument("--out", help="the result JSON (the plot beside it)")
    p.add_argument(
        "--time-bound",
        action="store_true",
        help="print the longest a run of the other options given may take, in seconds (every wait at its limit), "
        "and exit",
    )
    args = p.parse_args(argv)
    if not args.out and not args.time_bound:
        p.error("--out is required")
    if args.config and not args.url:
        p.error("--config describes a running stack: give its --url too")
    if len(args.mix.split(",")) != len(KINDS):
        p.error(f"--mix: {len(KINDS)} weights, for {', '.join(KINDS)}")
    return args


def _stop_undisturbed(stack: Stack) -> None:
    """``stack.stop()`` with SIGTERM and SIGINT held off: a second signal must not cut its stop short."""
    before = {each: signal.signal(each, signal.SIG_IGN) for each in (signal.SIGTERM, signal.SIGINT)}
    try:
        stack.stop()
    finally:
        for each, handler in before.items():
            signal.signal(each, handler)


def open_stack(args: argparse.Namespace) -> Stack:
    if args.url:
        return Stack.from_config(args.url, Path(args.config)) if args.config else Stack(args.url)
    directory = Path(args.stack_dir or tempfile.mkdtemp(prefix="soak-"))
    print(f"starting a stack in {directory} ...", file=sys.stderr)
    return start_stack(directory, free_port(), args.model, args.request_timeout, args.stack_toml, args.server_toml)


async def run(args: argparse.Namespace, stack: Stack) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        h = Harness(args, stack, http, time.perf_counter())
        result = await (overload(h) if args.burst else soak(h))
    annotate(h.records, result["events"])
    h.records.sort(key=lambda r: r["start_s"])
    return {
        "config": {**vars(args), **environment()},
        "summary": {"sent": h.sent, **summarise(h.records), **result.pop("overload", {})},
        **result,
        "requests": h.records,
        "samples": h.samples,
    }


class Stopped(KeyboardInterrupt):
    """SIGTERM: raised like Ctrl-C's KeyboardInterrupt, so that it ends the event loop wherever it comes and the
    stack this run started is stopped on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stopped(signum: int, _frame: object) -> None:
    raise Stopped(signum)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.time_bound:
        print(round(time_bound_s(args)))
        return
    signal.signal(signal.SIGTERM, _stopped)
    stack: Stack | None = None
    try:
        stack = open_stack(args)  # (stops what it started itself when it fails or is stopped)
        out = asyncio.run(run(args, stack))
    except KeyboardInterrupt as stopped:
        signum = getattr(stopped, "signum", signal.SIGINT)
        print(f"soak: stopped by signal {signum}; stopping the stack", file=sys.stderr)
        sys.exit(128 + signum)
    finally:
        if stack is not None:
            _stop_undisturbed(stack)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str))
    summary = out["summary"]
    marks = [summary[k] for k in ("burst_start_s", "burst_end_s") if k in summary]
    plot(path.with_suffix(".png"), out["samples"], out["events"], marks)
    verdict = out["verdict"]
    print(json.dumps({"summary": summary, "verdict": verdict}, indent=1, default=str), file=sys.stderr)
    if not verdict["ok"]:
        sys.exit("soak failed: " + "; ".join(verdict["reasons"]))


if __name__ == "__main__":
    main()
