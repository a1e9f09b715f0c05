"""Triton kernel behind `workers.kernels.rotary` (imports triton). One program per token: all q and k heads,
each optionally RMS-normalised over head_dim first (Qwen3's q/k norm), so the normed heads never leave registers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels._launch import check_launchable, interpreted, next_power_of_2
from workers.kernels._triton_common import Launch, round_to, to_dtype


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    token,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    cos_lo,
    cos_hi,
    sin_lo,
    sin_hi,
    w_ptr,
    eps,
    HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    NORM: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < HEADS) & (d < HALF)
    src = x_ptr + token * stride_xt + h * stride_xh + d
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if NORM:
        # As `rms_norm_reference` per head: the mean square in fp32, the normed head rounded to the I/O dtype
        # before the weight multiply, the product rounded again (the reference stores it in that dtype).
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
        x1 = round_to(round_to(x1 * rstd, dtype, INTERPRETED) * w1, dtype, INTERPRETED)
        x2 = round_to(round_to(x2 * rstd, dtype, INTERPRETED) * w2, dtype, INTERPRETED)
    # x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]; each product rounded to the I/O dtype
    # before the sum, as the reference's tensor ops round them (a no-op in fp32).
    lo = round_to(x1 * cos_lo, dtype, INTERPRETED) + round_to(-x2 * sin_lo, dtype, INTERPRETED)
    hi = round_to(x2 * cos_hi, dtype, INTERPRETED) + round_to(x1 * sin_hi, dtype, INTERPRETED)
    dst = out_ptr + token * stride_ot + h * stride_oh + d
    # Both halves were loaded before either is stored: in-place is safe within the program.
    tl.store(dst, to_dtype(lo, dtype, INTERPRETED), mask=mask)
    tl.store(dst + HALF, to_dtype(hi, dtype, INTERPRETED), mask=mask)


@triton.jit
def _mrope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_ct,
    stride_st,
    q_w_ptr,
    k_w_ptr,
    eps,
    HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    NORM: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    d_ok = d < HALF
    # Both halves of cos/sin are read (mrope_cos_sin repeats the frequencies, but the contract does not say so).
    cos_lo = tl.load(cos_ptr + token * stride_ct + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    cos_hi = tl.load(cos_ptr + token * stride_ct + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin_lo = tl.load(sin_ptr + token * stride_st + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin_hi = tl.load(sin_ptr + token * stride_st + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(
        q_ptr, q_out_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh,
        cos_lo, cos_hi, sin_lo, sin_hi, q_w_ptr, eps, HEADS, HEADS_PAD, HALF, HALF_PAD, NORM, INTERPRETED,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, token, stride_kt, stride_kh, stride_kot, stride_koh,
        cos_lo, cos_hi, sin_lo, sin_hi, k_w_ptr, eps, KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD, NORM, INTERPRETED,
    )  # fmt: skip


# Qwen3's q/k norm before the rotary: (q weight [D], k weight [D], eps).
QKNorm = tuple[torch.Tensor, torch.Tensor, float]


def launch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool, norm: QKNorm | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    check_launchable(q.device)
    q_out, k_out, step = plan(q, k, cos, sin, inplace, interpreted(), norm)
    if q.shape[0]:
        step()
    return q_out, k_out


def plan(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inplace: bool,
    interpreted_mode: bool = False,
    norm: QKNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Launch]:
    """The rotary of q and k (in place or into new tensors), each head RMS-normalised first where ``norm``."""
    tokens, heads, head_dim = q.shape
    q_weight, k_weight, eps = norm if norm is not None else (q, k, 0.0)  # (read only with NORM)
    kv_heads = k.shape[1]
    q_out = q if inplace else torch.empty_like(q)
    k_out = k if inplace else torch.empty_like(k)
    half = head_dim // 2
    step = Launch(
        _mrope_kernel,
        grid=(tokens,),
        args={
            "q_ptr": q,
            "k_ptr": k,
            "q_out_ptr": q_out,
            "k_out_ptr": k_out,
            "cos_ptr": cos,
            "sin_ptr": sin,
            "stride_qt": q.stride(0),
            "stride_qh": q.stride(1),
            "stride_kt": k.stride(0),
            "stride_kh": k.stride(1),
            "stride_qot": q_out.stride(0),
            "stride_qoh": q_out.stride(1),
            "stride_kot": k_out.stride(0),
            "stride_koh": k_out.stride(1),
            "stride_ct": cos.stride(0),
            "stride_st": sin.stride(0),
            "q_w_ptr": q_weight,
            "k_w_ptr": k_weight,
            "eps": eps,
        },
        constexprs={
            "HEADS": heads,
            "HEADS_PAD": next_power_of_2(heads),
            "KV_HEADS": kv_heads,
            "KV_HEADS_PAD": next_power_of_2(kv_heads),
            "HALF": half,
            "HALF_PAD": next_power_of_2(half),
            "NORM": norm is not None,
            "INTERPRETED": interpreted_mode,
        },
        num_warps=4,
    )
    return q_out, k_out, step
