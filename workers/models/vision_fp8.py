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
less per such linear, the same numbers (`quantized_norms(False)` turns it off, for a comparison). Those helpers live in
`workers.models.fp8_rows`, which the language model's fused layers share. Likewise Qwen2-VL's MLP: its quick_gelu
writes fc2's rows in FP8 (`workers.kernels.fp8_act`), so its widest activation is neither written in bf16 nor read
back. The per-channel GEMMs add their biases in cuBLASLt's epilogue where this torch does that right
(`workers.kernels.fp8_bias`).
"""

from __future__ import annotations

import torch
from torch import nn

from common.quantization import QUANTIZATION_SETTINGS
from workers.models.fp8 import CHANNEL_SCALE, Fp8Linear, quantize_per_channel


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
