"""Triton kernels behind `workers.kernels.vision` (imports triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels._launch import check_launchable, interpreted
from workers.kernels._triton_common import Launch, round_to, to_dtype

ROWS = 2  # patches per program of the rotary kernel
GELU_BLOCK = 2048


@triton.jit
def _rotary_qk_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    dest_ptr,
    n_rows,
    stride_qkv,
    stride_out_row,
    stride_out_head,
    HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    ROWS: tl.constexpr,
    PADDED: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """ROWS patches, every head of q and k: out = x * cos + rotate_half(x) * sin in fp32, as the reference.

    PADDED: row r goes to row dest[r] of the padded q, k and v (strided by the arguments), and v is copied
    there too; otherwise row r of the contiguous q and k."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    heads = tl.arange(0, HEADS_P2)
    cols = tl.arange(0, HALF_P2)
    row_ok = rows < n_rows
    col_ok = cols < HALF
    table_mask = row_ok[:, None, None] & col_ok[None, None, :]  # [ROWS, 1, HALF]: shared by the heads
    mask = table_mask & (heads[None, :, None] < HEADS)
    rows64 = rows.to(tl.int64)
    table = rows64[:, None, None] * (2 * HALF) + cols[None, None, :]
    cos_lo = tl.load(cos_ptr + table, mask=table_mask, other=0.0)
    cos_hi = tl.load(cos_ptr + table + HALF, mask=table_mask, other=0.0)
    sin_lo = tl.load(sin_ptr + table, mask=table_mask, other=0.0)
    sin_hi = tl.load(sin_ptr + table + HALF, mask=table_mask, other=0.0)
    dim = 2 * HALF
    within = heads[None, :, None] * dim + cols[None, None, :]  # offset of a head's first half in q (or k)
    if PADDED:  # noqa: SIM108 - a block on a constexpr, compiled away; not a runtime choice
        dest = tl.load(dest_ptr + rows64, mask=row_ok, other=0)
    else:
        dest = rows64
    out_at = dest[:, None, None] * stride_out_row + heads[None, :, None] * stride_out_head + cols[None, None, :]
    dtype = q_ptr.dtype.element_ty
    for part in tl.static_range(3 if PADDED else 2):  # 0: q, 1: k, 2: v
        src = qkv_ptr + rows64[:, None, None] * stride_qkv + part * HEADS * dim + within
        lo = tl.load(src, mask=mask, other=0.0)
        hi = tl.load(src + HALF, mask=mask, other=0.0)
        if part < 2:
            lo32 = lo.to(tl.float32)
            hi32 = hi.to(tl.float32)
            # Launched with fp fusion off: each product is rounded before the sum, as torch's separate ops do.
            lo = to_dtype(lo32 * cos_lo - hi32 * sin_lo, dtype, INTERPRETED)
            hi = to_dtype(hi32 * cos_hi + lo32 * sin_hi, dtype, INTERPRETED)
        dst = (q_ptr if part == 0 else (k_ptr if part == 1 else v_ptr)) + out_at
        tl.store(dst, lo, mask=mask)
        tl.store(dst + HALF, hi, mask=mask)


@triton.jit
def quick_gelu_unrounded(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """x * sigmoid(1.702 x) in fp32 for fp32 ``x`` holding ``dtype`` values: torch's first two ops rounded to
    ``dtype``, the last product left for the caller to round (or store)."""
    scaled = round_to(x * 1.702, dtype, INTERPRETED)
    gate = round_to(1.0 / (1.0 + tl.exp(-scaled)), dtype, INTERPRETED)
    return x * gate


@triton.jit
def _quick_gelu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    """x * sigmoid(1.702 x), rounding to x's dtype after each of torch's three ops."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, to_dtype(quick_gelu_unrounded(x, dtype, INTERPRETED), dtype, INTERPRETED), mask=mask)


def launch_rotary(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_launchable(qkv.device)
    q, k, v, step = plan_rotary(qkv, cos, sin, heads, interpreted())
    if q.shape[0]:
        step()
    return q, k, v


def launch_rotary_into(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, padded: torch.Tensor, dest: torch.Tensor
) -> None:
    check_launchable(qkv.device)
    step = plan_rotary_into(qkv, cos, sin, heads, padded, dest, interpreted())
    if qkv.shape[0]:
        step()


def plan_rotary(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, interpreted_mode: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Launch]:
    n = qkv.shape[0]
    head_dim = qkv.shape[1] // (3 * heads)
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    q = torch.empty((n, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty_like(q)
    v = qkv.view(n, 3, heads, head_dim)[:, 2]
    out = {"q_ptr": q, "k_ptr": k, "v_ptr": q, "dest_ptr": q, "stride_out_row": heads * head_dim}
    step = _rotary_launch(qkv, cos, sin, heads, out | {"stride_out_head": head_dim}, False, interpreted_mode)
    return q, k, v, step


def plan_rotary_into(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    padded: torch.Tensor,
    dest: torch.Tensor,
    interpreted_mode: bool = False,
) -> Launch:
    """``padded`` [3, rows, heads, padded_dim] (q, k, v; the last dimension contiguous), ``dest`` [n] int64."""
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    q, k, v = padded.unbind(0)
    out = {"q_ptr": q, "k_ptr": k, "v_ptr": v, "dest_ptr": dest, "stride_out_row": q.stride(0)}
    return _rotary_launch(qkv, cos, sin, heads, out | {"stride_out_head": q.stride(1)}, True, interpreted_mode)


def _rotary_launch(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    out: dict[str, torch.Tensor | int],
    padded: bool,
    interpreted_mode: bool,
) -> Launch:
    half = qkv.shape[1] // (3 * heads) // 2
    return Launch(
        _rotary_qk_kernel,
        grid=(triton.cdiv(qkv.shape[0], ROWS),),
        args={
            "qkv_ptr": qkv,
            "cos_ptr": cos.contiguous(),
            "sin_ptr": sin.contiguous(),
            **out,
            "n_rows": qkv.shape[0],
            "stride_qkv": qkv.stride(0),
        },
        constexprs={
            "HEADS": heads,
            "HEADS_P2": triton.next_power_of_2(heads),
            "HALF": half,
            "HALF_P2": triton.next_power_of_2(half),
            "ROWS": ROWS,
            "PADDED": padded,
            "INTERPRETED": interpreted_mode,
        },
        num_warps=4,
        options={"enable_fp_fusion": False},
    )


def launch_quick_gelu(x: torch.Tensor) -> torch.Tensor:
    check_launchable(x.device)
    out, step = plan_quick_gelu(x, interpreted())
    if x.numel():
        step()
    return out


def plan_quick_gelu(x: torch.Tensor, interpreted_mode: bool = False) -> tuple[torch.Tensor, Launch]:
    out = torch.empty_like(x)
    step = Launch(
        _quick_gelu_kernel,
        grid=(triton.cdiv(x.numel(), GELU_BLOCK),),
        args={"x_ptr": x, "out_ptr": out, "n": x.numel()},
        constexprs={"BLOCK": GELU_BLOCK, "INTERPRETED": interpreted_mode},
        num_warps=8,
    )
    return out, step
