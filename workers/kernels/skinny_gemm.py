"""``x @ w.T (+ bias)`` for the few rows of a decode step: the weights streamed once, split along K.

A decode step multiplies every weight matrix by a handful of rows (one per sequence), so each projection
is bound by reading its weight once. cuBLAS does not get there for the 2b's smaller products: on the H200
its qkv (6.3 MB) takes 5.9 us at every batch from 1 to 64, 22% of HBM bandwidth, and o (4.7 MB) 5.2 us
(benchmarks/results/2026-11-30-h200-balanced-splits-vit-4aa9354/c1/decode-gemms). Few output tiles over a
long K leave most SMs idle. Here a launch cuts K into ``split_k`` parts, so narrow products get enough
programs to fill the GPU, and a second launch sums the parts (and adds the bias) in fp32.

Not used by the model yet: `benchmarks.decode_gemms --triton` sweeps its tile shapes against cuBLAS first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MAX_ROWS = 64  # beyond a decode batch the product is compute bound: cuBLAS's territory


@dataclass(frozen=True)
class SkinnyTiles:
    """One launch shape: ``block_n`` output columns by ``block_k`` of K a step, K cut in ``split_k``."""

    block_n: int = 32
    block_k: int = 128
    split_k: int = 4
    num_warps: int = 4
    num_stages: int = 4


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
