"""The language model served from a block-FP8 checkpoint, through the engine's own paths (fused projections, paged
attention, the FP8 kernels `fp8_matmul` chooses), against the same model with every FP8 product computed by the
dequantizing reference on the activations those kernels see: the prefill's rounded per 1 x 128 group, the decode's
as they are. Whatever separates the two is the kernels' arithmetic (their accumulation order, Hopper's FP8 tensor
cores), never FP8's own rounding, so a wrong scale, a misplaced block of a fused projection or a kernel bug shows
as a large distance or lost argmax agreement. The 2b shape: several 128 x 128 blocks in every projection.

The per-channel model (``[model] quantization = "fp8"``, quantized at load) with its fused norms writing the prefill's
rows in FP8 for the qkv and gate_up after them (`workers.models.fp8_rows`) against the same model with the norms
writing bf16 rows that the GEMM's own kernel quantizes (`quantized_norms(False)`): the same quantized activations into
the same GEMMs, so equal where the compiled norm+quantize kernel is the unfused pair bit for bit
(tests/gpu/test_vision_fp8_gpu.py checks it); the bound is one bf16 rounding of the logits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu.test_engine_gpu import paged_logits
from tests.triton_setup import compiled_kernels_skip_reason
from workers.kernels import fp8, paged_attention
from workers.kernels.fp8 import dequantize_reference, fp8_matmul_reference, quantize_reference
from workers.models import fp8_rows
from workers.models.fp8_rows import quantized_norms, quantizes_for
from workers.models.language import LanguageModel
from workers.models.paged import FusedLayer, fuse_layers
from workers.models.registry import checkpoint_family, read_spec
from workers.models.synth import generate_checkpoint

_SKIP_REASON = compiled_kernels_skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")]

CUDA = torch.device("cuda")


def kernel_inputs(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The activations the chosen kernel multiplies: past DECODE_ROWS rows rounded per 1 x 128 group (per token for
    a per-channel weight) as the prefill paths do, as they are below."""
    if x.shape[0] <= fp8.DECODE_ROWS:
        return x
    group = x.shape[1] if block[1] >= x.shape[1] else fp8.GROUP
    q, s = quantize_reference(x, group)
    return dequantize_reference(q, s, (1, group)).to(x.dtype)


def reference_product(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None
) -> torch.Tensor:
    """What the chosen kernel computes, by the references: the exact product in fp32, rounded once."""
    return fp8_matmul_reference(kernel_inputs(x, block).float(), w, w_scale, block, bias).to(x.dtype)


def bf16_product(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None
) -> torch.Tensor:
    """The same product as cuBLAS's bf16 GEMM on the dequantized weight: another valid bf16 computation of the same
    model, whose distance to `reference_product`'s is the yardstick for the kernels'."""
    weight = dequantize_reference(w, w_scale, block).to(x.dtype)
    return torch.nn.functional.linear(kernel_inputs(x, block), weight, bias)


def logits_with(
    product: Callable[..., torch.Tensor],
    model: LanguageModel,
    ids: list[int],
    layers: list[FusedLayer],
    patch: pytest.MonkeyPatch,
) -> torch.Tensor:
    with patch.context() as scoped:
        for name in ("gemv", "scaled_mm", "scaled_mm_blockwise", "block"):
            scoped.setitem(fp8._PATHS, name, product)
        return paged_logits(model, ids, layers, paged_attention, 64)


def distance(logits: torch.Tensor, truth: torch.Tensor) -> tuple[float, float]:
    worst = ((logits - truth).abs() / truth.abs().amax(-1, keepdim=True)).max().item()
    return worst, (logits.argmax(-1) == truth.argmax(-1)).float().mean().item()


def test_2b_block_fp8_logits_through_the_engine_match_the_references(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = generate_checkpoint(tmp_path / "2b-fp8", "2b", seed=0, quantization="fp8-block")
    ids = [(37 * j) % 30000 + 100 for j in range(308)]  # a 300-token prefill, then 8 decode steps
    model = LanguageModel.from_checkpoint(path, device=CUDA, dtype=torch.bfloat16)
    layers = fuse_layers(model)
    kernels = paged_logits(model, ids, layers, paged_attention, 64)
    reference = logits_with(reference_product, model, ids, layers, monkeypatch)
    other_bf16 = logits_with(bf16_product, model, ids, layers, monkeypatch)
    worst, agree = distance(kernels, reference)
    base_worst, base_agree = distance(other_bf16, reference)
    print(
        f"2b block FP8 vs the references: kernels worst |diff| / row max {worst:.4f}, argmax agreement {agree:.3f}; "
        f"cuBLAS bf16 on the same inputs {base_worst:.4f}, {base_agree:.3f}"
    )
    # A kernel or scale error moves logits by far more than a second bf16 computation does; FP8's own rounding is
    # on both sides, so it is not what is measured.
    assert worst <= 2 * base_worst + 1e-3
    assert agree >= base_agree - 0.03


# The fused norms' logits against the unfused FP8 path's: max |diff| / the row's largest logit within one bf16 rounding
# (2^-8); a wrong scale, row or residual moves them by O(1), a flipped e4m3 rounding carried through 28 layers by more.
FUSED_BOUND = 2**-8


def test_2b_per_channel_fp8_prefill_with_the_fused_norm_quantization_equals_the_unfused_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = generate_checkpoint(tmp_path / "2b", "2b", seed=0)
    ids = [(37 * j) % 30000 + 100 for j in range(308)]  # a 300-token prefill, then 8 decode steps
    spec = read_spec(path, "fp8")
    model = checkpoint_family(path).language_model(path, device=CUDA, dtype=torch.bfloat16, spec=spec)
    layers = fuse_layers(model)
    prefill_rows = torch.empty(300, 1, device=CUDA, dtype=torch.bfloat16)
    consumers = [w for layer in layers for w in (layer.qkv_weight, layer.gate_up_weight)]
    assert all(quantizes_for(fp8_rows.fp8_of(w), prefill_rows) for w in consumers), "the fused path is not taken"
    calls: list[int] = []
    norm_quantize = fp8_rows.norm_quantize

    def counted(*args: Any) -> Any:
        calls.append(1)
        return norm_quantize(*args)

    monkeypatch.setattr(fp8_rows, "norm_quantize", counted)
    fused = paged_logits(model, ids, layers, paged_attention, 64)
    assert len(calls) == 2 * spec.num_layers  # the prefill's qkv and gate_up in every layer; no decode step
    with quantized_norms(False):
        unfused = paged_logits(model, ids, layers, paged_attention, 64)
    assert len(calls) == 2 * spec.num_layers
    worst, agree = distance(fused, unfused)
    print(
        f"2b per-channel FP8, fused norm quantization vs unfused: worst |diff| / row max {worst:.2e}, "
        f"argmax agreement {agree:.3f}, equal {torch.equal(fused, unfused)}"
    )
    assert fused.shape == unfused.shape and worst <= FUSED_BOUND and agree >= 0.99
