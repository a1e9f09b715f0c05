"""A per-channel FP8 GEMM with its bias added in cuBLASLt's epilogue, where this torch's ``torch._scaled_mm`` does
that right.

Added afterwards, a bias costs a pass over the whole output: in the FP8 vision tower, whose four linears all have
biases, those adds took about a fifth of a 16-image forward on the H200, time the bf16 tower does not spend (its
``F.linear`` adds the bias in the GEMM). Whether ``_scaled_mm`` takes a bias with per-token x per-channel scales,
and adds it before its one rounding, differs between torch builds and backends, so it is probed once per device
against the exact product (`bias_support`); where the probe fails or cannot run (during a CUDA graph's capture),
the bias is added afterwards as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

ScaledMm = Callable[..., torch.Tensor]
_SUPPORT: dict[str, bool] = {}  # str(device): whether the fused bias passed its probe there
PROBE_SHAPE = (64, 256, 384)  # m, k, n: small, multiples of 16 as _scaled_mm wants


def rowwise_mm(
    x_q: torch.Tensor,
    x_s: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(x_q * x_s) @ (w * w_scale).T + bias`` in ``out_dtype``: x_q [M, K] FP8 with x_s [M, 1] fp32 per token, w
    [N, K] FP8 with w_scale [N] (or [N, 1]) fp32 per channel, bias [N] or None."""
    fused = bias is not None and bias.dtype == out_dtype and bias_support(x_q.device)
    out = torch._scaled_mm(
        x_q, w.t(), scale_a=x_s, scale_b=w_scale.view(1, -1), bias=bias if fused else None, out_dtype=out_dtype
    )
    return out if bias is None or fused else out + bias


def bias_support(device: torch.device) -> bool:
    """Whether ``_scaled_mm`` adds a bias right on ``device``: probed once (with a synchronisation, so never while a
    CUDA graph is being captured: False then, not remembered)."""
    key = str(device)
    if key not in _SUPPORT:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        mismatch = probe_mismatch(device)
        _SUPPORT[key] = mismatch is None
        log.info(
            "FP8 per-channel GEMMs on %s: %s",
            key,
            "bias added in the GEMM" if mismatch is None else f"bias added afterwards ({mismatch})",
        )
    return _SUPPORT[key]


def probe_mismatch(device: torch.device, scaled_mm: ScaledMm = torch._scaled_mm) -> str | None:
    """None where ``scaled_mm`` with a bf16 bias matches the exact product plus bias on ``device`` within one bf16
    rounding of the result and of the product (what adding the bias afterwards gives) and the tensor cores'
    narrower accumulation (2**-12 of the absolute sum); else what went wrong."""
    m, k, n = PROBE_SHAPE
    g = torch.Generator(device=device).manual_seed(0)
    x_q = (torch.randn(m, k, generator=g, device=device) * 64).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, generator=g, device=device) * 64).to(torch.float8_e4m3fn)
    x_s = torch.rand(m, 1, generator=g, device=device) * 1e-3 + 1e-3
    w_s = torch.rand(n, generator=g, device=device) * 1e-3 + 1e-3
    # A bias larger than most products: one left out, or added after a rounding of its own, shows.
    bias = (torch.randn(n, generator=g, device=device) * 4).to(torch.bfloat16)
    try:
        out = scaled_mm(x_q, w.t(), scale_a=x_s, scale_b=w_s.view(1, -1), bias=bias, out_dtype=torch.bfloat16)
    except Exception as error:  # (whatever a torch without the fused bias raises: the bias is added afterwards)
        return f"raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    x_deq, w_deq = x_q.float() * x_s, w.float() * w_s.view(-1, 1)
    product = x_deq @ w_deq.T
    ref = product + bias.float()
    bound = 2**-8 * (ref.abs() + product.abs()) + 2**-12 * (x_deq.abs() @ w_deq.abs().T)
    if tuple(out.shape) != (m, n):
        return f"answered shape {tuple(out.shape)} for ({m}, {n})"
    over = (out.float() - ref).abs() / bound
    if bool((over <= 1).all()):
        return None
    return f"{int((over > 1).sum())} of {over.numel()} outputs off, worst {over.max():.3g}x the bound"
