"""The benchmark harness: summary maths on hand-made records, the SSE client against a scripted
server, every workload against the real stack, and the transformers baseline on the tiny model."""

from __future__ import annotations

import asyncio
import base64
import gzip
import io
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import jsonschema
import pytest
from aiohttp import web
from PIL import Image

from benchmarks import baseline_hf, gpu, media, prune_results, report, schemas, serve, workloads
from common.config import load_config
from tests.integration.conftest import REPO, Stack

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["--small", "--max-tokens-mean", "12", "--max-tokens-spread", "4", "--prompt-tokens", "80"]


def record(**fields: Any) -> dict[str, Any]:
    return {**serve.new_record(0, {}, 8, None), "status": 200, **fields}


# ------------------------------------------------------------------------------------ summary maths
def test_percentiles_and_mean() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    assert report.percentile(values, 50) == pytest.approx(5.5)
    assert report.percentile(values, 99) == pytest.approx(9.91)  # linear interpolation, as numpy/vLLM
    assert report.percentile([], 50) is None
    assert report.mean(values) == pytest.approx(5.5)
    assert report.mean([]) is None


def test_time_per_output_token_divides_by_tokens_not_chunks() -> None:
    # 1 s to the first token, then 9 more tokens in 0.9 s, however many chunks carried them.
    assert report.time_per_output_token(1.0, 1.9, 10) == pytest.approx(0.1)
    assert report.time_per_output_token(1.0, 1.0, 1) is None  # a single token has no decode phase
    assert report.time_per_output_token(None, 2.0, 10) is None


def test_isolation_compares_a_mixed_runs_text_streams_with_the_control(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stream = {"itl_s": [0.01] * 9 + [0.03], "e2e_s": 1.0, "tpot_s": 0.01, "output_tokens": 11, "prompt_tokens": 5}
    slow = {**stream, "itl_s": [0.01] * 9 + [0.06]}
    mixed = [record(start_s=0.0, end_s=2.0, ttft_s=0.2, tags={"stream_kind": "text"}, **slow)]
    mixed.append(record(start_s=0.0, end_s=1.0, ttft_s=0.5, tags={"stream_kind": "vision"}, **stream))
    control = [record(start_s=0.0, end_s=1.0, ttft_s=0.1, tags={"stream_kind": "text"}, **stream)]
    paths = []
    for name, records, duration in (("mixed.json.gz", mixed, 2.0), ("control.json", control, 1.0)):
        run = {"config": {"group_by": ["stream_kind"]}, "requests": records}
        run["summary"] = report.summarize_run(records, duration, ["stream_kind"])
        raw = json.dumps(run).encode()
        (tmp_path / name).write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)  # as committed
        paths.append(str(tmp_path / name))
    report.main([paths[0], "--control", paths[1]])
    result = json.loads(capsys.readouterr().out)
    assert result["throughput_share"] == pytest.approx(0.5)  # 11 tokens over 2 s against over 1 s
    p99 = report.percentile(slow["itl_s"], 99), report.percentile(stream["itl_s"], 99)
    assert result["itl_p99_ratio"] == pytest.approx(p99[0] / p99[1])
    assert result["ttft_mean_ratio"] == pytest.approx(2.0)  # the vision stream's 0.5 s does not count


def test_summary_counts_failures_and_splits_groups() -> None:
    text = {"ttft_s": 0.1, "itl_s": [0.1, 0.3], "e2e_s": 1.0, "tpot_s": 0.3, "output_tokens": 4, "prompt_tokens": 10}
    image = {"ttft_s": 0.5, "itl_s": [0.2], "e2e_s": 1.5, "tpot_s": 1.0, "output_tokens": 2, "prompt_tokens": 30}
    records = [
        record(start_s=0.0, end_s=1.0, tags={"stream_kind": "text"}, **text),
        record(start_s=0.5, end_s=2.0, tags={"stream_kind": "vision"}, **image),
        record(start_s=1.0, end_s=1.2, status=400, error="bad", tags={"stream_kind": "vision"}),
        record(start_s=1.0, end_s=1.5, status=None, error="ClientConnectorError", tags={"stream_kind": "vision"}),
    ]
    summary = report.summarize_run(records, duration_s=2.0, group_by=["stream_kind"])
    assert (summary["requests"], summary["completed"], summary["errors"]) == (4, 2, 2)
    assert summary["error_statuses"] == {"400": 1, "no_response": 1}
    assert summary["requests_per_s"] == pytest.approx(1.0)
    assert summary["output_tokens_per_s"] == pytest.approx(3.0)
    assert summary["total_prompt_tokens"] == 40
    assert summary["mean_ttft_ms"] == pytest.approx(300.0)
    assert summary["p50_itl_ms"] == pytest.approx(200.0)
    assert summary["p99_itl_ms"] == pytest.approx(298.0)
    assert summary["mean_tpot_ms"] == pytest.approx(650.0)
    assert summary["p50_e2e_ms"] == pytest.approx(1250.0)
    text, vision = summary["groups"]["stream_kind"]["text"], summary["groups"]["stream_kind"]["vision"]
    assert (text["requests"], text["errors"], vision["requests"], vision["errors"]) == (1, 0, 3, 2)
    assert text["duration_s"] == pytest.approx(1.0)  # a group's own span
    assert text["p99_itl_ms"] == pytest.approx(298.0)


def test_empty_summary_has_nulls_not_crashes() -> None:
    summary = report.summarize([record(start_s=0.0, end_s=0.1, status=400, error="no video")], duration_s=0.1)
    assert summary["completed"] == 0 and summary["p99_ttft_ms"] is None and summary["requests_per_s"] == 0.0


def test_token_timeline_conserves_tokens() -> None:
    records = [record(start_s=0.0, end_s=2.0, ttft_s=0.5, itl_s=[0.5, 0.5, 0.5], e2e_s=2.0, output_tokens=8)]
    xs, rates = report.token_timeline(records, bin_s=0.5)
    assert len(xs) == len(rates) and sum(rates) * 0.5 == pytest.approx(8.0)


def test_poisson_arrivals_are_seeded() -> None:
    times = serve.arrival_times(2000, rate=4.0, seed=3)
    assert times == serve.arrival_times(2000, rate=4.0, seed=3) != serve.arrival_times(2000, rate=4.0, seed=4)
    assert times[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(times))
    assert 2000 / times[-1] == pytest.approx(4.0, rel=0.1)


# ------------------------------------------------------------------------------------ workloads
def test_workloads_are_deterministic_and_fresh() -> None:
    opts = workloads.WorkloadOptions(seed=5, image_scale=0.1)
    first = workloads.seed3img_request(opts, 0)
    assert first == workloads.seed3img_request(opts, 0)
    urls = [p["image_url"]["url"] for p in first.messages[0]["content"] if p["type"] == "image_url"]
    later = [p["image_url"]["url"] for p in workloads.seed3img_request(opts, 1).messages[0]["content"][:3]]
    assert len(urls) == 3 and not set(urls) & set(later)  # new images every request
    assert all(u.startswith(("data:image/png;base64,", "data:image/jpeg;base64,")) for u in urls)
    assert 88 <= first.max_tokens <= 152
    pooled = workloads.WorkloadOptions(seed=5, image_scale=0.1, repeat_media=True, media_pool=2)
    assert workloads.seed3img_request(pooled, 0).messages == workloads.seed3img_request(pooled, 2).messages


def test_full_size_images_are_realistic() -> None:
    opts = workloads.WorkloadOptions(seed=1)
    sizes = []
    for index in range(4):
        for part in workloads.seed3img_request(opts, index).messages[0]["content"][:3]:
            url = part["image_url"]["url"]
            image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
            sizes.append((url[5:15], image.size))
    for mime, (w, h) in sizes:
        if mime.startswith("image/png"):
            assert w * h <= 800_000
        else:
            assert 640 <= w <= 1920 and 480 <= h <= 1080
    assert {m[:9] for m, _ in sizes} == {"image/png", "image/jpe"}


def test_loop_lag_sees_a_blocked_event_loop() -> None:
    """The client's own lateness: a loop blocked for 50 ms shows a lag of at least that much."""

    async def run() -> dict[str, float | None]:
        lag = serve.LoopLag()
        lag.start()
        await asyncio.sleep(0.02)
        time.sleep(0.05)  # what a slow callback (a large JSON, a big image) does to every stream's timing
        await asyncio.sleep(0.02)
        lag.stop()
        return lag.summary()

    summary = asyncio.run(run())
    assert summary["client_loop_lag_max_ms"] is not None and summary["client_loop_lag_max_ms"] >= 45


def test_fixed_size_images_match_the_vllm_rows() -> None:
    """``--image-size 768x1024``: every image a JPEG photo of that size, as in ANCHORS' vLLM runs."""
    args = ["--workload", "seed3img", "--concurrency", "1"]
    opts = workloads.WorkloadOptions.from_args(serve.parse_args([*args, "--image-size", "768x1024"]))
    for index in range(2):
        for part in workloads.seed3img_request(opts, index).messages[0]["content"][:3]:
            url = part["image_url"]["url"]
            assert url.startswith("data:image/jpeg")
            assert Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).size == (768, 1024)
    for bad in ("768", "768x0", "axb"):
        with pytest.raises(SystemExit):
            serve.parse_args([*args, "--image-size", bad])


def test_mjpeg_avi_decodes() -> None:
    decord = pytest.importorskip("decord")
    frames = media.video_frames(64, 48, 5, seed=2)
    avi = media.mjpeg_avi([media.jpeg_bytes(f) for f in frames], 64, 48, fps=2)
    video = decord.VideoReader(io.BytesIO(avi))
    assert len(video) == 5 and video.get_avg_fps() == pytest.approx(2.0)
    assert video[4].shape == (48, 64, 3)


# ------------------------------------------------------------------------------------ the SSE client
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
T = TypeVar("T")


def with_server(handler: Handler, use: Callable[[str], Awaitable[T]]) -> T:
    """``use(base_url)`` against a scripted in-process server answering chat completions with ``handler``."""

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    async def go() -> T:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            return await use(f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def run_client(handler: Handler) -> tuple[dict[str, Any], str]:
    """One request through ``serve.Client``."""

    async def use(url: str) -> tuple[dict[str, Any], str]:
        async with aiohttp.ClientSession() as http:
            return await serve.Client(http, url, {}, 0.0).chat(serve.Prepared(b"{}", 4, {"k": "v"}))

    return with_server(handler, use)


def sse_handler(events: list[bytes], gaps_s: float = 0.02) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
            await asyncio.sleep(gaps_s)
        await response.write_eof()
        return response

    return handler


def chunk(content: str | None = None, role: bool = False, finish: str | None = None) -> bytes:
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
    if content is not None:
        delta["content"] = content
    return b"data: " + json.dumps({"choices": [{"delta": delta, "finish_reason": finish}]}).encode() + b"\n\n"


USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}\n\n'
DONE = b"data: [DONE]\n\n"


def test_client_times_content_chunks_and_reads_usage() -> None:
    events = [
        b": keep-alive\n\n",
        chunk(role=True),
        chunk("He"),
        chunk("llo"),
        chunk(" wor"),
        chunk("ld", finish="length"),
    ]
    rec, text = run_client(sse_handler([*events, USAGE, DONE]))
    assert text == "Hello world" and rec["error"] is None and rec["status"] == 200
    assert (rec["prompt_tokens"], rec["output_tokens"], rec["chunks"]) == (7, 5, 4)
    assert len(rec["itl_s"]) == 3 and all(gap >= 0.015 for gap in rec["itl_s"])
    # TTFT is the first text, not the role-only chunk sent a gap earlier.
    assert rec["ttft_s"] >= 0.03 and rec["e2e_s"] >= rec["ttft_s"] + sum(rec["itl_s"])
    assert rec["tpot_s"] == pytest.approx((rec["e2e_s"] - rec["ttft_s"]) / 4)
    assert rec["tags"] == {"k": "v"}


def test_client_records_http_errors_in_band_errors_and_truncation() -> None:
    async def refuse(_request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "no such thing", "code": "invalid_value"}}, status=400)

    rec, _ = run_client(refuse)
    assert (rec["status"], rec["error"], rec["e2e_s"]) == (400, "no such thing", None)

    in_band = b'data: {"error": {"message": "the decoder restarted", "code": "unavailable"}}\n\n'
    rec, _ = run_client(sse_handler([chunk("a"), in_band, DONE]))
    assert rec["status"] == 200 and rec["error"] == "the decoder restarted"

    rec, _ = run_client(sse_handler([chunk("a"), chunk("b")]))
    assert rec["error"] == "the stream ended before [DONE]"


def test_client_waits_out_a_refusals_retry_after() -> None:
    async def busy(_request: web.Request) -> web.Response:
        error = {"error": {"message": "the decoder is not responding", "code": "unavailable"}}
        return web.json_response(error, status=503, headers={"Retry-After": "0.4"})

    started = time.monotonic()
    rec, _ = run_client(busy)
    assert (rec["status"], rec["error"]) == (503, "the decoder is not responding")
    assert time.monotonic() - started >= 0.4  # (the next request of a closed loop waits as OpenAI's clients do)

    async def bad(_request: web.Request) -> web.Response:  # a 400's Retry-After is not a reason to wait
        return web.json_response({"error": {"message": "no"}}, status=400, headers={"Retry-After": "5"})

    started = time.monotonic()
    assert run_client(bad)[0]["status"] == 400 and time.monotonic() - started < 4


def test_multiturn_sends_the_real_answers_and_counts_unsent_turns(tmp_path: Path) -> None:
    bodies: list[dict[str, Any]] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        if len(bodies) == 2:  # session 0's second turn (sessions run one at a time here)
            return web.json_response({"error": {"message": "scripted failure"}}, status=503)
        turn = (len(bodies[-1]["messages"]) + 1) // 2
        return await sse_handler([chunk(f"answer {turn}"), USAGE, DONE], gaps_s=0.0)(request)

    argv = ["--workload", "multiturn", "--concurrency", "1", "--num-requests", "2", "--out", str(tmp_path / "x.json")]
    results = with_server(answer, lambda url: serve.benchmark(serve.parse_args(["--url", url, *argv, *SMALL])))
    assert results["config"]["model"] == "scripted"  # from GET /v1/models
    assert all(b["model"] == "scripted" and b["ignore_eos"] and b["stream"] and b["temperature"] == 0 for b in bodies)
    assert len(bodies) == 5  # session 0's third turn was never sent
    session1 = bodies[2:]
    assert session1[1]["messages"][1:] == [
        {"role": "assistant", "content": "answer 1"},
        {"role": "user", "content": session1[1]["messages"][-1]["content"]},
    ]
    assert session1[2]["messages"][:3] == session1[1]["messages"]
    assert session1[2]["messages"][3] == {"role": "assistant", "content": "answer 2"}
    assert all(isinstance(m["content"], str) for b in session1 for m in b["messages"][1:])  # images in turn 1 only
    summary = results["summary"]
    assert (summary["requests"], summary["completed"], summary["errors"]) == (6, 4, 2)
    assert summary["error_statuses"] == {"503": 1, "not_sent": 1}
    assert summary["groups"]["turn"]["3"]["errors"] == 1


# ------------------------------------------------------------------------------------ the real stack
def bench(stack: Stack, tmp_path: Path, workload: str, *extra: str) -> dict[str, Any]:
    out = tmp_path / f"{workload}.json"
    argv = ["--url", stack.base_url, "--workload", workload, "--seed", "1", "--out", str(out), *SMALL, *extra]
    serve.main(argv)
    assert out.with_suffix(".png").read_bytes().startswith(PNG_MAGIC)
    return json.loads(out.read_text())


def check_document(results: dict[str, Any], workload: str) -> None:
    config, summary, records = results["config"], results["summary"], results["requests"]
    assert config["workload"] == workload and config["model"] == "qwen2-vl-tiny-seed0"
    assert "api_key" not in config and config["hostname"] and "git_revision" in config
    assert summary["requests"] == len(records) == summary["completed"] + summary["errors"]
    for key in ("requests_per_s", "output_tokens_per_s", "duration_s", "client_payload_wait_s", "max_start_lag_s"):
        assert key in summary
    assert summary["client_loop_lag_p99_ms"] is not None and summary["client_loop_lag_max_ms"] >= 0
    for metric in report.LATENCY_METRICS:
        for stat in ("mean", "p50", "p99"):
            assert f"{stat}_{metric}_ms" in summary
    for r in records:
        if r["error"] is not None:
            continue
        assert r["status"] == 200 and r["usage_reported"]
        if "valid_json" in r:  # a constrained answer (structured): its grammar ends it
            assert r["output_tokens"] < r["max_tokens"]
        else:
            assert r["output_tokens"] == r["max_tokens"]  # ignore_eos: exactly what was asked for
        # A chunk may carry several tokens, never fewer than one.
        assert 1 <= r["chunks"] <= r["output_tokens"] and len(r["itl_s"]) == r["chunks"] - 1
        assert 0 < r["ttft_s"] <= r["e2e_s"] and r["tpot_s"] is not None
        assert r["end_s"] >= r["start_s"] >= 0


def test_seed3img_closed_loop(stack: Stack, tmp_path: Path) -> None:
    results = bench(stack, tmp_path, "seed3img", "--concurrency", "2", "--num-requests", "4")
    check_document(results, "seed3img")
    assert results["summary"]["completed"] == 4 and results["summary"]["p50_ttft_ms"] > 0
    assert all(r["prompt_tokens"] > 30 for r in results["requests"])  # three images' worth of tokens


def test_text_open_loop_as_a_subprocess(stack: Stack, tmp_path: Path) -> None:
    out = tmp_path / "text.json"
    argv = [
        "--url",
        stack.base_url,
        "--workload",
        "text",
        "--seed",
        "1",
        "--rate",
        "20",
        "--num-requests",
        "3",
        "--out",
        str(out),
    ]
    subprocess.run([sys.executable, "-m", "benchmarks.serve", *argv, *SMALL], cwd=REPO, check=True, timeout=120)
    results = json.loads(out.read_text())
    check_document(results, "text")
    assert results["summary"]["completed"] == 3
    assert [r["scheduled_s"] for r in results["requests"]] == serve.arrival_times(3, 20.0, 1)
    assert all(60 <= r["prompt_tokens"] <= 100 for r in results["requests"])  # --prompt-tokens 80


def test_gpu_driver_serve_part_keeps_a_summary_and_raw_data(stack: Stack, tmp_path: Path) -> None:
    """`benchmarks.gpu serve --url` against a running server: the summary JSON without per-request records
    and summary.md in the result folder, the full JSON under raw/ (git-ignored)."""
    argv = ["serve", "--url", stack.base_url, "--result-dir", str(tmp_path), "--workloads", "seed3img", "--clients",
            "2", "--requests", "2", "--time-limit", "60", "--client-args", " ".join(SMALL)]  # fmt: skip
    subprocess.run([sys.executable, "-m", "benchmarks.gpu", *argv], cwd=REPO, check=True, timeout=180)
    summary = json.loads((tmp_path / "seed3img-c2.json").read_text())
    assert summary["summary"]["completed"] == 2 and "requests" not in summary
    assert len(json.loads((tmp_path / "raw" / "seed3img-c2.json").read_text())["requests"]) == 2
    record = (tmp_path / "summary.md").read_text()
    assert "benchmarks.gpu serve" in record and "seed3img-c2" in record
    assert json.loads((tmp_path / "machine.json").read_text())["command"].startswith("python3 -m benchmarks.gpu")


def test_gpu_driver_workloads_have_seeds_of_their_own() -> None:
    argvs = [argv for w in gpu.SERVE_WORKLOADS for _, argv in gpu.workload_argv(w, 32, None)]
    seeds = [argv[argv.index("--seed") + 1] for argv in argvs]
    assert len(seeds) == len(set(seeds))
    assert gpu.workload_argv("seed3img", 32, None)[0][0] == "seed3img-c32"


def test_prune_results_keeps_summaries_and_cited_lines(tmp_path: Path) -> None:
    run = tmp_path / "2026-01-01-h200-x-abc1234"
    (run / "c1").mkdir(parents=True)
    (run / "README.md").write_text("Decode steps in `c1/times.log`; errors none.\n")
    (run / "c1" / "times.log").write_text("decode 32x1100: 2.250 ms\n")
    (run / "c1" / "decoder.log").write_text("step line\n" * 1000)
    (run / "c1" / "mixed.top").write_text("top\n")
    with gzip.open(run / "c1" / "mixed.json.gz", "wt") as f:
        json.dump({"config": {"workload": "mixed"}, "summary": {"p99_itl_ms": 5.0}, "requests": [{"itl_s": [0.1]}]}, f)
    prune_results.prune(run)
    assert sorted(p.name for p in run.rglob("*") if p.is_file()) == ["README.md", "mixed.json", "summary.md"]
    assert json.loads((run / "c1" / "mixed.json").read_text()) == {
        "config": {"workload": "mixed"},
        "summary": {"p99_itl_ms": 5.0},
    }
    assert "decode 32x1100: 2.250 ms" in (run / "summary.md").read_text()


def test_multiturn_carries_answers(stack: Stack, tmp_path: Path) -> None:
    results = bench(stack, tmp_path, "multiturn", "--concurrency", "2", "--num-requests", "2")
    check_document(results, "multiturn")
    sessions: dict[int, list[dict[str, Any]]] = {}
    for r in results["requests"]:
        sessions.setdefault(r["tags"]["session"], []).append(r)
    assert sorted(sessions) == [0, 1]
    for turns in sessions.values():
        turns.sort(key=lambda r: r["tags"]["turn"])
        assert [r["tags"]["turn"] for r in turns] == [1, 2, 3]
        assert turns[0]["end_s"] <= turns[1]["start_s"] and turns[1]["end_s"] <= turns[2]["start_s"]
        # Each turn's prompt holds the previous prompt, the answer and a follow-up.
        assert turns[0]["prompt_tokens"] + turns[0]["output_tokens"] < turns[1]["prompt_tokens"]
        assert turns[1]["prompt_tokens"] + turns[1]["output_tokens"] < turns[2]["prompt_tokens"]
    by_turn = results["summary"]["groups"]["turn"]
    assert sorted(by_turn) == ["1", "2", "3"] and all(g["requests"] == 2 for g in by_turn.values())


def test_video_workload_completes(stack: Stack, tmp_path: Path) -> None:
    results = bench(stack, tmp_path, "video", "--concurrency", "2", "--num-requests", "3")
    check_document(results, "video")
    summary = results["summary"]
    assert summary["requests"] == summary["completed"] == 3 and summary["errors"] == 0
    assert all(r["prompt_tokens"] > 100 for r in results["requests"])  # the frames' tokens are counted


def test_mixed_summarises_text_streams_apart(stack: Stack, tmp_path: Path) -> None:
    extra = ["--concurrency", "2", "--num-requests", "3", "--vision-rate", "10", "--vision-delay", "0.2"]
    results = bench(stack, tmp_path, "mixed", *extra, "--text-max-tokens", "24")
    check_document(results, "mixed")
    groups = results["summary"]["groups"]["stream_kind"]
    assert sorted(groups) == ["text", "vision"]
    assert groups["vision"]["requests"] == 3 and groups["text"]["requests"] >= 2
    assert groups["text"]["requests"] + groups["vision"]["requests"] == results["summary"]["requests"]
    assert groups["text"]["p99_itl_ms"] is not None
    text = [r for r in results["requests"] if r["tags"]["stream_kind"] == "text"]
    assert {r["tags"]["stream"] for r in text} == {0, 1} and all(r["max_tokens"] == 24 for r in text)


def test_mixed_control_sends_the_same_streams_and_no_images(stack: Stack, tmp_path: Path) -> None:
    extra = ["--concurrency", "2", "--num-requests", "3", "--vision-rate", "10", "--vision-delay", "0.2"]
    results = bench(stack, tmp_path, "mixed", *extra, "--text-max-tokens", "24", "--vision-off")
    check_document(results, "mixed")
    assert sorted(results["summary"]["groups"]["stream_kind"]) == ["text"]
    text = results["requests"]
    assert {r["tags"]["stream"] for r in text} == {0, 1} and all(r["error"] is None for r in text)


def test_structured_constrains_a_share_of_the_streams_and_checks_their_answers(stack: Stack, tmp_path: Path) -> None:
    """Two of four streams send JSON schemas: their answers end with the grammar, parse and validate (random
    weights: only the grammar can make them valid); the others run to their length. The control sends the same
    streams, none constrained."""
    extra = ["--concurrency", "4", "--num-requests", "8", "--text-max-tokens", "16", "--json-max-tokens", "400"]
    results = bench(stack, tmp_path, "structured", *extra, "--constrained-share", "0.5")
    check_document(results, "structured")
    summary, records = results["summary"], results["requests"]
    assert summary["requests"] == 8 and summary["errors"] == 0
    groups = summary["groups"]["stream_kind"]
    assert sorted(groups) == ["constrained", "unconstrained"]
    assert groups["constrained"]["p50_tpot_ms"] is not None and groups["unconstrained"]["p50_tpot_ms"] is not None
    constrained = [r for r in records if r["tags"]["stream_kind"] == "constrained"]
    assert {r["tags"]["stream"] for r in constrained} == {0, 1}
    assert {r["tags"]["stream"] for r in records} - {0, 1} == {2, 3}
    assert groups["constrained"]["requests"] == len(constrained) >= 2
    assert summary["constrained_answers"] == summary["valid_json"] == summary["schema_valid"] == len(constrained)
    for r in constrained:
        jsonschema.validate(json.loads(r["answer"]), schemas.SCHEMAS[r["tags"]["schema"]].schema)
    control = bench(stack, tmp_path, "structured", *extra, "--constrained-share", "0")
    check_document(control, "structured")
    assert sorted(control["summary"]["groups"]["stream_kind"]) == ["unconstrained"]
    assert control["summary"]["constrained_answers"] == 0 and control["summary"]["errors"] == 0


def test_hf_baseline(stack: Stack, tmp_path: Path) -> None:
    out = tmp_path / "hf.json"
    model_dir = load_config(stack.config_path).model_path()
    argv = ["--model", str(model_dir), "--batch-sizes", "1,2", "--num-requests", "2", "--seed", "1", "--out", str(out)]
    baseline_hf.main([*argv, "--device", "cpu", "--small", "--max-tokens-mean", "6", "--max-tokens-spread", "2"])
    results = json.loads(out.read_text())
    assert sorted(results["summary"]) == ["1", "2"]
    for size, summary in results["summary"].items():
        assert summary["requests"] == summary["completed"] == 2
        for key in ("output_tokens_per_s", "mean_ttft_ms", "p50_tpot_ms", "p99_e2e_ms", "p50_itl_ms"):
            assert summary[key] > 0, (size, key)
    batches = results["batches"]
    assert [b["batch_size"] for b in batches] == [1, 1, 2]
    assert all(len(b["itl_s"]) == b["new_tokens"] - 1 for b in batches)
    # The same prompts as the server was sent: seed3img request i with the same seed and scale.
    opts = workloads.WorkloadOptions(seed=1, image_scale=0.1, max_tokens_mean=6, max_tokens_spread=2)
    assert batches[2]["max_tokens"] == [workloads.seed3img_request(opts, i).max_tokens for i in range(2)]
