"""Load generator for any OpenAI-compatible ``/v1/chat/completions`` server (ours, vLLM, SGLang).

    python -m benchmarks.serve --url http://127.0.0.1:8000 --workload seed3img --concurrency 8 \\
        --num-requests 200 --seed 0 --out results.json

Streams every request and parses the SSE bytes itself (no OpenAI client in between), so each
chunk's arrival time is taken the moment its line is read. Writes ``results.json`` (config,
summary, every request) and ``results.png`` beside it.

``structured``: ``--concurrency`` text streams, each sending its next request the moment its previous one
ends, until ``--num-requests`` requests were started in all (whichever streams started them). The first
``--constrained-share`` of the streams (a quarter of 32: 8) send OpenAI's strict ``json_schema`` response
format, the schemas of `benchmarks.schemas` in turn, and no ``ignore_eos`` (their grammar ends them); the
others ask the same questions unconstrained, ``--text-max-tokens`` long. ``--constrained-share 0`` is the
control: the same prompts from every stream, none constrained. The summary is split by ``stream_kind``
(constrained, unconstrained), and counts the constrained answers that parse as JSON (``valid_json``) and
validate against their schema (``schema_valid``; None where ``jsonschema`` is not installed). A constrained
answer ends sooner than an unconstrained one, so its stream sends prompts more often: those prefills are part
of what both groups' TPOT sees. ``--paired-with RUN.json`` (an earlier constrained run; relative to ``--out``'s
folder) makes the control a like-for-like one: the streams that were constrained there send, request for
request, the same question unconstrained with ``ignore_eos`` and as many output tokens as that run's constrained
answer had (``stream_kind`` "paired"), so both runs carry the same prompts at the same cadence and differ only
in the grammar. Unconstrained TPOT is then compared with unconstrained, constrained with paired.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import itertools
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import aiohttp
import numpy as np

from benchmarks import report, schemas
from benchmarks.workloads import (
    WORKLOADS,
    RequestSpec,
    SessionSpec,
    WorkloadOptions,
    constrained_streams,
    multiturn_session,
    next_turn,
    request_for,
    stream_text_request,
    structured_request,
)

Record = dict[str, Any]
T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]

# The tag each workload's summary is split by (the text streams of ``mixed`` are what shows whether
# vision work stalls decoding; ``structured``'s unconstrained streams, whether constrained rows slow the batch).
GROUP_BY: dict[str, list[str]] = {"mixed": ["stream_kind"], "multiturn": ["turn"], "structured": ["stream_kind"]}


# ---------------------------------------------------------------------------------------- requests
def request_body(spec: RequestSpec, model: str) -> bytes:
    """A streamed, greedy, fixed-length request: ``ignore_eos`` makes output length what we asked for. A
    constrained one (``response_format``) goes without ``ignore_eos``: its grammar ends it."""
    body: dict[str, Any] = {
        "model": model,
        "messages": spec.messages,
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.response_format is None:
        body["ignore_eos"] = True
    else:
        body["response_format"] = spec.response_format
    return json.dumps(body).encode()


@dataclass
class Prepared:
    body: bytes
    max_tokens: int
    tags: dict[str, Any]


def new_record(index: int, tags: dict[str, Any], max_tokens: int, scheduled_s: float | None) -> Record:
    return {
        "index": index,
        "tags": dict(tags),
        "max_tokens": max_tokens,
        "scheduled_s": scheduled_s,
        "start_s": 0.0,
        "end_s": 0.0,
        "ttft_s": None,
        "itl_s": [],
        "tpot_s": None,
        "e2e_s": None,
        "chunks": 0,
        "prompt_tokens": None,
        "output_tokens": None,
        "usage_reported": False,
        "status": None,
        "error": None,
        "sent": True,
    }


def _error_text(raw: bytes) -> str:
    """The server's own error message when it sent OpenAI's error shape, else the raw body."""
    try:
        body = json.loads(raw)
        error = body.get("error", body) if isinstance(body, dict) else body
        message = error.get("message") if isinstance(error, dict) else None
        return str(message or error)[:1000]
    except (json.JSONDecodeError, UnicodeDecodeError):
        return raw.decode(errors="replace")[:1000] or "(empty body)"


RETRY_AFTER_MAX_S = 10.0


def _retry_after_s(response: aiohttp.ClientResponse) -> float:
    """A refusal's ``Retry-After`` in seconds (429 and 503 only; at most ``RETRY_AFTER_MAX_S``), else 0."""
    if response.status not in (429, 503):
        return 0.0
    try:
        return min(max(float(response.headers.get("Retry-After", "0")), 0.0), RETRY_AFTER_MAX_S)
    except ValueError:  # (an HTTP date: not what this server sends)
        return 0.0


class Client:
    """Sends one request at a time per call and turns its stream into a record; a refusal (429, 503) with
    ``Retry-After`` returns only after that wait (at most ``RETRY_AFTER_MAX_S``), as OpenAI's clients wait before
    their next try: a closed loop's stream does not hammer a server that is restarting a worker."""

    def __init__(self, http: aiohttp.ClientSession, base_url: str, headers: dict[str, str], t0: float) -> None:
        self.http = http
        self.url = base_url.rstrip("/") + "/v1/chat/completions"
        self.headers = {"Content-Type": "application/json", **headers}
        self.t0 = t0
        self.sent = 0

    async def chat(self, prepared: Prepared, scheduled_s: float | None = None) -> tuple[Record, str]:
        """Run one request; never raises for server or network failures: they become the record's error."""
        record = new_record(self.sent, prepared.tags, prepared.max_tokens, scheduled_s)
        self.sent += 1
        chunk_times: list[float] = []
        text: list[str] = []
        start = time.perf_counter()
        record["start_s"] = start - self.t0
        retry_after_s = 0.0
        try:
            async with self.http.post(self.url, data=prepared.body, headers=self.headers) as response:
                record["status"] = response.status
                if response.status != 200:
                    record["error"] = _error_text(await response.read())
                    retry_after_s = _retry_after_s(response)
                else:
                    await _read_stream(response, record, chunk_times, text)
        except TimeoutError:
            record["error"] = "timed out (see --timeout)"
        except aiohttp.ClientError as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # e.g. an over-long SSE line: one odd reply must not end the whole run
            record["error"] = f"unexpected {type(exc).__name__}: {exc}"
        end = time.perf_counter()
        _finish(record, start, end, chunk_times, self.t0)
        if retry_after_s:  # as OpenAI's clients do: the caller's next request (closed loop) waits for it
            await asyncio.sleep(retry_after_s)
        return record, "".join(text)


async def _read_stream(response: aiohttp.ClientResponse, record: Record, times: list[float], text: list[str]) -> None:
    """SSE lines as they arrive; only chunks that carry generated text count as token arrivals."""
    if "text/event-stream" not in response.headers.get("Content-Type", ""):
        record["error"] = (
            f"not an event stream ({response.headers.get('Content-Type')}): {_error_text(await response.read())}"
        )
        return
    async for raw in response.content:
        now = time.perf_counter()
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank event separators, ": keep-alive" comments, "event:" lines
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        try:
            event = json.loads(payload)
        except json.JSONDecodeError:
            record["error"] = f"unparseable SSE data: {payload[:200]!r}"
            return
        if event.get("error"):  # a failure after the 200 was sent is reported in-band
            record["error"] = _error_text(payload)
            return
        if usage := event.get("usage"):
            record["prompt_tokens"] = usage.get("prompt_tokens")
            record["output_tokens"] = usage.get("completion_tokens")
            record["usage_reported"] = True
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            # A role-only first chunk (content "") may be sent before any token exists: not a token.
            content = delta.get("content") or delta.get("reasoning_content")
            if content:
                times.append(now)
                text.append(content)
    record["error"] = "the stream ended before [DONE]"


def _finish(record: Record, start: float, end: float, chunk_times: list[float], t0: float) -> None:
    record["end_s"] = end - t0
    record["chunks"] = len(chunk_times)
    if record["error"] is not None:
        return
    record["e2e_s"] = end - start
    if chunk_times:
        record["ttft_s"] = chunk_times[0] - start
        record["itl_s"] = [b - a for a, b in itertools.pairwise(chunk_times)]
    if not record["usage_reported"]:
        record["output_tokens"] = len(chunk_times)  # a lower bound: a chunk may hold several tokens
    record["tpot_s"] = report.time_per_output_token(record["ttft_s"], record["e2e_s"], record["output_tokens"])


# ---------------------------------------------------------------------------------------- scheduling
class Prefetcher(Generic[T]):
    """Builds items (images, JSON bodies) in worker threads a bounded distance ahead of use.

    Encoding three photos takes ~100 ms; doing it inline would stall every stream this event loop
    is timing, and building all requests up front would hold gigabytes for long runs.
    """

    def __init__(self, build: Callable[[int], T], count: int, depth: int) -> None:
        self.build = build
        self.count = count
        self.depth = max(1, depth)
        # PIL and numpy release the GIL while encoding; leave cores for the event loop (and the server).
        threads = max(2, min(8, (os.cpu_count() or 2) // 2))
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="prefetch")
        self.futures: dict[int, asyncio.Future[T]] = {}
        self.next = 0
        self.waited_s = 0.0  # time requests waited for their payload: > 0 means the client was the bottleneck

    def _fill(self, upto: int) -> None:
        loop = asyncio.get_running_loop()
        while self.next < min(upto, self.count):
            self.futures[self.next] = loop.run_in_executor(self.pool, self.build, self.next)
            self.next += 1

    async def warm(self) -> None:
        """Have the first items ready before the clock starts."""
        self._fill(self.depth)
        await asyncio.gather(*self.futures.values())

    async def get(self, index: int) -> T:
        self._fill(index + 1 + self.depth)
        future = self.futures.pop(index)
        if future.done():
            return future.result()
        started = time.perf_counter()
        try:
            return await future
        finally:
            self.waited_s += time.perf_counter() - started

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


Unit = Callable[[int, float | None], Awaitable[None]]


async def closed_loop(count: int, concurrency: int, unit: Unit) -> None:
    """``concurrency`` workers, each starting the next unit the moment its previous one ends."""
    indices = iter(range(count))

    async def worker() -> None:
        for index in indices:
            await unit(index, None)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, count))))


def arrival_times(count: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals (exponential gaps) from the seed; the first request goes at once."""
    gaps = np.random.default_rng([seed, 99]).exponential(1.0 / rate, size=max(0, count - 1))
    return [0.0, *np.cumsum(gaps).tolist()][:count]


async def open_loop(count: int, rate: float, seed: int, t0: float, unit: Unit) -> None:
    """Units start at their arrival times whatever is still running, as real traffic does."""
    tasks = []
    for index, at in enumerate(arrival_times(count, rate, seed)):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(unit(index, at)))
    await asyncio.gather(*tasks)


# ---------------------------------------------------------------------------------------- loop lag
class LoopLag:
    """How late this client's event loop wakes. A task asks to wake every ``PERIOD_S`` and records by how
    much it overslept. Chunks are timestamped when the loop gets to them, so a loop lag of a few ms at p99
    is that much of the reported ITL p99 that belongs to the client, not the server."""

    PERIOD_S = 0.005

    def __init__(self) -> None:
        self.lags_s: list[float] = []
        self.task: asyncio.Task[None] | None = None

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.PERIOD_S
            await asyncio.sleep(self.PERIOD_S)
            self.lags_s.append(max(0.0, loop.time() - due))

    def start(self) -> None:
        self.task = asyncio.create_task(self._watch())

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()

    def summary(self) -> dict[str, float | None]:
        p99 = report.percentile(self.lags_s, 99)
        return {
            "client_loop_lag_p99_ms": None if p99 is None else 1e3 * p99,
            "client_loop_lag_max_ms": 1e3 * max(self.lags_s) if self.lags_s else None,
        }


# ---------------------------------------------------------------------------------------- progress
class Progress:
    """One self-rewriting stderr line (a line every 10 s when stderr is not a terminal)."""

    def __init__(self, total: int | None, label: str) -> None:
        self.total = total
        self.label = label
        self.done = 0
        self.errors = 0
        self.tokens = 0
        self.started = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.task: asyncio.Task[None] | None = None

    def add(self, record: Record) -> None:
        self.done += 1
        self.errors += record["error"] is not None
        self.tokens += record["output_tokens"] or 0

    def line(self) -> str:
        elapsed = time.perf_counter() - self.started
        total = f"/{self.total}" if self.total is not None else ""
        return (
            f"{self.label}: {self.done}{total} requests, {self.errors} errors, "
            f"{self.tokens / max(elapsed, 1e-9):.1f} output tok/s, {elapsed:.0f}s"
        )

    async def _show(self) -> None:
        period = 0.25 if self.tty else 10.0
        while True:
            await asyncio.sleep(period)
            print(("\r\033[K" if self.tty else "") + self.line(), end="" if self.tty else "\n", file=sys.stderr)

    def start(self) -> None:
        self.task = asyncio.create_task(self._show())

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        print(("\r\033[K" if self.tty else "") + self.line(), file=sys.stderr)


# ---------------------------------------------------------------------------------------- workloads
@dataclass
class Run:
    """What a workload runner needs: the client, the shared record list and the run's options."""

    args: argparse.Namespace
    opts: WorkloadOptions
    model: str
    client: Client
    progress: Progress
    records: list[Record]

    def prefetch_depth(self, rate: float | None) -> int:
        return 4 + 2 * (self.args.concurrency or 0) + int(4 * (rate or 0))

    async def send(self, prepared: Prepared, scheduled_s: float | None) -> tuple[Record, str]:
        record, answer = await self.client.chat(prepared, scheduled_s)
        self.records.append(record)
        self.progress.add(record)
        return record, answer

    async def schedule(self, count: int, unit: Unit, rate: float | None) -> None:
        if rate is not None:
            await open_loop(count, rate, self.opts.seed, self.client.t0, unit)
        else:
            await closed_loop(count, self.args.concurrency, unit)


def _prepare(workload: str, opts: WorkloadOptions, model: str, index: int) -> Prepared:
    spec = request_for(workload, opts, index)
    return Prepared(request_body(spec, model), spec.max_tokens, {**spec.tags, "request": index})


async def run_single(run: Run, prefetch: Prefetcher[Prepared]) -> None:
    """seed3img, text, video: independent requests."""

    async def unit(index: int, at: float | None) -> None:
        await run.send(await prefetch.get(index), at)

    await run.schedule(run.args.num_requests, unit, run.args.rate)


async def run_multiturn(run: Run, prefetch: Prefetcher[SessionSpec]) -> None:
    """Sessions in parallel, each session's turns in order, each turn carrying the real previous answer."""

    async def unit(index: int, at: float | None) -> None:
        session = await prefetch.get(index)
        messages = session.first.messages
        max_tokens = [session.first.max_tokens, *session.max_tokens]
        answer = ""
        failed: str | None = None
        for turn in range(1, len(max_tokens) + 1):
            tags = {"session": index, "turn": turn}
            if turn > 1:
                messages = next_turn(messages, answer, session.followups[turn - 2])
            spec = RequestSpec(messages, max_tokens[turn - 1])
            if failed is not None:  # never sent, but counted: a failed session still owes its turns
                record = new_record(-1, tags, spec.max_tokens, None)
                record.update(start_s=time.perf_counter() - run.client.t0, error=failed, sent=False)
                record["end_s"] = record["start_s"]
                run.records.append(record)
                run.progress.add(record)
                continue
            body = await asyncio.to_thread(request_body, spec, run.model)
            record, answer = await run.send(Prepared(body, spec.max_tokens, tags), at if turn == 1 else None)
            if record["error"] is not None:
                failed = f"not sent: turn {turn} of this session failed"

    await run.schedule(run.args.num_requests, unit, run.args.rate)


async def run_mixed(run: Run, prefetch: Prefetcher[Prepared]) -> None:
    """``--concurrency`` text streams decode back to back while image requests arrive at ``--vision-rate``."""
    vision_done = asyncio.Event()

    async def text_stream(stream: int) -> None:
        turn = 0
        while not vision_done.is_set() or turn == 0:
            spec = stream_text_request(run.opts, stream, turn)
            body = await asyncio.to_thread(request_body, spec, run.model)
            await run.send(Prepared(body, spec.max_tokens, {**spec.tags, "stream": stream, "request": turn}), None)
            turn += 1

    async def vision() -> None:
        if run.args.vision_off:  # the control: the same streams for as long as the images would arrive
            await asyncio.sleep(run.args.vision_delay + run.args.num_requests / run.args.vision_rate)
            vision_done.set()
            return
        await asyncio.sleep(run.args.vision_delay)  # let the text streams reach steady decoding first

        async def unit(index: int, at: float | None) -> None:
            await run.send(await prefetch.get(index), None if at is None else at + run.args.vision_delay)

        vision_t0 = run.client.t0 + run.args.vision_delay
        await open_loop(run.args.num_requests, run.args.vision_rate, run.opts.seed, vision_t0, unit)
        vision_done.set()

    await asyncio.gather(vision(), *(text_stream(s) for s in range(run.args.concurrency)))


async def run_structured(run: Run, _prefetch: Prefetcher[Prepared]) -> None:
    """``--concurrency`` text streams back to back until ``--num-requests`` requests were started in all; the
    first ``--constrained-share`` of the streams send a JSON schema, and each of their answers is checked."""
    constrained = constrained_streams(run.opts, run.args.concurrency)
    paired = paired_lengths(run.args.paired_with, run.args.out) if run.args.paired_with else None
    started = 0

    async def stream(number: int) -> None:
        nonlocal started
        turn = 0
        while started < run.args.num_requests:
            started += 1
            spec = structured_request(run.opts, number, turn, number < constrained)
            if paired is not None and number in paired.streams:
                spec = paired.stand_in(spec, number, turn)
            body = await asyncio.to_thread(request_body, spec, run.model)
            tags = {**spec.tags, "stream": number, "request": turn}
            record, answer = await run.send(Prepared(body, spec.max_tokens, tags), None)
            if spec.response_format is not None and record["error"] is None:
                valid_json, schema_valid = schemas.check_answer(schemas.SCHEMAS[spec.tags["schema"]], answer)
                record.update(answer=answer, valid_json=valid_json, schema_valid=schema_valid)
            turn += 1

    await asyncio.gather(*(stream(s) for s in range(run.args.concurrency)))


@dataclass
class PairedLengths:
    """A constrained run's answer lengths by (stream, request), for a like-for-like control (``--paired-with``)."""

    lengths: dict[tuple[int, int], int]
    streams: set[int]
    median: int

    def stand_in(self, spec: RequestSpec, stream: int, request: int) -> RequestSpec:
        """The unconstrained request standing in for that run's constrained one: as long as its answer was (the
        median answer where that run's stream sent fewer requests)."""
        tokens = self.lengths.get((stream, request), self.median)
        return dataclasses.replace(spec, max_tokens=max(1, tokens), tags={**spec.tags, "stream_kind": "paired"})


def paired_lengths(path: Path, out: Path) -> PairedLengths:
    """The constrained answers' output tokens of the run at ``path`` (relative: beside ``out``)."""
    source = path if path.is_absolute() else out.parent / path
    try:
        records = json.loads(source.read_text())["requests"]
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"--paired-with {source}: cannot read a structured run's requests ({exc})") from exc
    lengths = {
        (r["tags"]["stream"], r["tags"]["request"]): int(r["output_tokens"])
        for r in records
        if r["tags"].get("stream_kind") == "constrained" and r["error"] is None and r.get("output_tokens")
    }
    if not lengths:
        raise SystemExit(f"--paired-with {source}: no completed constrained request to pair with")
    streams = {stream for stream, _ in lengths}
    return PairedLengths(lengths, streams, int(np.median(list(lengths.values()))))


def answer_checks(records: list[Record]) -> dict[str, int | None]:
    """How many constrained answers completed, parsed as JSON and validated against their schema (None: no
    ``jsonschema`` here to check with)."""
    checked = [r for r in records if "valid_json" in r]
    validated = [r["schema_valid"] for r in checked if r["schema_valid"] is not None]
    return {
        "constrained_answers": len(checked),
        "valid_json": sum(r["valid_json"] for r in checked),
        "schema_valid": sum(validated) if len(validated) == len(checked) else None,
    }


# ---------------------------------------------------------------------------------------- the run
async def resolve_model(http: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> str:
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with http.get(url, headers=headers) as response:
            if response.status != 200:
                raise SystemExit(f"GET {url} answered {response.status}: {_error_text(await response.read())}")
            models = (await response.json(content_type=None))["data"]
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise SystemExit(f"cannot list models at {url} ({type(exc).__name__}: {exc}); pass --model") from exc
    if not models:
        raise SystemExit("GET /v1/models lists no model; pass --model")
    return str(models[0]["id"])


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the workload against the server; the results document (config, summary, requests)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=0)  # aiohttp's default of 100 connections would cap concurrency
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        model = args.model or await resolve_model(http, args.url, headers)
        opts = WorkloadOptions.from_args(args)
        prefetch: Prefetcher[Any]
        if args.workload == "multiturn":
            prefetch = Prefetcher(lambda i: multiturn_session(opts, i), args.num_requests, 8)
        elif args.workload == "structured":  # (its streams build their own requests)
            prefetch = Prefetcher(lambda i: Prepared(b"", 0, {}), 0, 1)
        else:
            prefetch = Prefetcher(lambda i: _prepare(args.workload, opts, model, i), args.num_requests, 8)
        records: list[Record] = []
        total = (
            None
            if args.workload == "mixed"
            else args.num_requests * (args.turns if args.workload == "multiturn" else 1)
        )
        progress = Progress(total, args.workload)
        loop_lag = LoopLag()
        try:
            run = Run(args, opts, model, Client(http, args.url, headers, 0.0), progress, records)
            prefetch.depth = run.prefetch_depth(args.vision_rate if args.workload == "mixed" else args.rate)
            await prefetch.warm()
            started_at = datetime.datetime.now(datetime.UTC).isoformat()
            run.client.t0 = time.perf_counter()
            progress.start()
            loop_lag.start()
            runners = {"multiturn": run_multiturn, "mixed": run_mixed, "structured": run_structured}
            runner = runners.get(args.workload, run_single)
            stopped_at_limit = False
            try:
                await asyncio.wait_for(runner(run, prefetch), args.time_limit)
            except TimeoutError:  # keep what finished; requests cut off at the limit are not counted
                stopped_at_limit = True
            duration = time.perf_counter() - run.client.t0
        finally:
            loop_lag.stop()
            progress.stop()
            prefetch.close()
    records.sort(key=lambda r: (r["start_s"], r["index"]))
    group_by = GROUP_BY.get(args.workload, [])
    config = {
        # never write secrets into results; Paths as strings for JSON
        **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "api_key"},
        "model": model,
        "started_at": started_at,
        "group_by": group_by,
        "stopped_at_limit": stopped_at_limit,
        **environment(),
    }
    summary = report.summarize_run(records, duration, group_by)
    summary.update(client_health(records, prefetch.waited_s))
    summary.update(loop_lag.summary())
    if args.workload == "structured":
        summary.update(answer_checks(records))
    return {"config": config, "summary": summary, "requests": records}


def client_health(records: list[Record], payload_wait_s: float) -> dict[str, float | None]:
    """How far the client fell behind its own schedule: large values mean it, not the server, limited the run."""
    lags = [r["start_s"] - r["scheduled_s"] for r in records if r["scheduled_s"] is not None]
    return {"client_payload_wait_s": payload_wait_s, "max_start_lag_s": max(lags) if lags else None}


def environment() -> dict[str, Any]:
    """Where and what ran: for telling result files apart months later."""
    return {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_revision": _git("rev-parse", "HEAD"),
        # --no-optional-locks: reading status must not take the index lock others may be holding.
        "git_dirty": bool(_git("--no-optional-locks", "status", "--porcelain", "--untracked-files=no")),
    }


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


# ---------------------------------------------------------------------------------------- CLI
def _image_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(side) for side in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT like 768x1024, got {text!r}") from None
    if width <= 0 or height <= 0:
        raise argparse.ArgumentTypeError(f"image sides must be positive, got {text!r}")
    return width, height


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serve",
        description="Benchmark an OpenAI-compatible /v1/chat/completions server with the seed workloads.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    p.add_argument("--workload", choices=WORKLOADS, default="seed3img")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--concurrency", type=int, help="closed loop: this many requests (sessions) in flight")
    load.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second (sessions for multiturn)")
    p.add_argument("--num-requests", type=int, default=100, help="requests; sessions for multiturn; images for mixed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results.json"), help="results JSON; the plot goes beside it")
    p.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="stop the run after this many seconds and write what finished (config.stopped_at_limit says so)",
    )
    p.add_argument("--max-tokens-mean", type=int, default=None, help="default 120 (vision), 256 (text)")
    p.add_argument(
        "--max-tokens-spread", type=int, default=None, help="uniform ± spread; default 32 (vision), 0 (text)"
    )
    p.add_argument("--image-scale", type=float, default=1.0, help="shrink images/frames by this factor (CPU runs)")
    p.add_argument("--small", action="store_true", help="shorthand for --image-scale 0.1")
    p.add_argument(
        "--image-size",
        type=_image_size,
        default=None,
        metavar="WxH",
        help="every image a photo of this size (ANCHORS' vLLM rows: 768x1024); default: documents and photos",
    )
    p.add_argument("--repeat-media", action="store_true", help="reuse images and prompts from a small pool")
    p.add_argument("--media-pool", type=int, default=4, help="pool size for --repeat-media")
    p.add_argument("--prompt-tokens", type=int, default=1000, help="text prompt length (text, mixed text streams)")
    p.add_argument("--turns", type=int, default=3, help="multiturn: turns per session")
    p.add_argument("--vision-rate", type=float, default=1.0, help="mixed: image requests per second")
    p.add_argument("--vision-delay", type=float, default=1.0, help="mixed: seconds of text-only decoding first")
    p.add_argument(
        "--vision-off", action="store_true", help="mixed: send no images (the control run for the text streams)"
    )
    p.add_argument(
        "--text-max-tokens",
        type=int,
        default=256,
        help="mixed: output tokens of each text request; structured: of each unconstrained one",
    )
    p.add_argument(
        "--constrained-share",
        type=float,
        default=0.25,
        help="structured: the share of the streams whose requests carry a JSON schema (0: the control run)",
    )
    p.add_argument(
        "--json-max-tokens",
        type=int,
        default=512,
        help="structured: max_tokens of a constrained request (a cap: its grammar ends the answer first)",
    )
    p.add_argument(
        "--paired-with",
        type=Path,
        default=None,
        help="structured control: an earlier constrained run's JSON (relative to --out's folder) whose constrained "
        "answers' lengths its stand-in streams ask for, unconstrained (see the module's help)",
    )
    p.add_argument("--video-format", choices=("avi", "frames"), default="avi", help="video url: MJPEG AVI or frames")
    p.add_argument("--video-frames", type=int, default=8)
    p.add_argument("--video-fps", type=int, default=2)
    args = p.parse_args(argv)
    if args.small:
        args.image_scale = 0.1
    if args.workload in ("mixed", "structured") and args.concurrency is None:
        p.error(f"{args.workload} needs --concurrency (the number of text streams)")
    if not 0 <= args.constrained_share <= 1:
        p.error("--constrained-share must be between 0 and 1")
    if args.paired_with is not None and (args.workload != "structured" or args.constrained_share != 0):
        p.error("--paired-with is for a structured control run: --workload structured --constrained-share 0")
    for name in ("concurrency", "rate", "num_requests", "vision_rate", "turns", "prompt_tokens", "json_max_tokens"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


def print_summary(summary: dict[str, Any], title: str = "all") -> None:
    def fmt(value: float | None) -> str:
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.1f}"

    s = summary
    print(
        f"[{title}] {s['requests']} requests, {s['completed']} completed, {s['errors']} errors "
        f"{s['error_statuses'] or ''} in {s['duration_s']:.1f}s: {fmt(s['requests_per_s'])} req/s, "
        f"{fmt(s['output_tokens_per_s'])} output tok/s"
    )
    for metric in report.LATENCY_METRICS:
        values = " / ".join(fmt(s[f"{stat}_{metric}_ms"]) for stat in ("mean", "p50", "p99"))
        print(f"    {metric:>4} mean / p50 / p99 ms: {values}")
    if s.get("client_loop_lag_p99_ms") is not None:  # (the whole run's, not a group's)
        print(
            f"    client event loop late by p99 {fmt(s['client_loop_lag_p99_ms'])} ms, "
            f"max {fmt(s['client_loop_lag_max_ms'])} ms (part of the ITL above)"
        )
    if s.get("constrained_answers") is not None:
        print(
            f"    constrained answers: {s['constrained_answers']}, valid JSON {s['valid_json']}, "
            f"valid under their schema {'- (no jsonschema)' if s['schema_valid'] is None else s['schema_valid']}"
        )
    for key, groups in s.get("groups", {}).items():
        for value, group in groups.items():
            print_summary(group, f"{key}={value}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = asyncio.run(benchmark(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    group_by = results["config"]["group_by"]
    title = f"{args.workload} @ {args.url} ({results['config']['model']})"
    print_summary(results["summary"])
    try:
        report.plot(results["requests"], args.out.with_suffix(".png"), title, group_by[0] if group_by else None)
    except ImportError as exc:  # the results matter more than the picture: keep them and say so
        print(f"wrote {args.out}; no plot: {exc} (pip install '.[bench]')", file=sys.stderr)
        return
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
