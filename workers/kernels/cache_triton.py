"""Triton kernel behind `workers.kernels.cache` (imports triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels._launch import check_launchable, interpreted, next_power_of_2
from workers.kernels._triton_common import Launch
from workers.kernels.fp8_triton import _to_e4m3, quantize_tile_rows


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    kv_k_ptr,
    kv_v_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cks,
    stride_ckh,
    stride_cvs,
    stride_cvh,
    stride_ss,
    KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    FP8: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    h = tl.arange(0, KV_HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (h < KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    if FP8:
        heads = tl.arange(0, KV_HEADS_PAD)
        k, k_scale = quantize_tile_rows(k.to(tl.float32))  # (per head: `cache.quantize_kv_reference`)
        v, v_scale = quantize_tile_rows(v.to(tl.float32))
        k = _to_e4m3(k, INTERPRETED)
        v = _to_e4m3(v, INTERPRETED)
        tl.store(k_scale_ptr + slot * stride_ss + heads, k_scale, mask=heads < KV_HEADS)
        tl.store(v_scale_ptr + slot * stride_ss + heads, v_scale, mask=heads < KV_HEADS)
    # (else a plain copy: no arithmetic, so bf16 needs no care even in the interpreter)
    tl.store(kv_k_ptr + slot * stride_cks + h * stride_ckh + d, k, mask=mask)
    tl.store(kv_v_ptr + slot * stride_cvs + h * stride_cvh + d, v, mask=mask)


def launch(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Inputs are validated by `cache.check_inputs` and `cache.check_scales` (the scales: with an FP8 cache)."""
    check_launchable(k.device)
    if k.shape[0]:
        plan(k, v, kv_k, kv_v, slot_mapping, k_scale, v_scale, interpreted())()


def plan(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    interpreted_mode: bool = False,
) -> Launch:
    tokens, kv_heads, head_dim = k.shape
    fp8 = k_scale is not None and v_scale is not None
    if fp8 and k_scale.stride() != v_scale.stride():
        raise ValueError(f"k_scale and v_scale must share strides, got {k_scale.stride()} and {v_scale.stride()}")
    return Launch(
        _reshape_and_cache_kernel,
        grid=(tokens,),
        args={
            "k_ptr": k,
            "v_ptr": v,
            "kv_k_ptr": kv_k,
            "kv_v_ptr": kv_v,
            "slot_ptr": slot_mapping,
            "k_scale_ptr": k_scale if fp8 else kv_k,  # (not read without FP8: a compile-time False)
            "v_scale_ptr": v_scale if fp8 else kv_v,
            "stride_kt": k.stride(0),
            "stride_kh": k.stride(1),
            "stride_vt": v.stride(0),
            "stride_vh": v.stride(1),
            "stride_cks": kv_k.stride(0),
            "stride_ckh": kv_k.stride(1),
            "stride_cvs": kv_v.stride(0),
            "stride_cvh": kv_v.stride(1),
            "stride_ss": k_scale.stride(0) if fp8 else 0,
        },
        constexprs={
            "KV_HEADS": kv_heads,
            "KV_HEADS_PAD": next_power_of_2(kv_heads),
            "HEAD_DIM": head_dim,
            "HEAD_DIM_PAD": next_power_of_2(head_dim),
            "FP8": fp8,
            "INTERPRETED": interpreted_mode,
        },
        num_warps=2,
    )
