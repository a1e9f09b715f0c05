"""The gateway alone under a decoder's token stream: the CPU it spends per token, and how many tokens it
merges into one SSE chunk, at a chosen step rate. Runs anywhere (no model forward); the numbers are this
machine's.

    python -m benchmarks.gateway_load [--streams 32] [--step-ms 3] [--seconds 10] [--max-tokens 256]

The real gateway process (`python -m gateway`, its own port and run directory) serves HTTP streaming
clients (aiohttp, `stream: true`: `/v1/completions` with token-id prompts, or `--api chat/completions`).
In this process a stand-in decoder speaks the decoder's side of the wire: it heartbeats, takes each
`PreparedRequest`, and every ``--step-ms`` sends one `TokenBatch` with one token for every live request,
as the engine does at one step per interval, until ``--max-tokens``. The figures: gateway CPU time
(user + system, from /proc) per token delivered, tokens per SSE chunk over the requests that ended in
the window (1.0 when the gateway keeps up with every step), and the gaps between a stream's chunks
against the step interval.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import zmq

from common.config import REPO_ROOT, load_config
from common.protocol import Abort, PreparedRequest, TokenBatch, TokenDelta, WorkerStatus, decode, encode

# Token ids of ordinary text for the demo tokenizer (any ids below its vocabulary decode to something).
ANSWER_IDS = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13, 576, 5562, 374, 537, 5023, 11]


class StandInDecoder:
    """The decoder's wire contract and nothing else: one token per live request per step."""

    def __init__(self, endpoints: tuple[str, str], step_s: float, heartbeat_s: float) -> None:
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(endpoints[0])
        self.results = self.ctx.socket(zmq.PUSH)
        self.results.connect(endpoints[1])
        self.step_s, self.heartbeat_s = step_s, heartbeat_s
        self.live: dict[str, tuple[int, int, int]] = {}  # request id -> (prompt tokens, emitted, max tokens)
        self.tokens_sent = 0
        self.steps = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        status = encode(WorkerStatus("decoder", "decoder", uuid.uuid4().hex, 1 << 20))  # replica 0's name
        next_step = next_beat = time.monotonic()
        while not self.stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self.results.send(status)
                next_beat = now + self.heartbeat_s
            if now >= next_step:
                self.step()
                next_step += self.step_s
                if next_step < now:  # fell behind (this process is busy too): do not burst to catch up
                    next_step = now + self.step_s
            if self.inbox.poll(max(0.0, min(next_step, next_beat) - time.monotonic()) * 1e3):
                self.take(decode(self.inbox.recv()))
        self.inbox.close(0)
        self.results.close(0)
        self.ctx.term()

    def take(self, msg: Any) -> None:
        if isinstance(msg, PreparedRequest):
            self.live[msg.request_id] = (len(msg.prompt_ids), 0, msg.sampling.max_tokens)
        elif isinstance(msg, Abort):
            self.live.pop(msg.request_id, None)

    def step(self) -> None:
        if not self.live:
            return
        deltas = []
        for rid, (prompt, emitted, limit) in list(self.live.items()):
            emitted += 1
            done = emitted >= limit
            token = ANSWER_IDS[emitted % len(ANSWER_IDS)]
            deltas.append(TokenDelta(rid, [token], "length" if done else None, prompt, emitted))
            if done:
                del self.live[rid]
            else:
                self.live[rid] = (prompt, emitted, limit)
        self.results.send(encode(TokenBatch(deltas)))
        self.tokens_sent += len(deltas)
        self.steps += 1


class StreamStats:
    def __init__(self) -> None:
        self.requests = 0
        self.gaps: list[float] = []
        self.errors: list[str] = []
        # Requests that ended inside the measured window, and their chunks: each carried exactly max_tokens
        # tokens (the stand-in sends that many), so their ratio has no window-edge error.
        self.window_open = False
        self.whole_requests = 0
        self.whole_request_chunks = 0


async def stream_forever(session: aiohttp.ClientSession, url: str, body: dict[str, Any], stats: StreamStats) -> None:
    while True:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                stats.errors.append(f"{response.status}: {(await response.text())[:200]}")
                await asyncio.sleep(0.1)  # a benchmark client backing off, not server code
                continue
            last, chunks = None, 0
            async for line in response.content:
                if not line.startswith(b"data: {") or b'"role"' in line:  # (chat's first chunk has no token)
                    continue
                now = time.perf_counter()
                if last is not None:
                    stats.gaps.append(now - last)
                last = now
                chunks += 1
        stats.requests += 1
        if stats.window_open:
            stats.whole_requests += 1
            stats.whole_request_chunks += chunks


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """The gateway answers /health once it has seen the stand-in's heartbeat (fetchers are not needed)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SystemExit(f"the gateway exited with {process.returncode}")
            try:
                async with session.get(url + "/health") as response:
                    if (await response.json()).get("decoder"):
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)  # start-up probe of a child process
    raise SystemExit("the gateway did not come up")


async def measure(args: argparse.Namespace, url: str, pid: int, decoder: StandInDecoder) -> dict[str, Any]:
    stats = StreamStats()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.get(url + "/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        body: dict[str, Any] = {"model": model, "max_tokens": args.max_tokens, "stream": True}
        if args.api == "chat/completions":
            body["messages"] = [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}]
        else:
            body["prompt"] = ANSWER_IDS * 8
        tasks = [
            asyncio.create_task(stream_forever(session, f"{url}/v1/{args.api}", body, stats))
            for _ in range(args.streams)
        ]

        def snapshot() -> tuple[float, float, int, int, int]:
            wall, cpu = time.perf_counter(), cpu_seconds(pid)
            return wall, cpu, decoder.tokens_sent, decoder.steps, len(stats.gaps)

        await asyncio.sleep(args.warmup)
        start = snapshot()
        stats.window_open = True
        await asyncio.sleep(args.seconds)
        stats.window_open = False
        end = snapshot()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    wall, cpu, tokens, steps = (e - s for e, s in zip(end[:4], start[:4], strict=True))
    gaps = np.asarray(stats.gaps[start[4] : end[4]]) * 1e3
    return {
        "streams": args.streams,
        "step_ms_asked": args.step_ms,
        "step_ms_run": 1e3 * wall / max(1, steps),
        "tokens_per_s": tokens / wall,
        "gateway_cpu_share": cpu / wall,
        "gateway_cpu_us_per_token": 1e6 * cpu / max(1, tokens),
        "tokens_per_chunk": stats.whole_requests * args.max_tokens / stats.whole_request_chunks
        if stats.whole_request_chunks
        else None,
        "whole_requests": stats.whole_requests,
        "chunk_gap_p50_ms": float(np.percentile(gaps, 50)) if gaps.size else None,
        "chunk_gap_p99_ms": float(np.percentile(gaps, 99)) if gaps.size else None,
        "errors": stats.errors[:5],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--step-ms", type=float, nargs="+", default=[3.0], help="decode step intervals to try")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--api", default="completions", choices=["completions", "chat/completions"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    results = []
    for step_ms in args.step_ms:
        args.step_ms = step_ms
        results.append(run_once(args))
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"argv": sys.argv[1:], "results": results}, indent=1))


def run_once(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="vlm-gateway-load-") as run_dir:
        env = {
            **os.environ,
            "VLM_PORT": str(port),
            "VLM_RUN_DIR": run_dir,
            "VLM_CONFIG": str(REPO_ROOT / "ops/vlm.toml"),
        }
        cfg = load_config(env=env)  # the gateway's own view of the config: the same endpoints
        decoder = StandInDecoder(
            (cfg.endpoint("decoder"), cfg.endpoint("gateway")), args.step_ms / 1e3, cfg.liveness.heartbeat_s
        )
        decoder.thread.start()
        process = subprocess.Popen([sys.executable, "-m", "gateway", "--log-level", "WARNING"], env=env, cwd=REPO_ROOT)
        url = f"http://127.0.0.1:{port}"
        try:
            asyncio.run(wait_healthy(url, process, 60.0))
            return asyncio.run(measure(args, url, process.pid, decoder))
        finally:
            process.terminate()
            process.wait(timeout=30)
            decoder.stop.set()
            decoder.thread.join(timeout=10)


if __name__ == "__main__":
    main()
