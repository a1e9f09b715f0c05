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
from workers.kernels.rotary import rotate_half


def apply_vision_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, heads, head_dim] in fp32 (as the reference does), returning x's dtype."""
    xf = x.float()
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


def vision_rotary_qk_reference(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [N, 3 * heads * D] -> rotated q, rotated k and v, each [N, heads, D] in qkv's dtype."""
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

    _check_rotary_inputs(qkv, cos, sin, heads)
    return vision_triton.launch_rotary(qkv, cos, sin, heads)


def vision_rotary_qk_into(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, padded: torch.Tensor, dest: torch.Tensor
) -> None:
    """Rotated q and k, and v, written into rows ``dest`` of ``padded`` [3, rows, heads, padded_dim] (their
    first head_dim coordinates; the rest untouched): Triton on CUDA tensors, the reference otherwise."""
    if use_triton(qkv, cos, sin, padded, dest):
        vision_rotary_qk_into_triton(qkv, cos, sin, heads, padded, dest)
        return
    for part, x in zip(padded, vision_rotary_qk_reference(qkv, cos, sin, heads), strict=True):
        part[dest, :, : x.shape[-1]] = x


def vision_rotary_qk_into_triton(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, padded: torch.Tensor, dest: torch.Tensor
) -> None:
    from workers.kernels import vision_triton

    head_dim = _check_rotary_inputs(qkv, cos, sin, heads)
    if padded.ndim != 4 or padded.shape[0] != 3 or padded.shape[2] != heads or padded.shape[3] < head_dim:
        raise ValueError(f"padded must be [3, rows, {heads}, >= {head_dim}], got {tuple(padded.shape)}")
    if padded.stride(3) != 1 or padded.dtype != qkv.dtype:
        raise ValueError(f"padded must be {qkv.dtype} with its last dimension contiguous")
    if dest.shape != (qkv.shape[0],) or dest.dtype != torch.int64:
        raise ValueError(f"dest must be int64 [{qkv.shape[0]}], got {dest.dtype} {tuple(dest.shape)}")
    vision_triton.launch_rotary_into(qkv, cos, sin, heads, padded, dest)


def _check_rotary_inputs(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> int:
    """head_dim, once qkv and the tables are shaped as the kernel needs."""
    n = qkv.shape[0]
    if qkv.ndim != 2 or qkv.shape[1] % (3 * heads) or (qkv.shape[1] // (3 * heads)) % 2:
        raise ValueError(f"qkv must be [N, 3 * {heads} * head_dim] with an even head_dim, got {tuple(qkv.shape)}")
    head_dim = qkv.shape[1] // (3 * heads)
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (n, head_dim) or table.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 [{n}, {head_dim}], got {table.dtype} {tuple(table.shape)}")
    return head_dim


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
