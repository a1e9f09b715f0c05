"""``[encoder] quantization``: the vision tower's linear layers in the format the setting serves them in.

Every family's tower loads as the checkpoint stores it (`workers.models.weights.built_and_loaded`: a linear is an
`Fp8Linear` exactly where the checkpoint holds its scale, so a ``modules_to_not_convert`` / ``ignore`` entry loads in
the model dtype). `serve_linears` then turns that into what the setting asks for:

* ``"auto"``: nothing changes.
* ``"none"``: every `Fp8Linear` becomes an ``nn.Linear`` of its weight dequantized exactly (`Fp8Weight.dequantize`).
* ``"fp8"``: every ``nn.Linear`` (attention qkv and proj, the MLP's, the mergers') becomes an `Fp8Linear` of its weight
  quantized per output channel (`quantize_per_channel`, the compressed-tensors layout); FP8 layers the checkpoint
  stored stay as they are (quantizing them again would round twice). Attention itself, the norms, the patch
  embedding (a Conv3d) and Qwen3-VL's position table are no linear layers and stay in the model dtype.

Biases stay in the model dtype either way.

On CUDA, where a block's norm feeds an FP8 per-channel linear that `workers.kernels.fp8.fp8_matmul` would run on its
``scaled_mm`` path (more than `fp8.DECODE_ROWS` rows), the norm kernel writes its rows in FP8 with their per-token
scales (`workers.kernels.fp8_norm`) and the linear takes them as they are (`QuantizedRows`, `linear_on`): one kernel
less per such linear, the same numbers (`quantized_norms(False)` turns it off, for a comparison).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from common.quantization import QUANTIZATION_SETTINGS
from workers.kernels import fp8
from workers.kernels._launch import triton_available
from workers.models.fp8 import CHANNEL_SCALE, Fp8Linear, Fp8Weight, quantize_per_channel


def serve_linears(tower: nn.Module, setting: str, dtype: torch.dtype) -> nn.Module:
    """``tower`` (loaded as its checkpoint stores it) with its linear layers as ``[encoder] quantization`` =
    ``setting`` serves them, changed in place and returned; ``dtype``: the tower's model dtype."""
    if setting not in QUANTIZATION_SETTINGS:
        raise ValueError(f"[encoder] quantization: expected 'auto', 'none' or 'fp8', got {setting!r}")
    if setting == "auto":
        return tower
    for name, child in list(tower.named_modules()):
        if setting == "none" and isinstance(child, Fp8Linear):
            _replace(tower, name, dequantized(child, dtype))
        elif setting == "fp8" and type(child) is nn.Linear:
            _replace(tower, name, quantized(child))
    return tower


def quantized(linear: nn.Linear) -> Fp8Linear:
    """An `Fp8Linear` of ``linear``'s weight with one scale per output row (``amax / 448``), its bias kept."""
    values, scale = quantize_per_channel(linear.weight.detach())
    with torch.device("meta"):
        layer = Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None, None)
    layer.weight = nn.Parameter(values, requires_grad=False)
    setattr(layer, CHANNEL_SCALE, nn.Parameter(scale, requires_grad=False))
    layer.bias = linear.bias
    return layer


def dequantized(layer: Fp8Linear, dtype: torch.dtype) -> nn.Linear:
    """An ``nn.Linear`` of ``layer``'s weight dequantized to ``dtype`` (exact to its format, rounded once)."""
    weight = layer.fp8_weight().dequantize(dtype)
    with torch.device("meta"):
        linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach().to(dtype), requires_grad=False)
    return linear


def fp8_linear_names(tower: nn.Module) -> list[str]:
    """The names of the tower's FP8 linear layers, in module order (what a check or a log line reports)."""
    return [name for name, child in tower.named_modules() if isinstance(child, Fp8Linear)]


def _replace(root: nn.Module, name: str, layer: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, layer)


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
