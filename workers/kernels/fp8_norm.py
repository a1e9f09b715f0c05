"""The vision tower's norm with the FP8 activation quantization of the GEMM after it fused in: (residual add,) LayerNorm
or RMSNorm, and the normalised rows written as float8_e4m3fn with one scale per row (per token: ``group = K``), in
place of the bf16 rows that `workers.kernels.fp8.fp8_matmul`'s ``scaled_mm`` path would quantize in a kernel of its
own. `workers.kernels.fp8.fp8_matmul_quantized` takes what it writes.

The reference, exactly: the norm as `workers.kernels.norm` computes it for the same tensors (`fused_add_layer_norm`,
`fused_add_rms_norm`, `rms_norm`; their Triton kernel on CUDA), whose output is rounded to the rows' dtype, then
`fp8.quantize_reference(normed, K)`: what the unfused FP8 path computes. The Triton kernel (`fp8_norm_triton`) is that
bit for bit (tests/unit/test_fp8_norm_kernels.py, in Triton's interpreter, against the norm kernel's output).
"""

from __future__ import annotations

import torch

from workers.kernels import norm
from workers.kernels._launch import use_triton
from workers.kernels.fp8 import quantize_reference


def norm_quantize_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q [M, K], scales [M, 1], x + residual or None) for x [M, K]: LayerNorm after the residual add where ``bias``
    is given, RMSNorm with or without it otherwise, through `workers.kernels.norm` (its kernels on CUDA, its torch
    references elsewhere), then quantized per token by `quantize_reference`."""
    summed = None
    if bias is not None and residual is not None:
        normed, summed = norm.fused_add_layer_norm(x, residual, weight, bias, eps)
    elif residual is not None:
        normed, summed = norm.fused_add_rms_norm(x, residual, weight, eps)
    else:
        normed = norm.rms_norm(x, weight, eps)
    q, s = quantize_reference(normed, x.shape[-1])
    return q, s, summed


def norm_quantize(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`norm_quantize_reference` as one Triton kernel on CUDA tensors (the reference elsewhere): x [M, K] (and
    residual) bf16 or fp16 with unit column stride, weight (and bias) [K] in x's dtype."""
    check_inputs(x, residual, weight, bias)
    if use_triton(x, weight):
        return norm_quantize_triton(x, residual, weight, eps, bias)
    return norm_quantize_reference(x, residual, weight, eps, bias)


def norm_quantize_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    from workers.kernels import fp8_norm_triton

    check_inputs(x, residual, weight, bias)
    return fp8_norm_triton.launch(x, residual, weight, eps, bias)


def check_inputs(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    if x.ndim != 2 or x.stride(-1) != 1 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bf16 or fp16 [M, K] with unit column stride, got {x.dtype} {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} must match x {x.dtype} {tuple(x.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.shape != (x.shape[1],) or t.dtype != x.dtype):
            raise ValueError(f"{name} must be [{x.shape[1]}] in x's dtype {x.dtype}, got {t.dtype} {tuple(t.shape)}")
    if bias is not None and residual is None:
        # (the towers' first LayerNorm is torch's, which this kernel's arithmetic does not reproduce bit for bit)
        raise ValueError("a LayerNorm is fused with its quantization after a residual add only: pass the residual")
    tensors = [t for t in (x, residual, weight, bias) if t is not None]
    if len({t.device for t in tensors}) != 1:
        raise ValueError("x, residual, weight and bias must be on one device")
