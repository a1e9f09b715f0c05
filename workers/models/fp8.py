"""FP8 linear weights: float8_e4m3fn values with fp32 scales, as the checkpoint formats of `common.quantization`
store them, and the one function every FP8 linear map runs through (`fp8_linear`).

One definition covers both formats: ``w[i, j] = weight[i, j] * scale[i // block_n, j // block_k]``. Block-wise
checkpoints have ``(block_n, block_k) = (128, 128)`` and the scale named ``weight_scale_inv``; compressed-tensors'
per-channel ones (and the load-time quantized model) ``(1, in_features)`` and ``weight_scale`` [out, 1]. A fused
projection whose parts do not end on a block row keeps its scales per row, ``(1, block_k)``.

On CPU `fp8_linear` dequantizes the weight exactly to that definition and multiplies in the activations' dtype: slow,
but the formats, the loader and the stack are tested with it. On CUDA it runs `workers.kernels.fp8.fp8_matmul`: a
Triton GEMV on the FP8 weights for decode, ``torch._scaled_mm`` for per-channel weights, a block-scaled Triton GEMM
for block-wise ones, activations quantized by Triton kernels.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels.fp8 import fp8_matmul

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
BLOCK_SCALE = "weight_scale_inv"  # FineGrainedFP8's name: w = weight * weight_scale_inv
CHANNEL_SCALE = "weight_scale"  # compressed-tensors' name: w = weight * weight_scale
SCALE_NAMES = (BLOCK_SCALE, CHANNEL_SCALE)
BLOCK = (128, 128)


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 weight [out, in] with its scales [ceil(out / block_n), ceil(in / block_k)]."""

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """``data[i, j] * scale[i // block_n, j // block_k]`` in fp32, rounded once to ``dtype``."""
        rows, cols = self.data.shape
        scale = self.scale.float().repeat_interleave(self.block[0], 0)[:rows]
        scale = scale.repeat_interleave(self.block[1], 1)[:, :cols]
        return (self.data.float() * scale).to(dtype)


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` for an FP8 weight: the one place an FP8 GEMM plugs in. On CUDA the FP8 kernels of
    `workers.kernels.fp8` (chosen by the number of rows and the scale layout); elsewhere the weight is dequantized to
    ``x``'s dtype (exact to the format) and multiplied as a plain linear map."""
    if x.is_cuda and weight.data.is_cuda:
        return fp8_matmul(x, weight.data, weight.scale, weight.block, bias)
    return F.linear(x, weight.dequantize(x.dtype), bias)


def linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a weight that may be FP8 (a fused projection's, `fuse_weights`)."""
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Fp8Linear(nn.Module):
    """A linear layer of FP8 weights; its state has the checkpoint's own names (``weight`` and ``weight_scale_inv``
    or ``weight_scale``, ``bias``), so a checkpoint's tensors load into it as they are."""

    def __init__(self, in_features: int, out_features: int, bias: bool, block: tuple[int, int] | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block = block or (1, in_features)
        self.scale_name = BLOCK_SCALE if block else CHANNEL_SCALE
        grid = (-(-out_features // self.block[0]), -(-in_features // self.block[1]))
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        self.register_parameter(self.scale_name, nn.Parameter(torch.empty(grid), requires_grad=False))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    @classmethod
    def like(cls, linear: nn.Linear, scale_name: str) -> Fp8Linear:
        """An FP8 layer of ``linear``'s shape, for a checkpoint whose scale tensor is ``scale_name``."""
        block = BLOCK if scale_name == BLOCK_SCALE else None
        return cls(linear.in_features, linear.out_features, linear.bias is not None, block)

    @property
    def scale(self) -> torch.Tensor:
        found: torch.Tensor = getattr(self, self.scale_name)
        return found

    def fp8_weight(self) -> Fp8Weight:
        return Fp8Weight(self.weight, self.scale, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.fp8_weight(), self.bias)


def channel_scale(amax: torch.Tensor) -> torch.Tensor:
    """The per-channel scale of rows whose largest magnitudes are ``amax`` [out, 1]: ``amax / 448`` (a row of zeros
    keeps a tiny scale, so its values stay 0)."""
    return (amax.float() / FP8_MAX).clamp(min=1e-12)


def quantize_per_channel(weight: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, scale [out, 1]) of a weight [out, in]: ``scale = amax / 448`` per row, as vLLM's and
    compressed-tensors' per-channel FP8 do. ``scale``: the rows' scale where it was found from more of each row than
    ``weight`` holds (a tensor-parallel rank's columns of a row-parallel weight, `workers.models.tensor_parallel`)."""
    if scale is None:
        scale = channel_scale(weight.float().abs().amax(dim=1, keepdim=True))
    return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_state(state: Mapping[str, torch.Tensor], names: Sequence[str]) -> dict[str, torch.Tensor]:
    """``state`` with the weights ``names`` (each ``<module>.weight``) in FP8 beside their ``weight_scale``: the one
    ``state`` holds beside a weight already (the whole rows' scale of a tensor-parallel shard), else its rows'."""
    out = dict(state)
    for name in names:
        scale_name = name.removesuffix("weight") + CHANNEL_SCALE
        out[name], out[scale_name] = quantize_per_channel(state[name], state.get(scale_name))
    return out


def adopt_fp8_layers(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Replace each ``nn.Linear`` of ``module`` whose scale tensor ``state`` holds by an `Fp8Linear` of its shape, so
    that the checkpoint decides which layers are FP8 (its ``modules_to_not_convert`` / ``ignore`` are the layers it
    left without scales). ValueError where an FP8 weight comes without its scale."""
    scaled = {name.rsplit(".", 1)[0]: name.rsplit(".", 1)[1] for name in state if name.endswith(SCALE_NAMES)}
    unscaled = [n for n, t in state.items() if t.dtype == FP8 and n.removesuffix(".weight") not in scaled]
    if unscaled:
        raise ValueError(f"FP8 weights without a weight_scale_inv or weight_scale beside them: {unscaled[:8]}")
    for name, child in list(module.named_modules()):
        if name in scaled and isinstance(child, nn.Linear):
            parent, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, leaf, Fp8Linear.like(child, scaled[name]))


def fuse_weights(parts: Sequence[Fp8Weight]) -> Fp8Weight:
    """The parts' weights concatenated along their rows (q/k/v, gate/up) with scales that describe them exactly:
    the parts' own block grids stacked where every part but the last ends on a block row, else per row."""
    blocks = {part.block for part in parts}
    if len(blocks) != 1:
        raise ValueError(f"cannot fuse FP8 weights of different scale blocks {sorted(blocks)}")
    block = parts[0].block
    data = torch.cat([part.data for part in parts])
    if all(part.shape[0] % block[0] == 0 for part in parts[:-1]):
        return Fp8Weight(data, torch.cat([part.scale for part in parts]), block)
    rows = [part.scale.repeat_interleave(block[0], 0)[: part.shape[0]] for part in parts]
    return Fp8Weight(data, torch.cat(rows), (1, block[1]))
