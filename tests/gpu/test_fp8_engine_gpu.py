"""The language model served from a block-FP8 checkpoint, through the engine's own paths (fused projections, paged
attention, the FP8 kernels `fp8_matmul` chooses), against the same model with every FP8 product computed by the
dequantizing reference on the activations those kernels see: the prefill's rounded per 1 x 128 group, the decode's
as they are. Whatever separates the two is the kernels' arithmetic (their accumulation order, Hopper's FP8 tensor
cores), never FP8's own rounding, so a wrong scale, a misplaced block of a fused projection or a kernel bug shows
as a large distance or lost argmax agreement. The 2b shape: several 128 x 128 blocks in every projection."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.test_engine_gpu import paged_logits
from tests.triton_setup import compiled_kernels_skip_reason
from workers.kernels import fp8, paged_attention
from workers.kernels.fp8 import dequantize_reference, fp8_matmul_reference, quantize_reference
from workers.models.language import LanguageModel
from workers.models.paged import fuse_layers
from workers.models.synth import generate_checkpoint

_SKIP_REASON = compiled_kernels_skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")]

CUDA = torch.device("cuda")


def reference_product(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None
) -> torch.Tensor:
    """What the chosen kernel computes, by the references: activations of more than DECODE_ROWS rows rounded per
    1 x 128 group (per token for a per-channel weight) as the prefill paths do, then the exact product."""
    if x.shape[0] > fp8.DECODE_ROWS:
        group = x.shape[1] if block[1] >= x.shape[1] else fp8.GROUP
        q, s = quantize_reference(x, group)
        x = dequantize_reference(q, s, (1, group)).to(x.dtype)
    return fp8_matmul_reference(x.float(), w, w_scale, block, bias)


def test_2b_block_fp8_logits_through_the_engine_match_the_references(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = generate_checkpoint(tmp_path / "2b-fp8", "2b", seed=0, quantization="fp8-block")
    ids = [(37 * j) % 30000 + 100 for j in range(308)]  # a 300-token prefill, then 8 decode steps
    model = LanguageModel.from_checkpoint(path, device=CUDA, dtype=torch.bfloat16)
    layers = fuse_layers(model)
    kernels = paged_logits(model, ids, layers, paged_attention, 64)
    with monkeypatch.context() as patch:
        patch.setitem(fp8._PATHS, "gemv", reference_product)
        for name in ("scaled_mm", "scaled_mm_blockwise", "block"):
            patch.setitem(fp8._PATHS, name, reference_product)
        reference = paged_logits(model, ids, layers, paged_attention, 64)
    scale = reference.abs().amax(-1, keepdim=True)
    worst = ((kernels - reference).abs() / scale).max().item()
    agree = (kernels.argmax(-1) == reference.argmax(-1)).float().mean().item()
    prefill_agree = (kernels[:300].argmax(-1) == reference[:300].argmax(-1)).float().mean().item()
    print(f"2b block FP8, kernels vs references: worst |diff| / row max {worst:.4f}, argmax agreement {agree:.3f}")
    # bf16 activations between layers on both sides: the distance of two bf16 computations of one model (the bf16
    # engine test's transformers-bf16-vs-fp32 is the scale), far below FP8's own rounding.
    assert worst < 0.05
    assert agree >= 0.95 and prefill_agree >= 0.95
