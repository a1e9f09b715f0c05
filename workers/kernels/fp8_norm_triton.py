"""Triton kernel behind `workers.kernels.fp8_norm` (imports triton): the vision tower's norm (LayerNorm with a bias, or
RMSNorm), optionally after the residual add before it, written directly as FP8 e4m3 with one scale per row, for the
per-channel FP8 GEMM that follows it.

One program per row, the row in registers, as `norm_triton._norm_kernel`: its norm is that kernel's own
(`norm_triton.residual_norm_row`), so the normalised row rounded to the rows' dtype is the value the
unfused path would have written; its quantization is `fp8_triton._quantize_kernel`'s per-token one on that rounded
row (amax, ``scale = amax / 448`` and ``q = x * (1 / scale)``, `_to_e4m3`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels._launch import check_launchable, interpreted, next_power_of_2
from workers.kernels._triton_common import Launch, round_to
from workers.kernels.fp8_triton import _to_e4m3, quantize_row
from workers.kernels.norm_triton import residual_norm_row


@triton.jit
def _norm_quantize_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    bias_ptr,
    q_ptr,
    s_ptr,
    summed_ptr,
    n_cols,
    stride_x,
    stride_r,
    stride_q,
    stride_s,
    eps,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    LAYER_NORM: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    out = residual_norm_row(
        x_ptr, residual_ptr, weight_ptr, bias_ptr, summed_ptr, row, cols, mask, n_cols, stride_x, stride_r, stride_s,
        eps, ADD_RESIDUAL, LAYER_NORM, INTERPRETED,
    )  # fmt: skip
    # Rounded to the rows' dtype, as the unfused norm stores it and the quantize kernel reads it back.
    normed = tl.where(mask, round_to(out, x_ptr.dtype.element_ty, INTERPRETED), 0.0)
    q, scale = quantize_row(normed)
    tl.store(q_ptr + row * stride_q + cols, _to_e4m3(q, INTERPRETED), mask=mask)
    tl.store(s_ptr + row, scale)


def launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    check_launchable(x.device)
    q, s, summed, step = plan(x, residual, weight, eps, bias, interpreted())
    if q.numel():
        step()
    return q, s, summed


def plan(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    bias: torch.Tensor | None = None,
    interpreted_mode: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Launch]:
    """(q [M, K] float8_e4m3fn, scales [M, 1] fp32, x + residual or None, the launch that fills them) for x [M, K]
    (and residual [M, K]) with unit column stride: LayerNorm where ``bias`` is given, RMSNorm otherwise."""
    rows, hidden = x.shape
    q = torch.empty((rows, hidden), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    summed = torch.empty_like(x) if residual is not None else None
    block = next_power_of_2(hidden)
    weight = weight.contiguous()
    step = Launch(
        _norm_quantize_kernel,
        grid=(rows,),
        args={
            "x_ptr": x,
            "residual_ptr": residual if residual is not None else x,  # read only with ADD_RESIDUAL
            "weight_ptr": weight,
            "bias_ptr": bias.contiguous() if bias is not None else weight,  # read only by LayerNorm
            "q_ptr": q,
            "s_ptr": s,
            "summed_ptr": summed if summed is not None else x,  # written only with ADD_RESIDUAL
            "n_cols": hidden,
            "stride_x": x.stride(0),
            "stride_r": residual.stride(0) if residual is not None else x.stride(0),
            "stride_q": q.stride(0),
            "stride_s": summed.stride(0) if summed is not None else x.stride(0),
            "eps": eps,
        },
        constexprs={
            "BLOCK": block,
            "ADD_RESIDUAL": residual is not None,
            "LAYER_NORM": bias is not None,
            "INTERPRETED": interpreted_mode,
        },
        num_warps=min(16, max(1, block // 256)),  # as the norm kernel's: the row stays in registers
    )
    return q, s, summed, step
