"""Multimodal rotary embedding applied to q and k in one launch.

Takes the cos/sin [T, head_dim] that `workers.models.language.mrope_cos_sin` builds (in the activations'
dtype) and matches `apply_rotary` (the reference model's rotary, which `workers.models.language` uses) on
each of q [T, heads, D] and k [T, kv_heads, D], including its roundings: in bf16, ``x * cos`` and
``rotate_half(x) * sin`` are each rounded before their sum is.

`apply_qk_norm_mrope` is Qwen3's variant: every head of q and k RMS-normalised over head_dim (its q_norm / k_norm
weights) before the same rotary, in one launch that reads and writes q and k once.
"""

from __future__ import annotations

import torch

from workers.kernels._launch import use_triton
from workers.kernels.norm import rms_norm_reference

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


def apply_qk_norm_mrope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotary(rms_norm(q)), rotary(rms_norm(k))), each head normalised over head_dim: Qwen3's attention input."""
    q_normed, k_normed = rms_norm_reference(q, q_weight, eps), rms_norm_reference(k, k_weight, eps)
    return apply_rotary(q_normed, cos, sin), apply_rotary(k_normed, cos, sin)


def apply_qk_norm_mrope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normed and rotated (q, k) (weights [head_dim] in q's dtype); with ``inplace`` q and k are overwritten and
    returned. Triton on CUDA tensors, the reference otherwise."""
    if use_triton(q, k, q_weight, k_weight, cos, sin):
        return apply_qk_norm_mrope_triton(q, k, q_weight, k_weight, eps, cos, sin, inplace=inplace)
    q_out, k_out = apply_qk_norm_mrope_reference(q, k, q_weight, k_weight, eps, cos, sin)
    if not inplace:
        return q_out, k_out
    return q.copy_(q_out), k.copy_(k_out)


def apply_qk_norm_mrope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    from workers.kernels import rotary_triton

    check_inputs(q, k, cos, sin)
    head_dim = q.shape[2]
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if weight.shape != (head_dim,) or weight.dtype != q.dtype or weight.device != q.device:
            raise ValueError(
                f"{name} must be [{head_dim}] {q.dtype} on {q.device}, got {tuple(weight.shape)} {weight.dtype} "
                f"on {weight.device}"
            )
    norm = (q_weight.contiguous(), k_weight.contiguous(), eps)
    return rotary_triton.launch(q, k, cos, sin, inplace, norm)
