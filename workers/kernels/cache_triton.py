"""Triton kernel behind `workers.kernels.cache` (imports triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels._launch import check_launchable, next_power_of_2


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    kv_k_ptr,
    kv_v_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cks,
    stride_ckh,
    stride_cvs,
    stride_cvh,
    KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    h = tl.arange(0, KV_HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (h < KV_HEADS) & (d < HEAD_DIM)
    # A plain copy: no arithmetic, so bf16 needs no care even in the interpreter.
    k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(kv_k_ptr + slot * stride_cks + h * stride_ckh + d, k, mask=mask)
    tl.store(kv_v_ptr + slot * stride_cvs + h * stride_cvh + d, v, mask=mask)


def launch(
    k: torch.Tensor, v: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    check_launchable(k.device)
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    _reshape_and_cache_kernel[(tokens,)](
        k,
        v,
        kv_k,
        kv_v,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_k.stride(0),
        kv_k.stride(1),
        kv_v.stride(0),
        kv_v.stride(1),
        KV_HEADS=kv_heads,
        KV_HEADS_PAD=next_power_of_2(kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        num_warps=2,
    )
