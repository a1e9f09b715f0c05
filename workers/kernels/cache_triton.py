"""Triton kernel behind `workers.kernels.cache` (imports triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels._launch import check_launchable, next_power_of_2
from workers.kernels._triton_common import Launch


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
    if k.shape[0]:
        plan(k, v, kv_k, kv_v, slot_mapping)()


def plan(
    k: torch.Tensor, v: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor, slot_mapping: torch.Tensor
) -> Launch:
    tokens, kv_heads, head_dim = k.shape
    return Launch(
        _reshape_and_cache_kernel,
        grid=(tokens,),
        args={
            "k_ptr": k,
            "v_ptr": v,
            "kv_k_ptr": kv_k,
            "kv_v_ptr": kv_v,
            "slot_ptr": slot_mapping,
            "stride_kt": k.stride(0),
            "stride_kh": k.stride(1),
            "stride_vt": v.stride(0),
            "stride_vh": v.stride(1),
            "stride_cks": kv_k.stride(0),
            "stride_ckh": kv_k.stride(1),
            "stride_cvs": kv_v.stride(0),
            "stride_cvh": kv_v.stride(1),
        },
        constexprs={
            "KV_HEADS": kv_heads,
            "KV_HEADS_PAD": next_power_of_2(kv_heads),
            "HEAD_DIM": head_dim,
            "HEAD_DIM_PAD": next_power_of_2(head_dim),
        },
        num_warps=2,
    )
