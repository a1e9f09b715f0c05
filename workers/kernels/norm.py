"""RMSNorm, alone and fused with the residual add that precedes it in every decoder layer; and LayerNorm
fused with the residual add before it (the vision tower's blocks).

RMSNorm numerically as the reference model's (`rms_norm_reference`, which `workers.models.language` uses): the
mean square in fp32, the normalised row cast back to the input dtype, then multiplied by the weight (in the
promoted dtype of weight and input).
LayerNorm as torch's: statistics and the affine map in fp32, rounded once to the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.kernels._launch import use_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, cast back to x's dtype *before* the weight multiply (as the reference)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to the input dtype first (as the layer's)."""
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden], weight [hidden]; Triton on CUDA tensors, the reference otherwise."""
    if use_triton(x, weight):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual) for ``new_residual = x + residual``; out of place, one pass over the rows."""
    if use_triton(x, residual, weight):
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_reference(x, residual, weight, eps)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from workers.kernels import norm_triton

    check_inputs(x, weight)
    return norm_triton.launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    from workers.kernels import norm_triton

    check_inputs(x, weight, residual)
    normed, summed = norm_triton.launch(x, residual, weight, eps)
    return normed, summed


def check_inputs(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    if x.ndim < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [hidden] for x [..., hidden], got {tuple(weight.shape)} and {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} must match x {x.dtype} {tuple(x.shape)}")
    floats = (torch.float32, torch.float16, torch.bfloat16)
    if x.dtype not in floats or weight.dtype not in floats:
        raise ValueError(f"x and weight must be fp32, fp16 or bf16, got {x.dtype} and {weight.dtype}")
    tensors = [x, weight] if residual is None else [x, weight, residual]
    if len({t.device for t in tensors}) != 1:
        raise ValueError("x, weight and residual must be on one device")


def fused_add_layer_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x + residual), x + residual), the sum rounded to the input dtype first."""
    summed = x + residual
    return F.layer_norm(summed, (summed.shape[-1],), weight, bias, eps), summed


def fused_add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, x + residual): one pass over the rows where torch takes two kernels and five. Triton on CUDA
    tensors, the reference otherwise."""
    if use_triton(x, residual, weight, bias):
        return fused_add_layer_norm_triton(x, residual, weight, bias, eps)
    return fused_add_layer_norm_reference(x, residual, weight, bias, eps)


def fused_add_layer_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    from workers.kernels import norm_triton

    check_inputs(x, weight, residual)
    if bias.shape != weight.shape or bias.dtype != weight.dtype or bias.device != weight.device:
        raise ValueError(
            f"bias must match weight {weight.dtype} {tuple(weight.shape)}, got {bias.dtype} {tuple(bias.shape)}"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"weight must be in x's dtype {x.dtype} (the tower's are), got {weight.dtype}")
    normed, summed = norm_triton.launch(x, residual, weight, eps, bias)
    return normed, summed
