"""The decode step's matrix products alone: each projection of a layer at decode batch sizes, per BLAS
library, against the HBM's bandwidth. ``python -m benchmarks.decode_gemms [--models 2b 7b]`` (CUDA).

A decode step reads every weight once, so a projection's speed is its weight bytes over its time. Each
case is timed as CUDA-graph replays of one call per copy of the weight, with enough copies to overflow
the L2 cache (as 28 layers with their own weights do), so every call reads its weight from HBM. The
profile of a 2b decode graph at batch 32 (benchmarks/results/2026-11-30-h200-decode-splits-1cb3ade) had
the MLP's products at 57-66% of the bandwidth and the qkv and o projections near 20%: this shows whether
another library or algorithm does better, shape by shape. cuBLAS and cuBLASLt were the same on every shape
(session 10). ``--triton`` adds `workers.kernels.skinny_gemm` (K split over more programs) at batch 32,
each tile shape of a small grid checked against F.linear and timed, the best per projection reported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from workers.kernels.bench import L2_OVERFLOW_BYTES, PEAK_BYTES_PER_S, graph_replay_us
from workers.kernels.skinny_gemm import SkinnyTiles, skinny_gemm_triton

# (name, in features, out features, bias) of one decoder layer, and the LM head; Qwen2-VL 2B and 7B.
PROJECTIONS = {
    "2b": [("qkv", 1536, 2048, True), ("o", 1536, 1536, False), ("gate_up", 1536, 17920, False),
           ("down", 8960, 1536, False), ("lm_head", 1536, 151936, False)],
    "7b": [("qkv", 3584, 4608, True), ("o", 3584, 3584, False), ("gate_up", 3584, 37888, False),
           ("down", 18944, 3584, False), ("lm_head", 3584, 152064, False)],
}  # fmt: skip
BATCHES = (1, 8, 32, 40, 64)
LIBRARIES = ("cublas", "cublaslt")


SKINNY_BATCH = 32
SKINNY_TILES = [
    SkinnyTiles(block_n=block_n, block_k=block_k, split_k=split_k)
    for block_n in (16, 32, 64)
    for block_k in (128, 256)
    for split_k in (1, 2, 4, 8)
]


def time_projection(k: int, n: int, bias: bool, batch: int, tiles: SkinnyTiles | None = None) -> dict[str, float]:
    """F.linear's time (or the skinny kernel's with ``tiles``) for one projection's weight read from HBM."""
    weight_bytes = k * n * 2
    copies = max(1, -(-L2_OVERFLOW_BYTES // weight_bytes))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    biases = [torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None for _ in range(copies)]
    x = torch.randn(batch, k, device="cuda", dtype=torch.bfloat16)
    if tiles is not None:
        ours, reference = skinny_gemm_triton(x, weights[0], biases[0], tiles), F.linear(x, weights[0], biases[0])
        if not torch.allclose(ours.float(), reference.float(), rtol=2e-2, atol=2e-2):
            raise ValueError(f"skinny_gemm with {tiles} differs from F.linear")

    def all_copies() -> None:
        for w, b in zip(weights, biases, strict=True):
            if tiles is None:
                F.linear(x, w, b)
            else:
                skinny_gemm_triton(x, w, b, tiles)

    us = graph_replay_us(all_copies) / copies
    bytes_per_s = weight_bytes / (us * 1e-6)
    return {"us": us, "weight_gb_per_s": bytes_per_s / 1e9, "of_peak": bytes_per_s / PEAK_BYTES_PER_S}


def run(models: list[str]) -> list[dict[str, Any]]:
    rows = []
    for library in LIBRARIES:
        try:
            torch.backends.cuda.preferred_blas_library(library)
        except (RuntimeError, ValueError) as exc:  # not built into this torch: say so and go on
            print(f"{library}: not available ({exc})", flush=True)
            continue
        for model in models:
            for name, k, n, bias in PROJECTIONS[model]:
                for batch in BATCHES:
                    row = {"library": library, "model": model, "projection": name, "batch": batch, "k": k, "n": n}
                    row |= time_projection(k, n, bias, batch)
                    rows.append(row)
                    print(
                        f"{library:9s} {model} {name:8s} M={batch:3d}: {row['us']:7.1f} us, "
                        f"{row['weight_gb_per_s']:6.0f} GB/s ({100 * row['of_peak']:.0f}% of HBM)",
                        flush=True,
                    )
                torch.cuda.empty_cache()
    return rows


def sweep_skinny(models: list[str]) -> list[dict[str, Any]]:
    """Each projection (but the LM head, already near the bandwidth) at batch 32 with every tile shape, and
    cuBLAS beside it (the baseline `load_tuned` compares with)."""
    rows = []
    for model in models:
        for name, k, n, bias in PROJECTIONS[model]:
            if name == "lm_head":
                continue
            case = {"model": model, "projection": name, "batch": SKINNY_BATCH, "k": k, "n": n}
            blas = {"library": "cublas", **case} | time_projection(k, n, bias, SKINNY_BATCH)
            rows.append(blas)
            timed = []
            for tiles in SKINNY_TILES:
                row: dict[str, Any] = {"library": "triton-skinny", **case, "tiles": tiles.__dict__}
                try:
                    row |= time_projection(k, n, bias, SKINNY_BATCH, tiles)
                except (ValueError, RuntimeError) as exc:  # a shape that does not fit or compute: say so
                    print(f"triton    {model} {name:8s} {tiles}: {exc}", flush=True)
                    continue
                timed.append(row)
            rows.extend(timed)
            if timed:
                best = min(timed, key=lambda r: r["us"])
                print(
                    f"triton    {model} {name:8s} M={SKINNY_BATCH:3d}: {best['us']:7.1f} us, "
                    f"{best['weight_gb_per_s']:6.0f} GB/s ({100 * best['of_peak']:.0f}% of HBM), best of "
                    f"{len(timed)}: {best['tiles']}; cuBLAS {blas['us']:.1f} us",
                    flush=True,
                )
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["2b"], choices=sorted(PROJECTIONS))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--triton", action="store_true", help="also sweep workers.kernels.skinny_gemm's tiles")
    parser.add_argument("--no-blas", action="store_true", help="skip the BLAS libraries (with --triton)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.decode_gemms needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    rows = [] if args.no_blas else run(args.models)
    if args.triton:
        torch.backends.cuda.preferred_blas_library("cublas")  # the reference for the checks
        rows += sweep_skinny(args.models)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
