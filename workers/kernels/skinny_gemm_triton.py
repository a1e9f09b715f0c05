"""Triton kernels behind `workers.kernels.skinny_gemm` (imports triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels._launch import check_launchable, interpreted, next_power_of_2
from workers.kernels._triton_common import Launch, to_dtype
from workers.kernels.skinny_gemm import SkinnyTiles


@triton.jit
def _skinny_partial_kernel(
    x_ptr,
    w_ptr,
    part_ptr,
    m,
    n,
    k,
    stride_xm,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_STEPS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One program: ``BLOCK_N`` columns over one split of K, written as an fp32 partial [split, M, N]."""
    col_block = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_begin = split * (K_STEPS * BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # A trip count known to the compiler (one per K and split: a decode model has a few), which it can
    # pipeline; the mask cuts only K's end, in the last split.
    for step in range(K_STEPS):
        ks = k_begin + step * BLOCK_K + offs_k
        k_ok = ks < k
        x_mask = (offs_m[:, None] < m) & k_ok[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=x_mask, other=0.0)
        w_mask = (offs_n[:, None] < n) & k_ok[None, :]
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + ks[None, :], mask=w_mask, other=0.0)
        if INTERPRETED:  # (the interpreter's dot of 16-bit tiles: in fp32, as the GPU accumulates)
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    part = part_ptr + split * m * n + offs_m[:, None] * n + offs_n[None, :]
    tl.store(part, acc, mask=(offs_m[:, None] < m) & (offs_n[None, :] < n))


@triton.jit
def _skinny_sum_kernel(
    part_ptr,
    bias_ptr,
    out_ptr,
    m,
    n,
    stride_om,
    BLOCK: tl.constexpr,
    SPLITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """The splits' partials summed in fp32, the bias added, rounded once to the output's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < m * n
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(SPLITS):
        total += tl.load(part_ptr + split * m * n + offs, mask=ok, other=0.0)
    row, col = offs // n, offs % n
    if HAS_BIAS:
        total += tl.load(bias_ptr + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + col, to_dtype(total, out_ptr.dtype.element_ty, INTERPRETED), mask=ok)


SUM_BLOCK = 1024


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: SkinnyTiles) -> torch.Tensor:
    check_launchable(x.device)
    out, steps = plan(x, weight, bias, tiles, interpreted())
    for step in steps:
        step()
    return out


def plan(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: SkinnyTiles, interpreted_mode: bool = False
) -> tuple[torch.Tensor, list[Launch]]:
    """The output and its two launches: the partial products, then their sum."""
    m, k = x.shape
    n = weight.shape[0]
    split_k = max(1, min(tiles.split_k, _cdiv(k, tiles.block_k)))
    # Whole BLOCK_K steps per split, so that only the last split meets the end of K.
    k_per_split = _cdiv(_cdiv(k, split_k), tiles.block_k) * tiles.block_k
    split_k = _cdiv(k, k_per_split)
    block_m = max(16, next_power_of_2(m))  # tl.dot's smallest tile
    part = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    partial = Launch(
        _skinny_partial_kernel,
        grid=(_cdiv(n, tiles.block_n), split_k),
        args={
            "x_ptr": x,
            "w_ptr": weight,
            "part_ptr": part,
            "m": m,
            "n": n,
            "k": k,
            "stride_xm": x.stride(0),
            "stride_wn": weight.stride(0),
        },
        constexprs={
            "BLOCK_M": block_m,
            "BLOCK_N": tiles.block_n,
            "BLOCK_K": tiles.block_k,
            "K_STEPS": k_per_split // tiles.block_k,
            "DOT_PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",
            "INTERPRETED": interpreted_mode,
        },
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    total = Launch(
        _skinny_sum_kernel,
        grid=(_cdiv(m * n, SUM_BLOCK),),
        args={
            "part_ptr": part,
            "bias_ptr": bias if bias is not None else part,  # read only with HAS_BIAS
            "out_ptr": out,
            "m": m,
            "n": n,
            "stride_om": out.stride(0),
        },
        constexprs={
            "BLOCK": SUM_BLOCK,
            "SPLITS": split_k,
            "HAS_BIAS": bias is not None,
            "INTERPRETED": interpreted_mode,
        },
        num_warps=4,
    )
    return out, [partial, total]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
