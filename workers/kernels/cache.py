"""Writing new tokens' k/v into the flat paged cache slots (`PagedKVCache.write` as one kernel)."""

from __future__ import annotations

import torch

from workers.kernels._launch import use_triton


def reshape_and_cache_reference(
    k: torch.Tensor, v: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """kv_k[slot_mapping[t]] = k[t] (and v) for k, v [T, kv_heads, D] into kv_k, kv_v [slots, kv_heads, D]."""
    kv_k[slot_mapping] = k
    kv_v[slot_mapping] = v


def reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k, v at their slots in place; Triton on CUDA tensors, the reference otherwise.

    Slots must lie in [0, slots) and be distinct (as `BatchLayout.slot_mapping`'s are): the kernel cannot
    check without a device sync, and an out-of-range slot writes outside the cache.
    """
    if use_triton(k, v, kv_k, kv_v, slot_mapping):
        reshape_and_cache_triton(k, v, kv_k, kv_v, slot_mapping)
    else:
        reshape_and_cache_reference(k, v, kv_k, kv_v, slot_mapping)


def reshape_and_cache_triton(
    k: torch.Tensor, v: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    from workers.kernels import cache_triton

    check_inputs(k, v, kv_k, kv_v, slot_mapping)
    cache_triton.launch(k, v, kv_k, kv_v, slot_mapping)


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
    if not k.dtype == v.dtype == kv_k.dtype == kv_v.dtype:
        raise ValueError(f"k, v and the cache must share a dtype, got {k.dtype}, {v.dtype}, {kv_k.dtype}, {kv_v.dtype}")
    if len({t.device for t in (k, v, kv_k, kv_v, slot_mapping)}) != 1:
        raise ValueError("k, v, the cache and slot_mapping must be on one device")
    if any(t.stride(-1) != 1 for t in (k, v, kv_k, kv_v)):
        raise ValueError("k, v and the cache must be contiguous in head_dim")
