"""The vision tower's elementwise work, fused: 2-D rotary on q and k straight from the qkv projection, and
QuickGELU.

Unfused, the tower's rotary upcasts q and k to fp32, rotates them through half a dozen temporaries and
casts back (about 10 kernels and ~0.5 GB of traffic per block at 720p), and QuickGELU is three kernels over
the MLP's widest activation. Each kernel here reads its input once and writes its output once, with the
reference's arithmetic: rotary in fp32 from the same cos/sin tables, QuickGELU rounded where torch rounds.
"""

from __future__ import annotations

import torch

from workers.kernels._launch import use_triton


def vision_rotary_qk_reference(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [N, 3 * heads * D] -> rotated q, rotated k and v, each [N, heads, D] in qkv's dtype."""
    from workers.models.vision import apply_vision_rotary

    q, k, v = qkv.view(qkv.shape[0], 3, heads, -1).unbind(1)
    return apply_vision_rotary(q, cos, sin), apply_vision_rotary(k, cos, sin), v


def vision_rotary_qk(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton on CUDA tensors, the reference otherwise; v is a view of qkv either way."""
    if use_triton(qkv, cos, sin):
        return vision_rotary_qk_triton(qkv, cos, sin, heads)
    return vision_rotary_qk_reference(qkv, cos, sin, heads)


def vision_rotary_qk_triton(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from workers.kernels import vision_triton

    n = qkv.shape[0]
    if qkv.ndim != 2 or qkv.shape[1] % (3 * heads) or (qkv.shape[1] // (3 * heads)) % 2:
        raise ValueError(f"qkv must be [N, 3 * {heads} * head_dim] with an even head_dim, got {tuple(qkv.shape)}")
    head_dim = qkv.shape[1] // (3 * heads)
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (n, head_dim) or table.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 [{n}, {head_dim}], got {table.dtype} {tuple(table.shape)}")
    return vision_triton.launch_rotary(qkv, cos, sin, heads)


def quick_gelu_reference(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x): Triton on CUDA tensors, the reference otherwise."""
    if use_triton(x):
        return quick_gelu_triton(x)
    return quick_gelu_reference(x)


def quick_gelu_triton(x: torch.Tensor) -> torch.Tensor:
    from workers.kernels import vision_triton

    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"quick_gelu takes fp32, fp16 or bf16, got {x.dtype}")
    return vision_triton.launch_quick_gelu(x.contiguous())
