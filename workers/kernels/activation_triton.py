"""Triton kernel behind `workers.kernels.activation` (imports triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels._launch import check_launchable, interpreted
from workers.kernels._triton_common import Launch, round_to, to_dtype

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    n_cols,
    stride_g,
    stride_u,
    stride_o,
    BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    # torch's formula, rounded to the input dtype before the product as F.silu(gate) * up rounds it.
    dtype = out_ptr.dtype.element_ty
    silu = round_to(g / (1.0 + tl.exp(-g)), dtype, INTERPRETED)
    tl.store(out_ptr + row * stride_o + cols, to_dtype(silu * u, dtype, INTERPRETED), mask=mask)


def launch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    check_launchable(gate.device)
    out, step = plan(gate, up, interpreted())
    if out.numel():
        step()
    return out


def plan(gate: torch.Tensor, up: torch.Tensor, interpreted_mode: bool = False) -> tuple[torch.Tensor, Launch]:
    width = gate.shape[-1]
    g2, u2 = _rows(gate), _rows(up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    o2 = out.view(-1, width)
    step = Launch(
        _silu_and_mul_kernel,
        grid=(o2.shape[0], triton.cdiv(width, BLOCK)),
        args={
            "gate_ptr": g2,
            "up_ptr": u2,
            "out_ptr": o2,
            "n_cols": width,
            "stride_g": g2.stride(0),
            "stride_u": u2.stride(0),
            "stride_o": o2.stride(0),
        },
        constexprs={"BLOCK": BLOCK, "INTERPRETED": interpreted_mode},
        num_warps=4,
    )
    return out, step


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[rows, width] with unit column stride, a view where possible (halves of a merged gate_up are)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()
