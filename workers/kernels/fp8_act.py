"""The vision MLP's activation with the FP8 quantization of the GEMM after it fused in: ``quick_gelu`` (Qwen2-VL's
``x * sigmoid(1.702 x)``) of fc1's output, written as float8_e4m3fn with one scale per row (per token), in place of
the bf16 rows that fc2's `workers.kernels.fp8.fp8_matmul` would quantize in a kernel of its own: the widest
intermediate of the tower is then written once, in FP8, and not read back. `workers.kernels.fp8.fp8_matmul_quantized`
takes what it writes.

The reference, exactly: `workers.kernels.vision.quick_gelu` (its Triton kernel on CUDA, torch's ops elsewhere),
whose output is rounded to the rows' dtype, then `fp8.quantize_reference(act, K)`: what the unfused FP8 path
computes. The Triton kernel (`fp8_act_triton`) is that bit for bit (tests/unit/test_fp8_act_kernels.py, in Triton's
interpreter, against the reference).
"""

from __future__ import annotations

import torch

from workers.kernels._launch import use_triton
from workers.kernels.fp8 import quantize_reference
from workers.kernels.vision import quick_gelu

MAX_COLUMNS = 16384  # one row in one program's registers: wider rows take the activation and quantization apart


def quick_gelu_quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, K] float8_e4m3fn, scales [M, 1] fp32) of ``quick_gelu(x)`` quantized per token."""
    return quantize_reference(quick_gelu(x), x.shape[-1])


def quick_gelu_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quick_gelu_quantize_reference` as one Triton kernel on CUDA tensors (the reference elsewhere): x [M, K] bf16
    or fp16 with unit column stride, K at most `MAX_COLUMNS`."""
    check_inputs(x)
    if use_triton(x):
        from workers.kernels import fp8_act_triton

        return fp8_act_triton.launch_quick_gelu_quantize(x)
    return quick_gelu_quantize_reference(x)


def check_inputs(x: torch.Tensor) -> None:
    if x.ndim != 2 or x.stride(-1) != 1 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bf16 or fp16 [M, K] with unit column stride, got {x.dtype} {tuple(x.shape)}")
    if x.shape[1] > MAX_COLUMNS:
        raise ValueError(f"rows of {x.shape[1]} columns are over the {MAX_COLUMNS} one program holds")
