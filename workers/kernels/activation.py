"""The MLP's gate: silu(gate) * up.

`workers.models.language.mlp` keeps the gate and up projections separate, so this takes them as two
tensors. A merged gate_up projection can pass its two halves as views (``gate_up[..., :I]``,
``gate_up[..., I:]``): the kernel follows row strides, so no copy is made.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.kernels._launch import use_triton


def silu_and_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] -> [..., I]; Triton on CUDA tensors, the reference otherwise."""
    if use_triton(gate, up):
        return silu_and_mul_triton(gate, up)
    return silu_and_mul_reference(gate, up)


def silu_and_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    from workers.kernels import activation_triton

    check_inputs(gate, up)
    return activation_triton.launch(gate, up)


def check_inputs(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(
            f"gate and up must match in shape, dtype and device, got {gate.dtype} {tuple(gate.shape)} on "
            f"{gate.device} and {up.dtype} {tuple(up.shape)} on {up.device}"
        )
    if gate.ndim < 1 or gate.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"gate and up must be fp32, fp16 or bf16 [..., I], got {gate.dtype} {tuple(gate.shape)}")
