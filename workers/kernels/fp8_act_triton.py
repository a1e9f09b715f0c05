"""Triton kernel behind `workers.kernels.fp8_act` (imports triton): quick_gelu of a row, quantized per token to FP8.

One program per row, the row in registers: the activation is `vision_triton._quick_gelu_kernel`'s own
(`quick_gelu_unrounded`, rounded to the rows' dtype), so the value is the one the unfused path writes; the
quantization is the per-token one of `fp8_triton` (`quantize_row`, `_to_e4m3`) on that value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels._launch import check_launchable, interpreted, next_power_of_2
from workers.kernels._triton_common import Launch, round_to
from workers.kernels.fp8_triton import _to_e4m3, quantize_row
from workers.kernels.vision_triton import quick_gelu_unrounded


@triton.jit
def _quick_gelu_quantize_kernel(
    x_ptr, q_ptr, s_ptr, n_cols, stride_x, stride_q, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    act = tl.where(mask, round_to(quick_gelu_unrounded(x, dtype, INTERPRETED), dtype, INTERPRETED), 0.0)
    q, scale = quantize_row(act)
    tl.store(q_ptr + row * stride_q + cols, _to_e4m3(q, INTERPRETED), mask=mask)
    tl.store(s_ptr + row, scale)


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
    block = next_power_of_2(cols)
    step = Launch(
        _quick_gelu_quantize_kernel,
        grid=(rows,),
        args={"x_ptr": x, "q_ptr": q, "s_ptr": s, "n_cols": cols, "stride_x": x.stride(0), "stride_q": q.stride(0)},
        constexprs={"BLOCK": block, "INTERPRETED": interpreted_mode},
        num_warps=min(16, max(1, block // 256)),  # as the norm kernels': the row stays in registers
    )
    return q, s, step
