"""The decode step's matrix products alone: each projection of a layer at decode batch sizes, per BLAS
library, against the HBM's bandwidth. ``python -m benchmarks.decode_gemms [--models 2b 7b]`` (CUDA).

A decode step reads every weight once, so a projection's speed is its weight bytes over its time. Each
case is timed as CUDA-graph replays of one call per copy of the weight, with enough copies to overflow
the L2 cache (as 28 layers with their own weights do), so every call reads its weight from HBM: this
shows, shape by shape, how near each projection comes to the bandwidth and whether another library does
better.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.kernels import L2_OVERFLOW_BYTES, PEAK_BYTES_PER_S, graph_replay_us

# (name, in features, out features, bias) of one decoder layer, and the LM head; Qwen2-VL 2B and 7B.
PROJECTIONS = {
    "2b": [("qkv", 1536, 2048, True), ("o", 1536, 1536, False), ("gate_up", 1536, 17920, False),
           ("down", 8960, 1536, False), ("lm_head", 1536, 151936, False)],
    "7b": [("qkv", 3584, 4608, True), ("o", 3584, 3584, False), ("gate_up", 3584, 37888, False),
           ("down", 18944, 3584, False), ("lm_head", 3584, 152064, False)],
}  # fmt: skip
BATCHES = (1, 8, 32, 40, 64)
LIBRARIES = ("cublas", "cublaslt")


def time_projection(k: int, n: int, bias: bool, batch: int) -> dict[str, float]:
    """F.linear's time for one projection's weight read from HBM."""
    weight_bytes = k * n * 2
    copies = max(1, -(-L2_OVERFLOW_BYTES // weight_bytes))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    biases = [torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None for _ in range(copies)]
    x = torch.randn(batch, k, device="cuda", dtype=torch.bfloat16)

    def all_copies() -> None:
        for w, b in zip(weights, biases, strict=True):
            F.linear(x, w, b)

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["2b"], choices=sorted(PROJECTIONS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.decode_gemms needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    rows = run(args.models)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
