"""Writing new tokens' k/v into the flat paged cache slots (`PagedKVCache.write` as one kernel).

An FP8 cache (``kv_k``/``kv_v`` in float8_e4m3fn) stores each (token, kv head) vector quantized with its own
fp32 scale, kept beside the cache in ``k_scale``/``v_scale`` [slots, kv_heads]: ``scale = amax / 448`` over the
head_dim values, ``q = x * (1 / scale)`` rounded to e4m3 (`quantize_kv_reference`; the per-token dynamic quantization of
`workers.kernels.fp8`). Dynamic scales need no calibration data, which a static per-head scale would, and follow
Qwen's large k-bias outliers token by token; they cost 4 bytes per head vector (128 bytes at head_dim 128).
"""

from __future__ import annotations

import torch

from workers.kernels._launch import use_triton
from workers.kernels.fp8 import FP8, quantize_reference

KV_FP8 = FP8  # the FP8 cache's element type (e4m3: 3 mantissa bits; the scale carries the range)


def quantize_kv_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [T, kv_heads, D] float8_e4m3fn, scale [T, kv_heads] fp32) of x [T, kv_heads, D]: one scale per
    (token, head), amax over head_dim / 448; a zero vector gets a tiny scale and quantizes to zeros."""
    tokens, heads, head_dim = x.shape
    q, scale = quantize_reference(x.reshape(tokens * heads, head_dim), head_dim)
    return q.view(tokens, heads, head_dim), scale.view(tokens, heads)


def dequantize_kv_reference(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in fp32, rounded to ``dtype``: what the attention kernel computes from an FP8 tile."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def reshape_and_cache_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """kv_k[slot_mapping[t]] = k[t] (and v) for k, v [T, kv_heads, D] into kv_k, kv_v [slots, kv_heads, D];
    into an FP8 cache quantized, their scales into k_scale, v_scale [slots, kv_heads]."""
    if kv_k.dtype != KV_FP8:
        kv_k[slot_mapping] = k
        kv_v[slot_mapping] = v
        return
    if k_scale is None or v_scale is None:
        raise ValueError("an FP8 cache needs k_scale and v_scale")
    for x, cache, scales in ((k, kv_k, k_scale), (v, kv_v, v_scale)):
        q, scale = quantize_kv_reference(x)
        cache[slot_mapping] = q
        scales[slot_mapping] = scale


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store k, v at their slots in place (quantized, with their scales, into an FP8 cache); Triton on CUDA
    tensors, the reference otherwise.

    Slots must lie in [0, slots) and be distinct (as `BatchLayout.slot_mapping`'s are): the kernel cannot
    check without a device sync, and an out-of-range slot writes outside the cache.
    """
    if use_triton(k, v, kv_k, kv_v, slot_mapping):
        reshape_and_cache_triton(k, v, kv_k, kv_v, slot_mapping, k_scale, v_scale)
    else:
        reshape_and_cache_reference(k, v, kv_k, kv_v, slot_mapping, k_scale, v_scale)


def reshape_and_cache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    from workers.kernels import cache_triton

    check_inputs(k, v, kv_k, kv_v, slot_mapping)
    check_scales(kv_k, k_scale, v_scale)
    cache_triton.launch(k, v, kv_k, kv_v, slot_mapping, k_scale, v_scale)


def check_scales(kv_k: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """ValueError unless an FP8 cache [slots, kv_heads, D] comes with fp32 scales [slots, kv_heads] on its device
    (and a 16/32-bit cache with none)."""
    if kv_k.dtype != KV_FP8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"scales come with an FP8 cache only, the cache is {kv_k.dtype}")
        return
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            raise ValueError(f"an FP8 cache needs {name}")
        if scale.shape != kv_k.shape[:2] or scale.dtype != torch.float32 or scale.device != kv_k.device:
            raise ValueError(
                f"{name} must be float32 {tuple(kv_k.shape[:2])} on {kv_k.device}, got {scale.dtype} "
                f"{tuple(scale.shape)} on {scale.device}"
            )
        if scale.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous in kv_heads")


def check_inputs(
    k: torch.Tensor, v: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if k.ndim != 3 or v.shape != k.shape or kv_k.ndim != 3 or kv_v.shape != kv_k.shape:
        raise ValueError(
            f"k, v must be [T, kv_heads, D] alike and kv_k, kv_v [slots, kv_heads, D] alike, got {tuple(k.shape)}, "
            f"{tuple(v.shape)}, {tuple(kv_k.shape)}, {tuple(kv_v.shape)}"
        )
    if k.shape[1:] != kv_k.shape[1:]:
        raise ValueError(f"new k/v rows {tuple(k.shape[1:])} do not match the cache's {tuple(kv_k.shape[1:])}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be int32/int64 [{k.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if k.dtype != v.dtype or kv_k.dtype != kv_v.dtype or kv_k.dtype not in (k.dtype, KV_FP8):
        raise ValueError(
            f"k, v and the cache must share a dtype (or the cache be FP8), got {k.dtype}, {v.dtype}, {kv_k.dtype}, "
            f"{kv_v.dtype}"
        )
    if len({t.device for t in (k, v, kv_k, kv_v, slot_mapping)}) != 1:
        raise ValueError("k, v, the cache and slot_mapping must be on one device")
    if any(t.stride(-1) != 1 for t in (k, v, kv_k, kv_v)):
        raise ValueError("k, v and the cache must be contiguous in head_dim")
