"""Prefill attention speed: ``python -m benchmarks.kernels_prefill [--out F.json]`` on a CUDA GPU.

The paged kernel's prefill launches (a prompt chunk, alone or with decodes in the same step) for the
Qwen2-VL 2B and 7B attention shapes, at every tile shape of a small grid (and forced key splits at the
default shape), against PyTorch's SDPA on the same queries with the keys laid out contiguously
(FlashAttention-2 where it runs: the speed a contiguous layout allows). Each launch is checked against
the fp32 reference first. Times are the kernel's alone: one call captured in a CUDA graph and replayed,
as the engine's steps run (a plain call's time also holds the host's launch path, which hides the differences
between shapes). Causal FLOPs over time gives
TFLOP/s. The best tile shape per case, and the one best over all cases (least total time), are printed
and written out: that is how `PREFILL_TILES` is chosen.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.kernels import GEOMETRIES, checked_graph_us, eager_us
from workers.kernels.attention import AttentionMetadata, paged_attention_reference, paged_attention_triton
from workers.models.paged import BatchLayout

BLOCK_SIZE = 16  # the server's default; --block-size tries others


@dataclass(frozen=True)
class PrefillCase:
    name: str
    model: str
    chunk: int  # new tokens of the prompt's chunk
    context: int  # the chunk's sequence's context after it (chunk included)
    decodes: int = 0  # decoding sequences in the same step
    decode_context: int = 1100

    def flops(self) -> float:
        heads, _, head_dim = GEOMETRIES[self.model]
        past = self.context - self.chunk
        keys = self.chunk * past + self.chunk * (self.chunk + 1) / 2 + self.decodes * self.decode_context
        return 4.0 * heads * head_dim * keys


CASES = [
    PrefillCase(f"{name}-{model}", model, chunk, context, decodes)
    for model in GEOMETRIES
    for name, chunk, context, decodes in (
        ("text-prompt", 1000, 1000, 0),
        ("image-first-chunk", 2048, 2048, 0),  # a 3-image prompt's first chunk at the default budget
        ("image-last-chunk", 1100, 3148, 0),
        ("chunk-with-decodes", 1984, 1984, 64),
    )
]


def inputs(
    case: PrefillCase, device: torch.device, block_size: int = BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    heads, kv_heads, head_dim = GEOMETRIES[case.model]
    query_lens = [case.chunk] + [1] * case.decodes
    context_lens = [case.context] + [case.decode_context] * case.decodes
    per_seq = [-(-c // block_size) for c in context_lens]
    pool = list(range(sum(per_seq)))
    random.Random(0).shuffle(pool)
    tables, at = [], 0
    for n in per_seq:
        tables.append(pool[at : at + n])
        at += n
    layout = BatchLayout.build(query_lens, context_lens, tables, block_size, device)
    g = torch.Generator(device=device).manual_seed(0)
    kv_k = torch.randn((len(pool) * block_size, kv_heads, head_dim), generator=g, device=device, dtype=torch.bfloat16)
    kv_v = torch.randn_like(kv_k)
    q = torch.randn((sum(query_lens), heads, head_dim), generator=g, device=device, dtype=torch.bfloat16)
    return q, kv_k, kv_v, AttentionMetadata.from_layout(layout, device)


def sdpa_us(case: PrefillCase, device: torch.device) -> float:
    """The prompt chunk alone through SDPA, keys contiguous, causal aligned to the chunk's end (a plain call,
    median of many: SDPA's launch path may not capture into a graph, so its figure includes the host's)."""
    from torch.nn.attention.bias import causal_lower_right

    heads, kv_heads, head_dim = GEOMETRIES[case.model]
    q = torch.randn((1, heads, case.chunk, head_dim), device=device, dtype=torch.bfloat16)
    k = torch.randn((1, kv_heads, case.context, head_dim), device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    mask = causal_lower_right(case.chunk, case.context)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    return eager_us(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def tile_grid() -> list[Any]:
    from workers.kernels.attention_triton import Tiles

    return [
        Tiles(block_m, block_n, warps, stages, heavy_first)
        for block_m, block_n, (warps, stages), heavy_first in itertools.product(
            (32, 64, 128), (32, 64, 128), ((4, 2), (8, 3)), (False, True)
        )
    ]


SPLITS = (2, 4, 8)  # forced at the default tile shape (the heuristic never splits a prefill of this size)


def time_launches(
    case: PrefillCase, grid: list[Any], device: torch.device, block_size: int = BLOCK_SIZE
) -> dict[Any, float]:
    """Kernel microseconds for each tile shape of ``grid``, and for each forced split count (keyed by the
    int); inf for a launch that fails to compile or gives a wrong answer."""
    q, kv_k, kv_v, metadata = inputs(case, device, block_size)
    scale = GEOMETRIES[case.model][2] ** -0.5
    expected = paged_attention_reference(q.float(), kv_k.float(), kv_v.float(), metadata, scale)
    calls: dict[Any, Callable[[], torch.Tensor]] = {
        tiles: lambda t=tiles: paged_attention_triton(q, kv_k, kv_v, metadata, scale, tiles=t) for tiles in grid
    }
    calls |= {n: lambda n=n: paged_attention_triton(q, kv_k, kv_v, metadata, scale, num_splits=n) for n in SPLITS}
    return {key: checked_graph_us(f"{case.name} {key}", call, expected, call) for key, call in calls.items()}


def run(
    device: torch.device, models: list[str], block_size: int = BLOCK_SIZE, default_only: bool = False
) -> dict[str, Any]:
    from workers.kernels.attention_triton import PREFILL_TILES

    grid = [PREFILL_TILES] if default_only else tile_grid()
    totals = dict.fromkeys(grid, 0.0)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "default": asdict(PREFILL_TILES)}
    report["block_size"] = block_size
    report["cases"] = []
    for case in [c for c in CASES if c.model in models]:
        measured = time_launches(case, grid, device, block_size)
        times = {tiles: measured[tiles] for tiles in grid}
        for tiles, us in times.items():
            totals[tiles] += us
        best = min(times, key=times.__getitem__)
        reference = sdpa_us(case, device) if case.decodes == 0 else None
        row = {
            "case": asdict(case),
            "default_us": times.get(PREFILL_TILES),
            "best": asdict(best),
            "best_us": times[best],
            "best_tflops": case.flops() / times[best] / 1e6,
            "splits_us": {n: measured[n] for n in SPLITS},
            "sdpa_us": reference,
            "all_us": {str(asdict(t)): us for t, us in times.items()},
        }
        report["cases"].append(row)
        splits = ", ".join(f"{n}: {us:.1f}" for n, us in row["splits_us"].items())
        print(
            f"{case.name:>28}: default {row['default_us']:8.1f} us, best {times[best]:8.1f} us "
            f"({row['best_tflops']:5.0f} TFLOP/s) at {best}; split {splits}; SDPA {reference or float('nan'):8.1f} us",
            flush=True,
        )
        torch.cuda.empty_cache()
    overall = min(totals, key=totals.__getitem__)
    report["best_overall"] = asdict(overall)
    report["best_overall_total_us"] = totals[overall]
    report["default_total_us"] = totals.get(PREFILL_TILES)
    print(f"best over all cases: {overall}: {totals[overall]:.0f} us in all (default {totals.get(PREFILL_TILES):.0f})")
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--models", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="the KV cache's tokens per block")
    parser.add_argument("--default-only", action="store_true", help="only PREFILL_TILES (and the forced splits)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.kernels_prefill needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    report = run(torch.device("cuda"), args.models, args.block_size, args.default_only)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
