"""Triton kernel behind `workers.kernels.norm` (imports triton). One program per row, the row in registers:
RMSNorm (the language model's) or LayerNorm with a bias (the vision tower's), each optionally after the
residual add that precedes it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels._launch import check_launchable, interpreted, next_power_of_2
from workers.kernels._triton_common import Launch, round_to, to_dtype


@triton.jit
def residual_norm_row(
    x_ptr,
    residual_ptr,
    weight_ptr,
    bias_ptr,
    summed_ptr,
    row,
    cols,
    mask,
    n_cols,
    stride_x,
    stride_r,
    stride_s,
    eps,
    ADD_RESIDUAL: tl.constexpr,
    LAYER_NORM: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One row's norm in fp32, before its final rounding: the residual added first where ADD_RESIDUAL (the sum
    stored, rounded to its dtype), then LayerNorm with a bias or RMSNorm. `fp8_norm_triton` normalises with this
    too, so its fused rows are bit for bit the ones this kernel writes."""
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # Rounded to the input dtype before normalising, as the layer's own `x + residual` is.
        summed = to_dtype(x + r, summed_ptr.dtype.element_ty, INTERPRETED)
        tl.store(summed_ptr + row * stride_s + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if LAYER_NORM:
        # As torch's LayerNorm: statistics in fp32, the affine map in fp32, one rounding at the end.
        centred = tl.where(mask, x - tl.sum(x, 0) / n_cols, 0.0)
        rstd = tl.rsqrt(tl.sum(centred * centred, 0) / n_cols + eps)
        b = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        out = centred * rstd * w + b
    else:
        rstd = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
        # The reference casts the normalised row to x's dtype before the weight multiply; so do we.
        out = round_to(x * rstd, x_ptr.dtype.element_ty, INTERPRETED) * w
    return out


@triton.jit
def _norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    summed_ptr,
    n_cols,
    stride_x,
    stride_r,
    stride_o,
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
    tl.store(out_ptr + row * stride_o + cols, to_dtype(out, out_ptr.dtype.element_ty, INTERPRETED), mask=mask)


def launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    check_launchable(x.device)
    out, summed, step = plan(x, residual, weight, eps, bias, interpreted())
    if out.numel():
        step()
    return out, summed


def plan(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    bias: torch.Tensor | None = None,
    interpreted_mode: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, Launch]:
    """(normed, summed or None, the launch that fills them): RMSNorm, or LayerNorm where ``bias`` is given."""
    hidden = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = torch.empty_like(x) if residual is not None else None
    r2 = _rows(residual) if residual is not None else x2
    s2 = summed.view(-1, hidden) if summed is not None else x2  # unused without ADD_RESIDUAL
    o2 = out.view(-1, hidden)
    block = next_power_of_2(hidden)
    weight = weight.contiguous()
    step = Launch(
        _norm_kernel,
        grid=(x2.shape[0],),
        args={
            "x_ptr": x2,
            "residual_ptr": r2,
            "weight_ptr": weight,
            "bias_ptr": bias.contiguous() if bias is not None else weight,  # read only by LayerNorm
            "out_ptr": o2,
            "summed_ptr": s2,
            "n_cols": hidden,
            "stride_x": x2.stride(0),
            "stride_r": r2.stride(0),
            "stride_o": o2.stride(0),
            "stride_s": s2.stride(0),
            "eps": eps,
        },
        constexprs={
            "BLOCK": block,
            "ADD_RESIDUAL": residual is not None,
            "LAYER_NORM": bias is not None,
            "INTERPRETED": interpreted_mode,
        },
        num_warps=_num_warps(block),
    )
    return out, summed, step


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[rows, hidden] with unit column stride, a view where possible."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _num_warps(block: int) -> int:
    # About 8 to 16 fp32 values per thread: the whole row stays in registers without spilling.
    return min(16, max(1, block // 256))
