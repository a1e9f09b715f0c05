"""Decode attention bandwidth: ``python -m benchmarks.kernels`` on a CUDA GPU.

Decode attention reads every context token's K and V once per step and does little arithmetic, so its
speed is the bytes it reads over the time it takes; this prints that rate against the H200's 4.8 TB/s of
HBM bandwidth for the Qwen2-VL 2B and 7B attention shapes (bf16, block size 16, shuffled block tables).

Two timings per case:
- ``graph us``: the kernel alone. Calls are captured in a CUDA graph (no Python or launch overhead), each
  on its own copy of the cache, with enough copies that together they overflow the L2 cache: every call
  reads its K/V from HBM, as a real decode step (28 layers, each its own cache) does. GB/s comes from this.
- ``eager us``: one plain call as the decoder makes it today (median of `triton.testing.do_bench`), so
  Python and launch overhead show against the kernel time.

``--splits-sweep`` times every split count for each case (``*`` marks the heuristic's): that is how to
tune `choose_num_splits`. ``--tiles-sweep`` times every decode tile shape of a small grid with the server's
own split plan (each launch checked against the fp32 reference first; ``*`` marks `DECODE_TILES`), and
prints the shape with the least time over all cases: that is how to choose `DECODE_TILES`. ``--reference``
adds the per-sequence SDPA reference's eager time.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from workers.kernels.attention import AttentionMetadata, paged_attention_triton
from workers.models.paged import BatchLayout, paged_attention_reference

PEAK_BYTES_PER_S = 4.8e12  # H200 HBM3e
L2_OVERFLOW_BYTES = 256 << 20  # well past the H200's 50 MB L2: the copies' K/V never stay cached
GRAPH_REPLAYS = 20
GEOMETRIES = {"2b": (12, 2, 128), "7b": (28, 4, 128)}  # heads, kv_heads, head_dim


@dataclass(frozen=True)
class Case:
    model: str
    batch: int
    context: int

    @property
    def geometry(self) -> tuple[int, int, int]:
        return GEOMETRIES[self.model]

    @property
    def kv_bytes(self) -> int:
        _, kv_heads, head_dim = self.geometry
        return 2 * self.batch * self.context * kv_heads * head_dim * 2  # K and V, bf16


@dataclass
class DecodeInputs:
    q: torch.Tensor
    kv_k: torch.Tensor  # [copies, slots, kv_heads, D]
    kv_v: torch.Tensor
    layout: BatchLayout
    metadata: AttentionMetadata
    bytes_read: int  # by one call

    @property
    def copies(self) -> int:
        return self.kv_k.shape[0]


def decode_inputs(case: Case, block_size: int, device: torch.device, seed: int = 0) -> DecodeInputs:
    heads, kv_heads, head_dim = case.geometry
    per_seq = -(-case.context // block_size)
    num_blocks = case.batch * per_seq + 8
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)  # scattered blocks, as a long-running server's are
    tables = [pool[i * per_seq : (i + 1) * per_seq] for i in range(case.batch)]
    layout = BatchLayout.build([1] * case.batch, [case.context] * case.batch, tables, block_size, device)
    copies = max(1, -(-L2_OVERFLOW_BYTES // case.kv_bytes))
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (copies, num_blocks * block_size, kv_heads, head_dim)
    kv_k = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
    kv_v = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
    q = torch.randn((case.batch, heads, head_dim), generator=g, device=device, dtype=torch.bfloat16)
    qo_bytes = 2 * q.numel() * q.element_size()
    table_bytes = case.batch * per_seq * 4
    metadata = AttentionMetadata.from_layout(layout, device)
    return DecodeInputs(q, kv_k, kv_v, layout, metadata, case.kv_bytes + qo_bytes + table_bytes)


def graph_us(inputs: DecodeInputs, scale: float, splits: int) -> float:
    """Kernel time of one call: a CUDA graph of one call per cache copy, replayed, divided out."""

    def calls() -> None:
        for i in range(inputs.copies):
            paged_attention_triton(inputs.q, inputs.kv_k[i], inputs.kv_v[i], inputs.metadata, scale, num_splits=splits)

    return graph_replay_us(calls) / inputs.copies


def tile_grid() -> list[Any]:
    """Decode tile shapes to try: keys per step, and the compiler's warps and pipeline stages (the rows
    stay 16, a tensor-core tile; `plan` widens them to the head group)."""
    from workers.kernels.attention_triton import Tiles

    shapes = ((1, 1), (2, 2), (4, 2), (4, 3), (4, 4), (8, 2), (8, 3))
    grid = itertools.product((16, 32, 64, 128), shapes)
    return [Tiles(16, block_n, warps, stages) for block_n, (warps, stages) in grid]


def checked_graph_us(
    label: str, answer: Callable[[], torch.Tensor], expected: torch.Tensor, timed: Callable[[], object], per: int = 1
) -> float:
    """Graph-timed microseconds of ``timed()`` (divided by ``per``, the calls it makes) once ``answer()`` is
    within bf16 tolerance of the fp32 ``expected``; inf, and why printed, for a launch the compiler refuses
    (shared memory) or one that answers wrong: not a candidate."""
    try:
        error = (answer().float() - expected).abs().max().item()
        if error > 0.05:  # bf16 inputs and probabilities: a few 1e-3 when right
            raise ArithmeticError(f"max error {error:.3g} against the fp32 reference")
        return graph_replay_us(timed) / per
    except Exception as exc:
        print(f"{label}: {type(exc).__name__}: {exc}", flush=True)
        return float("inf")


def tile_times(inputs: DecodeInputs, scale: float, grid: list[Any]) -> dict[Any, float]:
    """Kernel microseconds of each tile shape with the server's split plan (inf: not a candidate)."""
    q, kv_k, kv_v, metadata = inputs.q, inputs.kv_k, inputs.kv_v, inputs.metadata
    expected = paged_attention_reference(q.float(), kv_k[0].float(), kv_v[0].float(), inputs.layout, scale)
    times = {}
    for tiles in grid:

        def calls(t: Any = tiles) -> None:
            for i in range(inputs.copies):
                paged_attention_triton(q, kv_k[i], kv_v[i], metadata, scale, tiles=t)

        def answer(t: Any = tiles) -> torch.Tensor:
            return paged_attention_triton(q, kv_k[0], kv_v[0], metadata, scale, tiles=t)

        times[tiles] = checked_graph_us(f"  {tiles}", answer, expected, calls, inputs.copies)
    return times


def run_tiles_sweep(cases: Sequence[Case], block_size: int, device: torch.device) -> dict[str, Any]:
    """Each case's time at every tile shape, then the shape with the least total time: the report that
    ``--out`` writes (``best`` is what ``benchmarks.engine --decode-tiles`` takes)."""
    from workers.kernels.attention_triton import DECODE_TILES

    grid = tile_grid()
    totals = dict.fromkeys(grid, 0.0)
    for case in cases:
        inputs = decode_inputs(case, block_size, device)
        times = tile_times(inputs, case.geometry[2] ** -0.5, grid)
        for tiles, us in sorted(times.items(), key=lambda item: item[1]):
            rate = inputs.bytes_read / (us * 1e-6)
            mark = "*" if tiles == DECODE_TILES else ""
            print(
                f"{case.model:>5} {case.batch:>5} {case.context:>7} {tiles.block_n:>4} {tiles.num_warps:>2} "
                f"{tiles.num_stages:>2}{mark:1} {us:>9.1f} {rate / 1e9:>7.0f} {100 * rate / PEAK_BYTES_PER_S:>6.1f}%"
            )
            totals[tiles] += us
        torch.cuda.empty_cache()
    best = min(totals, key=totals.__getitem__)
    print(f"best over all cases: {best}: {totals[best]:.1f} us in all (DECODE_TILES {totals[DECODE_TILES]:.1f})")
    return {
        "device": torch.cuda.get_device_name(device),
        "cases": [asdict(case) for case in cases],
        "default": asdict(DECODE_TILES),
        "default_total_us": totals[DECODE_TILES],
        "best": asdict(best),
        "best_total_us": totals[best],
        "totals": [{**asdict(tiles), "total_us": us} for tiles, us in totals.items()],
    }


def graph_replay_us(fn: Callable[[], object], replays: int = GRAPH_REPLAYS) -> float:
    """Device time of one ``fn()``: captured once in a CUDA graph (run once before, outside it, so that
    kernels compile there), then replayed ``replays`` times between two events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def eager_us(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median")) * 1e3


def run(cases: Sequence[Case], block_size: int, splits_sweep: bool, with_reference: bool, device: torch.device) -> None:
    from workers.kernels.attention_triton import sm_count

    sms = sm_count(device)
    print(f"{torch.cuda.get_device_name(device)}: {sms} SMs; peak {PEAK_BYTES_PER_S / 1e12:.1f} TB/s assumed")
    print(
        f"{'model':>5} {'batch':>5} {'context':>7} {'splits':>6} {'MB read':>8} {'graph us':>9} {'GB/s':>7} "
        f"{'% peak':>7} {'eager us':>9}"
    )
    for case in cases:
        run_case(case, decode_inputs(case, block_size, device), sms, splits_sweep, with_reference)
        torch.cuda.empty_cache()


def run_case(case: Case, inputs: DecodeInputs, sms: int, splits_sweep: bool, with_reference: bool) -> None:
    from workers.kernels.attention_triton import choose_num_splits

    scale = case.geometry[2] ** -0.5
    auto = choose_num_splits(case.batch * case.geometry[1], case.context, sms)
    for splits in [1, 2, 4, 8, 16, 32] if splits_sweep else [auto]:
        kernel_us = graph_us(inputs, scale, splits)
        eager = eager_us(
            functools.partial(
                paged_attention_triton,
                inputs.q,
                inputs.kv_k[0],
                inputs.kv_v[0],
                inputs.metadata,
                scale,
                num_splits=splits,
            )
        )
        rate = inputs.bytes_read / (kernel_us * 1e-6)
        mark = "*" if splits == auto and splits_sweep else ""
        print(
            f"{case.model:>5} {case.batch:>5} {case.context:>7} {str(splits) + mark:>6} "
            f"{inputs.bytes_read / 1e6:>8.1f} {kernel_us:>9.1f} {rate / 1e9:>7.0f} "
            f"{100 * rate / PEAK_BYTES_PER_S:>6.1f}% {eager:>9.1f}"
        )
    if with_reference:
        reference = functools.partial(
            paged_attention_reference, inputs.q, inputs.kv_k[0], inputs.kv_v[0], inputs.layout, scale
        )
        print(f"{'(per-sequence SDPA reference)':>62} {eager_us(reference):>9.1f}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="2b,7b", help="comma-separated: 2b, 7b")
    parser.add_argument("--batches", default="1,32,64")
    parser.add_argument("--contexts", default="1024,3072")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--splits-sweep", action="store_true", help="time every split count")
    parser.add_argument("--tiles-sweep", action="store_true", help="time every decode tile shape of a grid")
    parser.add_argument("--out", type=Path, help="with --tiles-sweep: write its report (JSON) here")
    parser.add_argument("--reference", action="store_true", help="also time the plain-torch reference")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    cases = [
        Case(model, int(batch), int(context))
        for model in args.models.split(",")
        for batch in args.batches.split(",")
        for context in args.contexts.split(",")
    ]
    unknown = sorted({c.model for c in cases} - set(GEOMETRIES))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {sorted(GEOMETRIES)}")
    with torch.inference_mode():
        if args.tiles_sweep:
            print(
                f"{'model':>5} {'batch':>5} {'context':>7} {'keys':>4} {'w':>2} {'s':>2}  {'graph us':>9} "
                f"{'GB/s':>7} {'% peak':>7}"
            )
            report = run_tiles_sweep(cases, args.block_size, torch.device("cuda"))
            if args.out:
                args.out.write_text(json.dumps(report, indent=1))
            return 0
        run(cases, args.block_size, args.splits_sweep, args.reference, torch.device("cuda"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
