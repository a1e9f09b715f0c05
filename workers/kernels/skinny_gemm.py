"""``x @ w.T (+ bias)`` for the few rows of a decode step: the weights streamed once, split along K.

A decode step multiplies every weight matrix by a handful of rows (one per sequence), so each projection
is bound by reading its weight once. cuBLAS does not get there for the 2b's smaller products: on the H200
its qkv (6.3 MB) takes 5.9 us at every batch from 1 to 64, 22% of HBM bandwidth, and o (4.7 MB) 5.2 us
(benchmarks/results/2026-11-30-h200-balanced-splits-vit-4aa9354/c1/decode-gemms). Few output tiles over a
long K leave most SMs idle. Here a launch cuts K into ``split_k`` parts, so narrow products get enough
programs to fill the GPU, and a second launch sums the parts (and adds the bias) in fp32.

`decode_linear` is what the model's fused decode layers call: the kernel for a weight shape with tiles in
`TUNED_TILES`, F.linear for every other (empty by default, so cuBLAS everywhere). `benchmarks.decode_gemms
--triton` sweeps the tile shapes against cuBLAS; `load_tuned` takes its best where they win.

Measured on the H200 (batch 32, best of 24 tiles each): it lost on every 2b projection, qkv 6.2 us against
cuBLAS's 5.9, o 5.7 against 5.2, gate_up 22.2 against 18.2, down 12.6 against 12.2
(benchmarks/results/2026-11-30-h200-overlap-skinny-c195769). The small products' ~5-us floor is not
cuBLAS's: a kernel with more programs has it too. So `TUNED_TILES` stays empty; the kernel is kept, tested,
for shapes and GPUs where a sweep says otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from workers.kernels._launch import use_triton

MAX_ROWS = 64  # beyond a decode batch the product is compute bound: cuBLAS's territory


@dataclass(frozen=True)
class SkinnyTiles:
    """One launch shape: ``block_n`` output columns by ``block_k`` of K a step, K cut in ``split_k``."""

    block_n: int = 32
    block_k: int = 128
    split_k: int = 4
    num_warps: int = 4
    num_stages: int = 4


# (out features, in features) -> the tiles the kernel runs that weight shape with; other shapes use F.linear.
TUNED_TILES: dict[tuple[int, int], SkinnyTiles] = {}


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the kernel where ``x`` has few rows and ``weight``'s shape has tuned tiles."""
    if x.ndim == 2 and x.shape[0] <= MAX_ROWS and TUNED_TILES and use_triton(x, weight):
        tiles = TUNED_TILES.get((weight.shape[0], weight.shape[1]))
        if tiles is not None:
            return skinny_gemm_triton(x, weight, bias, tiles)
    return F.linear(x, weight, bias)


def load_tuned(path: Path, min_gain: float = 1.1) -> dict[tuple[int, int], SkinnyTiles]:
    """From a `benchmarks.decode_gemms --triton` JSON: per weight shape the fastest tiles, where they beat
    cuBLAS at the same batch by ``min_gain`` at least."""
    rows = json.loads(path.read_text())["rows"]
    blas = {(r["n"], r["k"], r["batch"]): r["us"] for r in rows if r["library"] == "cublas"}
    best: dict[tuple[int, int], tuple[float, SkinnyTiles]] = {}
    for r in rows:
        if r["library"] != "triton-skinny":
            continue
        shape, us = (r["n"], r["k"]), r["us"]
        baseline = blas.get((r["n"], r["k"], r["batch"]))
        if baseline is not None and baseline >= min_gain * us and (shape not in best or us < best[shape][0]):
            best[shape] = (us, SkinnyTiles(**r["tiles"]))
    return {shape: tiles for shape, (_, tiles) in best.items()}


def skinny_gemm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def skinny_gemm_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tiles: SkinnyTiles | None = None
) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K], bias [N] or None -> [M, N] in x's dtype."""
    from workers.kernels import skinny_gemm_triton as kernels

    check_inputs(x, weight, bias)
    return kernels.launch(x, weight, bias, tiles or SkinnyTiles())


def check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must have 1 to {MAX_ROWS} rows, got {x.shape[0]}")
    if x.dtype != weight.dtype or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x and weight must share a float dtype, got {x.dtype} and {weight.dtype}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be {x.dtype} [{weight.shape[0]}], got {bias.dtype} {tuple(bias.shape)}")
    if weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("x and weight must have contiguous rows")
    if len({x.device, weight.device} | ({bias.device} if bias is not None else set())) != 1:
        raise ValueError("x, weight and bias must be on one device")
