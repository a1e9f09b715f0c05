"""Triton kernel behind `workers.kernels.fp8_act` (imports triton): quick_gelu of a row, quantized per token to FP8.

One program per row, the row in registers: the activation is `vision_triton._quick_gelu_kernel`'s own
(`quick_gelu_unrounded`, rounded to the rows' dtype), so the value is the one the unfused path writes; the
quantization is the per-token one of `fp8_triton` (`row_scale`, `_to_e4m3`) on that value.

A row is held as two power-of-two pieces, ``HEAD`` (the largest power of two not over its width) and ``TAIL`` (what
is left, rounded up), not as one block of the next power of two: the towers' MLP widths are not powers of two
(5,120 = 4,096 + 1,024), and a block of 8,192 left 37% of the lanes computing masked-out values. On the H200 that
and a division per element made the kernel compute-bound
(`benchmarks/results/2026-12-02-h200-fp8-quantize-kernels-a967776`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels._launch import check_launchable, interpreted, next_power_of_2
from workers.kernels._triton_common import Launch, round_to
from workers.kernels.fp8_triton import _to_e4m3, row_scale, to_e4m3_range
from workers.kernels.vision_triton import quick_gelu_unrounded

WARPS = 4  # measured best on the H200 for 1,280- and 5,120-wide rows held in two pieces


@triton.jit
def _gelu_piece(x_row, cols, mask, INTERPRETED: tl.constexpr):
    dtype = x_row.dtype.element_ty
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, round_to(quick_gelu_unrounded(x, dtype, INTERPRETED), dtype, INTERPRETED), 0.0)


@triton.jit
def _quick_gelu_quantize_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    n_cols,
    stride_x,
    stride_q,
    HEAD: tl.constexpr,
    TAIL: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    head_cols = tl.arange(0, HEAD)
    head_mask = head_cols < n_cols
    head = _gelu_piece(x_row, head_cols, head_mask, INTERPRETED)
    amax = tl.max(tl.abs(head), 0)
    if TAIL > 0:
        tail_cols = HEAD + tl.arange(0, TAIL)
        tail_mask = tail_cols < n_cols
        tail = _gelu_piece(x_row, tail_cols, tail_mask, INTERPRETED)
        amax = tl.maximum(amax, tl.max(tl.abs(tail), 0))
    scale, inverse = row_scale(amax)
    tl.store(q_row + head_cols, _to_e4m3(to_e4m3_range(head, inverse), INTERPRETED), mask=head_mask)
    if TAIL > 0:
        tl.store(q_row + tail_cols, _to_e4m3(to_e4m3_range(tail, inverse), INTERPRETED), mask=tail_mask)
    tl.store(s_ptr + row, scale)


def row_pieces(cols: int) -> tuple[int, int]:
    """(HEAD, TAIL): a row of ``cols`` as a power-of-two piece and a power-of-two remainder (0 if none)."""
    head = 1 << (max(1, cols).bit_length() - 1)
    return head, (next_power_of_2(cols - head) if cols > head else 0)


def launch_quick_gelu_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_launchable(x.device)
    q, s, step = plan_quick_gelu_quantize(x, interpreted())
    if q.numel():
        step()
    return q, s


def plan_quick_gelu_quantize(
    x: torch.Tensor, interpreted_mode: bool = False
) -> tuple[torch.Tensor, torch.Tensor, Launch]:
    """(q [M, K] float8_e4m3fn, scales [M, 1] fp32, the launch that fills them) for x [M, K] with unit column
    stride."""
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    head, tail = row_pieces(cols)
    step = Launch(
        _quick_gelu_quantize_kernel,
        grid=(rows,),
        args={"x_ptr": x, "q_ptr": q, "s_ptr": s, "n_cols": cols, "stride_x": x.stride(0), "stride_q": q.stride(0)},
        constexprs={"HEAD": head, "TAIL": tail, "INTERPRETED": interpreted_mode},
        num_warps=WARPS,
    )
    return q, s, step
