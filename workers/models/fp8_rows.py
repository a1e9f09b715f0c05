"""Rows a norm kernel writes already quantized for the per-channel FP8 linear after it, shared by the vision towers
(`workers.models.vision_fp8`) and the language model's fused layers (`workers.models.paged`).

On CUDA, where a norm feeds an FP8 per-channel linear that `workers.kernels.fp8.fp8_matmul` would run on its
``scaled_mm`` path (more than `fp8.DECODE_ROWS` rows; or its ``block`` path on the same per-token scales), the norm
kernel writes its rows in FP8 with their per-token scales (`workers.kernels.fp8_norm`) and the linear takes them as
they are (`QuantizedRows`, `linear_on`, `quantized_linear`): one kernel less per such linear, the same numbers
(`quantized_norms(False)` turns it off, for a comparison). Everywhere else (decode rows, block-wise weights, bf16
weights, the CPU) the norms write their rows in the model dtype as before.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from workers.kernels import fp8
from workers.kernels._launch import triton_available
from workers.kernels.fp8_norm import norm_quantize
from workers.kernels.norm import fused_add_rms_norm, rms_norm
from workers.models.fp8 import Fp8Linear, Fp8Weight, linear
from workers.models.language import RMSNorm

# --- activations quantized by the norm before the linear -----------------------------------------------------------


@dataclass(frozen=True)
class QuantizedRows:
    """Normalised rows in FP8 with one scale per row (``data`` [M, K] float8_e4m3fn, ``scale`` [M, 1] fp32), as a
    norm kernel writes them for the per-channel FP8 linear after it; ``dtype``: the rows' own (the product's)."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


Rows = torch.Tensor | QuantizedRows

_FUSED = [True]  # whether the norms quantize for the linear after them where they can (`quantized_norms`)


@contextlib.contextmanager
def quantized_norms(enabled: bool) -> Iterator[None]:
    """Within it, the towers' norms quantize for the FP8 linear after them (True, the default) or write their rows
    in the model dtype for the linear's own quantization (False: the unfused path, which tests and benchmarks compare
    with)."""
    before = _FUSED[0]
    _FUSED[0] = enabled
    try:
        yield
    finally:
        _FUSED[0] = before


def takes_quantized_rows(weight: Fp8Weight | None, rows: int, capability: tuple[int, int] | None) -> bool:
    """Whether the norm before a linear of ``weight`` (None: not FP8) over ``rows`` rows should write them in FP8: where
    `fp8.fp8_matmul` would quantize them per token itself, i.e. a per-channel weight past the decode rows (its
    ``scaled_mm`` path, ``torch._scaled_mm``; or its ``block`` path where N or K is not a multiple of 16, as
    Qwen2.5-VL-7B's gate|up, the Triton GEMM on the same per-token scales); ``capability``: the CUDA device's, None
    off CUDA (the CPU runs the reference's ops unchanged)."""
    if weight is None or capability is None or not _FUSED[0]:
        return False
    n, k = weight.shape
    per_channel = weight.block[0] == 1 and weight.block[1] >= k
    return per_channel and fp8.choose_path(rows, n, k, weight.block, capability) in ("scaled_mm", "block")


def quantizes_for(weight: Fp8Weight | None, x: torch.Tensor) -> bool:
    """`takes_quantized_rows` for the rows of ``x`` [M, K] on its device."""
    if weight is None or not (x.is_cuda and weight.data.is_cuda and triton_available()):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16):  # (the norm kernels' FP8 outputs are for these)
        return False
    return takes_quantized_rows(weight, x.shape[0], _capability(x.device))


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(device)
    return major, minor


def fp8_weight_of(layer: nn.Module | None) -> Fp8Weight | None:
    """``layer``'s FP8 weight, None where it is not an `Fp8Linear` (or there is no layer)."""
    return layer.fp8_weight() if isinstance(layer, Fp8Linear) else None


def linear_on(layer: nn.Module, x: Rows) -> torch.Tensor:
    """``layer(x)``, for rows in the model dtype or already quantized for the layer (`QuantizedRows`)."""
    if isinstance(x, torch.Tensor):
        result: torch.Tensor = layer(x)
        return result
    weight = fp8_weight_of(layer)
    if weight is None:
        raise ValueError(f"rows quantized to FP8 reach a {type(layer).__name__}, which takes them in the model dtype")
    return quantized_linear(x, weight, layer.bias)


def quantized_linear(x: QuantizedRows, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    return fp8.fp8_matmul_quantized(x.data, x.scale, weight.data, weight.scale, weight.block, bias, x.dtype)


def fused_linear(x: Rows, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`workers.models.fp8.linear` of a fused projection's weight (`workers.models.paged.FusedLayer`), for rows in
    the model dtype or already quantized for it (`QuantizedRows`, which only a per-channel FP8 weight takes)."""
    if isinstance(x, torch.Tensor):
        return linear(x, weight, bias)
    if not isinstance(weight, Fp8Weight):
        raise ValueError("rows quantized to FP8 reach a weight in the model dtype, which takes them unquantized")
    return quantized_linear(x, weight, bias)


def fp8_of(weight: torch.Tensor | Fp8Weight) -> Fp8Weight | None:
    """A fused projection's weight as `quantizes_for` takes it: None where it is in the model dtype."""
    return weight if isinstance(weight, Fp8Weight) else None


def add_and_rms_norm(
    update: torch.Tensor | None, stream: torch.Tensor, norm: RMSNorm, consumer: Fp8Weight | None
) -> tuple[torch.Tensor, Rows]:
    """(stream + update, its RMSNorm), or (stream, its RMSNorm) without an update: one Triton kernel on CUDA. Where
    the norm feeds an FP8 per-channel ``consumer`` that would quantize its rows per token (`quantizes_for`), the kernel
    writes them quantized (`QuantizedRows`) instead."""
    if quantizes_for(consumer, stream):
        q, scale, summed = norm_quantize(
            stream if update is None else update, None if update is None else stream, norm.weight, norm.eps
        )
        return (stream if summed is None else summed), QuantizedRows(q, scale, stream.dtype)
    if update is None:
        return stream, rms_norm(stream, norm.weight, norm.eps)
    normed, summed = fused_add_rms_norm(update, stream, norm.weight, norm.eps)
    return summed, normed
