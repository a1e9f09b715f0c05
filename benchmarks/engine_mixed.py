"""The decoder engine alone under ANCHORS' `mixed` load: what image prompts cost running text streams when
no vision tower shares the GPU (no HTTP, no ViT, no sockets: their embeddings are ready-made rows).

    python -m benchmarks.engine_mixed --model DIR --out engine_mixed.json [--seconds 10] [--rate 6]
        [--media cpu|pinned|cuda] [--[no-]overlap] [--decoding-budget N] [--prefill-tiles SWEEP.json]
        [--step-s S] [--profile]

32 closed-loop text streams (1,000 prompt tokens, 256 out, each replaced when it ends) run for
``--seconds``, first alone (the control), then while 3-image requests (3 x 972 media tokens, 120 out)
arrive at ``--rate`` per second. The engine is the server's: its default budgets, CUDA graphs, overlap.
Reported: text tokens/s and their gaps (p50/p99, the streams' ITL), step times, vision requests done
and their TTFT, and the device time of the forwards split by kind (decode-only, or with prompt tokens,
with the cost of one more prompt token). ``--profile`` adds torch.profiler's GPU kernel table and
host-op table over one second of the mixed run. Needs a CUDA GPU; ``--device cpu`` runs a tiny version
(a smoke check of the harness, not a measurement). ``--step-s S`` replaces the wall clock by one that moves
S seconds per engine step, so that a window is a fixed number of steps whatever the machine's speed (how
the CPU check counts without depending on the machine's load).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.engine import add_decode_kernel_options, use_decode_kernel_options
from common.config import DecoderConfig
from common.protocol import PreparedMedia, PreparedRequest, SamplingParams
from workers.decoder import runner as runner_module
from workers.decoder.batch import Scheduled, Span, media_rows, positions, slots
from workers.decoder.config import EngineConfig
from workers.decoder.engine import Engine
from workers.decoder.graphs import StepInputs
from workers.kernels import attention_triton
from workers.models.language import LanguageModel
from workers.models.mrope import media_token_count
from workers.models.runtime import upload
from workers.models.spec import ModelSpec

IMAGE_GRID = [1, 54, 72]  # 768 x 1024 resized to 756 x 1008 (multiples of 28): 972 tokens


@dataclass
class Load:
    text_streams: int = 32
    text_prompt: int = 1000
    text_out: int = 256
    images_per_request: int = 3
    vision_prompt: int = 60  # the question's text tokens
    vision_out: int = 120
    rate: float = 6.0  # vision requests per second (0: the control)
    media_device: str = "cpu"  # where the rows sit, as the host pool leaves them ("cuda": the device pool)


@dataclass
class Window:
    """What one run saw: per text token its emission time; per step its wall time."""

    text_times: dict[str, list[float]] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)
    vision_done: int = 0
    vision_sent: int = 0
    vision_ttft_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0  # until the last step of the window returned (the abort drain excluded)


def per_span_embeddings(model: LanguageModel, spans: list[Span]) -> torch.Tensor:
    """A step's input embeddings as the engine built them before 14d3257: span by span (an upload, a
    lookup and an index copy each), then joined. ``--per-span-inputs`` puts it back, for an A/B."""
    parts = []
    for seq, start, end in spans:
        ids = torch.tensor(seq.token_ids(start, end), dtype=torch.int64)
        embeds = model.embed_tokens(upload(ids, model.device))
        if (found := media_rows(seq, start, end)) is not None:
            mask, rows = found
            at = upload(mask.nonzero().squeeze(1), embeds.device)
            embeds = embeds.index_copy(0, at, upload(rows, embeds.device).to(embeds.dtype))
        parts.append(embeds)
    return torch.cat(parts) if parts else model.embed_tokens.weight.new_empty((0, model.embed_tokens.weight.shape[1]))


def per_span_step_inputs(batch: list[Scheduled], rows: list[int], block_size: int) -> StepInputs:
    """A mixed graph's staged inputs as built before 14d3257: positions and slots span by span."""
    spans = [(b.seq, b.seq.num_computed, b.seq.num_computed + b.num_new) for b in batch]
    return StepInputs(
        positions=np.concatenate([positions(seq, a, b).numpy() for seq, a, b in spans], axis=1),
        slots=np.concatenate([slots(seq, a, b, block_size) for seq, a, b in spans]),
        query_lens=[b.num_new for b in batch],
        context_lens=[b.seq.num_computed + b.num_new for b in batch],
        block_tables=[b.seq.table.blocks for b in batch],
        rows=rows,
    )


def use_per_span_inputs() -> None:
    runner_module.step_embeddings = per_span_embeddings
    runner_module.step_inputs = per_span_step_inputs


def make_engine(
    model: LanguageModel,
    spec: ModelSpec,
    device: str,
    overlap: bool,
    decoding_budget: int | None = None,
    block_size: int | None = None,
) -> Engine:
    cfg = DecoderConfig()
    cuda = device == "cuda"
    block_size = block_size or cfg.block_size
    config = EngineConfig(
        max_model_len=8192,
        max_running=cfg.max_running,
        prefill_budget=cfg.prefill_tokens_per_step,
        decoding_budget=cfg.tokens_per_step_while_decoding if decoding_budget is None else decoding_budget,
        num_blocks=(192_000 if cuda else 32_000) // block_size,  # tokens of KV, whatever the block size
        block_size=block_size,
        prefix_cache=cfg.prefix_cache,
        fuse=cuda,
        graphs="cuda" if cuda else "off",
        graph_tokens=cfg.graph_tokens if cuda else 0,
        overlap=overlap,
    )
    return Engine(model, spec, config)


class Feeder:
    """Builds unique requests (fresh token ids, so the prefix cache never helps) and their media rows."""

    def __init__(self, spec: ModelSpec, load: Load, dtype: torch.dtype, seed: int) -> None:
        self.spec, self.load, self.dtype = spec, load, dtype
        self.rng = np.random.default_rng(seed)
        self.count = 0
        # One set of rows for every request: drawing them per request would take the engine loop's host time.
        self.rows = torch.randn(load.images_per_request * self._media_tokens(), spec.hidden_size).to(dtype)

    def _ids(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.integers(10, min(self.spec.vocab_size, 150000) - 1, size=n)]

    def text(self) -> PreparedRequest:
        self.count += 1
        params = SamplingParams(max_tokens=self.load.text_out, temperature=0.0, ignore_eos=True)
        return PreparedRequest(f"text-{self.count}", self._ids(self.load.text_prompt), [], params)

    def vision(self) -> tuple[PreparedRequest, torch.Tensor]:
        self.count += 1
        spec, n = self.spec, self.load.images_per_request
        ids: list[int] = []
        media = []
        for i in range(n):
            ids += [spec.vision_start_token_id, spec.image_token_id]
            ids += [] if spec.vision_end_token_id is None else [spec.vision_end_token_id]
            media.append(PreparedMedia("image", f"{self.count:032x}{i:032x}", IMAGE_GRID, self._media_tokens()))
        ids += self._ids(self.load.vision_prompt)
        params = SamplingParams(max_tokens=self.load.vision_out, temperature=0.0, ignore_eos=True)
        return PreparedRequest(f"vision-{self.count}", ids, media, params), self.rows

    def _media_tokens(self) -> int:
        return media_token_count(IMAGE_GRID, self.spec)


class StepTimer:
    """The device time of every forward the engine runs, with its shape: how many sequences, how many of its
    tokens are prompt (prefill chunks). CUDA events around `ModelRunner.run` (sampling is not included); on the
    CPU the forward is synchronous and the wall clock is its time."""

    def __init__(self, engine: Engine) -> None:
        self.cuda = engine.runner.model.device.type == "cuda"
        self.records: list[tuple[int, int, Any, Any]] = []
        run = engine.runner.run

        def timed(batch: list[Any], ahead_ids: torch.Tensor | None = None) -> Any:
            prompt = sum(item.num_new for item in batch if item.seq.num_computed < len(item.seq.prompt_ids))
            start = torch.cuda.Event(enable_timing=True) if self.cuda else time.perf_counter()
            if self.cuda:
                start.record()
            out = run(batch, ahead_ids)
            end = torch.cuda.Event(enable_timing=True) if self.cuda else time.perf_counter()
            if self.cuda:
                end.record()
            self.records.append((len(batch), prompt, start, end))
            return out

        engine.runner.run = timed  # type: ignore[method-assign]

    def take(self) -> list[tuple[int, int, float]]:
        """(sequences, prompt tokens, ms) of the forwards since the last call."""
        if self.cuda:
            torch.cuda.synchronize()
        records, self.records = self.records, []
        if self.cuda:
            return [(n, p, start.elapsed_time(end)) for n, p, start, end in records]
        return [(n, p, 1e3 * (end - start)) for n, p, start, end in records]


def forward_split(forwards: list[tuple[int, int, float]], seconds: float) -> dict[str, Any]:
    """Device time by kind of forward: decode-only ones, and those with prompt tokens (with a least-squares
    line of ms against prompt tokens: its slope is what one more prompt token costs a step)."""
    decode = [ms for _, p, ms in forwards if p == 0]
    prompt = [(p, ms) for _, p, ms in forwards if p > 0]
    out: dict[str, Any] = {
        "device_busy_share": sum(ms for *_, ms in forwards) / (1e3 * seconds),
        "decode_forwards": len(decode),
        "decode_ms_mean": float(np.mean(decode)) if decode else None,
        "decode_ms_share": sum(decode) / (1e3 * seconds),
        "prompt_forwards": len(prompt),
        "prompt_tokens": sum(p for p, _ in prompt),
        "prompt_ms_share": sum(ms for _, ms in prompt) / (1e3 * seconds),
        "mean_sequences": float(np.mean([n for n, *_ in forwards])) if forwards else None,
    }
    if len({p for p, _ in prompt}) > 1:
        slope, intercept = np.polyfit([p for p, _ in prompt], [ms for _, ms in prompt], 1)
        out["prompt_us_per_token"], out["prompt_ms_at_zero_tokens"] = 1e3 * float(slope), float(intercept)
    return out


class Clock:
    """The wall clock, or with ``step_s`` one that moves ``step_s`` seconds per engine step."""

    def __init__(self, step_s: float | None = None) -> None:
        self.step_s, self.steps = step_s, 0

    def now(self) -> float:
        return time.perf_counter() if self.step_s is None else self.steps * self.step_s

    def stepped(self) -> float:
        """The time once an engine step has returned."""
        self.steps += 1
        return self.now()


def run_window(
    engine: Engine, feeder: Feeder, seconds: float, rate: float, media_device: str, clock: Clock | None = None
) -> Window:
    """Closed-loop text streams plus open-loop vision arrivals for ``seconds`` of ``clock`` time (the wall's)."""
    clock = clock or Clock()
    seen = Window()
    sent_at: dict[str, float] = {}
    for _ in range(feeder.load.text_streams):
        engine.add(engine.prepare(feeder.text()))
    start = clock.now()
    next_vision = start
    while (now := clock.now()) - start < seconds:
        while rate > 0 and now >= next_vision:
            request, rows = feeder.vision()
            seq = engine.prepare(request)
            # A copy per request, as `gather_rows` makes one from the pool.
            seq.media_embeds = rows.pin_memory() if media_device == "pinned" else rows.to(media_device, copy=True)
            engine.add(seq)
            sent_at[request.request_id] = now
            seen.vision_sent += 1
            next_vision += 1.0 / rate
        deltas = engine.step()
        done = clock.stepped()
        seen.step_s.append(done - now)
        for delta in deltas:
            rid = delta.request_id
            if rid.startswith("text"):
                seen.text_times.setdefault(rid, []).extend([done] * len(delta.token_ids))
            elif rid in sent_at and delta.token_ids:
                seen.vision_ttft_s.append(done - sent_at.pop(rid))
            if delta.finish_reason is not None:
                if rid.startswith("text"):
                    engine.add(engine.prepare(feeder.text()))
                else:
                    seen.vision_done += 1
    seen.wall_s = clock.now() - start
    for rid in list(engine.scheduler.running) + [s.request_id for s in engine.scheduler.waiting]:
        engine.abort(rid)
    while engine.has_work():  # a pending step of aborted sequences: drain it
        engine.step()
    return seen


def summarise(seen: Window) -> dict[str, Any]:
    tokens = sum(len(t) for t in seen.text_times.values())
    gaps = np.concatenate([np.diff(t) for t in seen.text_times.values() if len(t) > 1] or [np.zeros(1)])
    steps = np.asarray(seen.step_s)
    return {
        "text_tokens_per_s": tokens / seen.wall_s,
        "text_itl_p50_ms": 1e3 * float(np.percentile(gaps, 50)),
        "text_itl_p99_ms": 1e3 * float(np.percentile(gaps, 99)),
        "steps": len(steps),
        "step_mean_ms": 1e3 * float(steps.mean()),
        "step_p99_ms": 1e3 * float(np.percentile(steps, 99)),
        "vision_sent": seen.vision_sent,
        "vision_done": seen.vision_done,
        "vision_ttft_mean_ms": 1e3 * float(np.mean(seen.vision_ttft_s)) if seen.vision_ttft_s else None,
    }


def profile_window(engine: Engine, feeder: Feeder, load: Load) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_window(engine, feeder, 1.0, load.rate, load.media_device)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=6.0)
    parser.add_argument("--media", default="cpu", choices=["cpu", "pinned", "cuda"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=DecoderConfig().overlap,
        help="[decoder] overlap (default: the server's default)",
    )
    parser.add_argument(
        "--decoding-budget",
        type=int,
        default=None,
        help="[decoder] tokens_per_step_while_decoding (default: the server's; 0: the prefill budget)",
    )
    parser.add_argument("--block-size", type=int, default=None, help="[decoder] block_size (default: the server's)")
    parser.add_argument(
        "--per-span-inputs", action="store_true", help="mixed steps' inputs built span by span, as before 14d3257"
    )
    parser.add_argument("--prefill-tiles", type=Path, help="the attention's prefill tiles: a bench_prefill JSON's best")
    add_decode_kernel_options(parser)
    parser.add_argument("--step-s", type=float, default=None, help="a clock of S seconds per engine step")
    parser.add_argument("--profile", action="store_true")
    return parser.parse_args(argv)


def use_prefill_tiles(sweep: Path) -> None:
    best = json.loads(sweep.read_text())["best_overall"]
    attention_triton.PREFILL_TILES = attention_triton.Tiles(**best)
    print(f"prefill tiles: {attention_triton.PREFILL_TILES}", flush=True)


def launch(grew: dict[str, float]) -> dict[str, float | None]:
    """The host's milliseconds building and launching a forward, per decode-graph step and per other step
    (`ModelRunner.run`'s counters over a window)."""
    decode, other = grew["decode_graph_steps"], grew["steps"] - grew["decode_graph_steps"]
    return {
        "decode_graph_ms": 1e3 * grew["decode_launch_s"] / decode if decode else None,
        "other_ms": 1e3 * grew["other_launch_s"] / other if other else None,
    }


def measure(engine: Engine, feeder: Feeder, seconds: float, step_s: float | None = None) -> dict[str, Any]:
    """The control window, then the mixed one, with the forwards of each split by kind."""
    timer = StepTimer(engine)
    results: dict[str, Any] = {}
    for name, rate in (("control", 0.0), ("mixed", feeder.load.rate)):
        timer.take()
        before = dict(engine.counters)
        seen = run_window(engine, feeder, seconds, rate, feeder.load.media_device, Clock(step_s))
        forwards = timer.take()  # (the abort drain's forwards are in it too: at most one step)
        grew = {key: engine.counters[key] - before.get(key, 0.0) for key in engine.counters}
        results[name] = summarise(seen) | {"forwards": forward_split(forwards, seen.wall_s), "launch": launch(grew)}
        print(name, json.dumps(results[name]), flush=True)
    control, mixed = results["control"], results["mixed"]
    results["text_share"] = mixed["text_tokens_per_s"] / control["text_tokens_per_s"]
    results["itl_p99_ratio"] = mixed["text_itl_p99_ms"] / control["text_itl_p99_ms"]
    print(f"text share {results['text_share']:.0%}, ITL p99 ratio {results['itl_p99_ratio']:.2f}", flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks.engine_mixed needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        sys.exit(2)
    if args.prefill_tiles:
        use_prefill_tiles(args.prefill_tiles)
    use_decode_kernel_options(args)
    if args.per_span_inputs:
        use_per_span_inputs()
    spec = ModelSpec.from_dir(args.model)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = LanguageModel.from_checkpoint(args.model, device=args.device, dtype=dtype)
    load = Load(rate=args.rate, media_device=args.media)
    if args.device == "cpu":
        load = Load(text_streams=2, text_prompt=20, text_out=4, vision_out=2, rate=args.rate, media_device="cpu")
    engine = make_engine(model, spec, args.device, args.overlap, args.decoding_budget, args.block_size)
    feeder = Feeder(spec, load, dtype, seed=0)
    warm_up = min(2.0, args.seconds)  # graphs, allocators
    run_window(engine, feeder, warm_up, load.rate, load.media_device, Clock(args.step_s))
    settings = {
        "overlap": args.overlap,
        "decoding_budget": args.decoding_budget,
        "block_size": engine.config.block_size,
        "per_span_inputs": args.per_span_inputs,
        "decode_tiles": str(args.decode_tiles),
    }
    results = {"model": str(args.model), "load": load.__dict__, "seconds": args.seconds, **settings}
    results |= {"prefill_tiles": str(args.prefill_tiles)} | measure(engine, feeder, args.seconds, args.step_s)
    args.out.write_text(json.dumps(results, indent=1))
    if args.profile and args.device == "cuda":
        profile_window(engine, feeder, load)


if __name__ == "__main__":
    main()
