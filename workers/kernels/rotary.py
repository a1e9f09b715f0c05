"""Multimodal rotary embedding applied to q and k in one launch.

Takes the cos/sin [T, head_dim] that `workers.models.language.mrope_cos_sin` builds (in the activations'
dtype) and matches `apply_rotary` (the reference model's rotary, which `workers.models.language` uses) on
each of q [T, heads, D] and k [T, kv_heads, D], including its roundings: in bf16, ``x * cos`` and
``rotate_half(x) * sin`` are each rounded before their sum is.
"""

from __future__ import annotations

import torch

from workers.kernels._launch import use_triton

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, head_dim] in x's dtype."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def apply_mrope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_mrope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (q, k); with ``inplace`` q and k themselves are overwritten and returned.

    Triton on CUDA tensors, the reference otherwise.
    """
    if use_triton(q, k, cos, sin):
        return apply_mrope_triton(q, k, cos, sin, inplace=inplace)
    q_rot, k_rot = apply_mrope_reference(q, k, cos, sin)
    if not inplace:
        return q_rot, k_rot
    return q.copy_(q_rot), k.copy_(k_rot)


def apply_mrope_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    from workers.kernels import rotary_triton

    check_inputs(q, k, cos, sin)
    return rotary_triton.launch(q, k, cos, sin, inplace)


def check_inputs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.ndim != 3 or k.ndim != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must be [T, heads, D] and [T, kv_heads, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if cos.shape != (tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [{tokens}, {head_dim}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if not q.dtype == k.dtype == cos.dtype == sin.dtype or q.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"q, k, cos, sin must share fp32, fp16 or bf16, got {q.dtype}, {k.dtype}, {cos.dtype}, {sin.dtype}"
        )
    if len({t.device for t in (q, k, cos, sin)}) != 1:
        raise ValueError("q, k, cos and sin must be on one device")
    if any(t.stride(-1) != 1 for t in (q, k, cos, sin)):
        raise ValueError("q, k, cos and sin must be contiguous in their last dimension")
