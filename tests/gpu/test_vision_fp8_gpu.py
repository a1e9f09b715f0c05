"""``[encoder] quantization = "fp8"`` on the GPU: every family's vision tower at its 7B/8B checkpoint's shape (all its
blocks, transformers' random initialisation) with its linear layers in FP8 (`workers.models.vision_fp8`, run by
`workers.kernels.fp8`'s per-token-quantized GEMMs), against the same tower in bf16 on the same pixels.

The bound: tests/unit/test_vision_fp8.py explains the per-layer error of e4m3 weights (an RMS relative error of
about 2^-4 / sqrt(3) ~ 0.036); on the GPU the activations are quantized per token too, which adds about as much
again, and on random weights the blocks' errors grow with depth. Emulated on the CPU at full depth (weights and
activations rounded as the kernels do, fp32 arithmetic, one 448x448 image), the distance was about 0.10 for the
Qwen2-VL-7B shape and 0.17 for Qwen2.5-VL-7B's (RMSNorm, gated MLP: two rounded projections multiplied); docs/
quantization.md. `BOUND` is twice the larger (Qwen3-VL's was not emulated; its blocks are Qwen2-VL's kind). A wrong
scale or a row mixed up is off by O(1), and the floor shows the layers were quantized. The encoder's batching
(several images of different sizes in one forward, through `encode_images`, after `tune_attention` and `warm_up` as
the encoder does at start-up) must give each image what it gets alone: per-token activation scales keep rows
independent, so only the GEMMs' tiling may differ (`BATCH_BOUND`).

The norms quantize for the FP8 linears after them (`workers.kernels.fp8_norm`, `fp8_rows.QuantizedRows`): the
kernel is the unfused norm kernel then the quantize kernel bit for bit (checked in Triton's interpreter by
tests/unit/test_fp8_norm_kernels.py; here compiled, at the ViT's widths), and the towers' embeddings with it are the
unfused FP8 path's (`quantized_norms(False)`) within bf16 rounding (`FUSED_BOUND`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.gpu.test_family_towers_gpu import QWEN2_5_VISION, QWEN3_VISION
from tests.gpu.test_kernels_gpu import _SKIP_REASON
from workers.encoder.worker import encode_images
from workers.kernels import fp8, fp8_norm, norm
from workers.models.fp8 import Fp8Linear
from workers.models.fp8_rows import fp8_weight_of, quantized_norms, quantizes_for
from workers.models.vision_fp8 import fp8_linear_names, serve_linears

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")]
CUDA = torch.device("cuda")
BOUND = 0.35  # relative L2 distance of the FP8 tower's embeddings to the bf16 tower's (see above)
FLOOR = 0.01  # below it the FP8 layers did not round anything
# An image in a batch against the same image alone, both through the FP8 tower: a GEMM tiled differently may flip an
# activation's FP8 rounding, which the random blocks carry on; a row of another image, or rows out of order, is O(1).
BATCH_BOUND = 0.1
# The fused path's embeddings against the unfused FP8 path's: the same quantized activations into the same GEMMs, so
# equal where the compiled norm+quantize kernel is the unfused pair bit for bit (as `test_norm_quantize_on_the_gpu_...`
# checks); the bound is one bf16 rounding (2^-8) of the embeddings, far below a wrong scale or row (O(1)) and below a
# single flipped e4m3 rounding carried through the blocks.
FUSED_BOUND = 2**-8

QWEN2_7B = {"depth": 32, "embed_dim": 1280, "num_heads": 16, "mlp_ratio": 4, "hidden_size": 3584}
QWEN2_5_7B = {**QWEN2_5_VISION, "depth": 32, "fullatt_block_indexes": [7, 15, 23, 31]}
QWEN3_8B = {**QWEN3_VISION, "depth": 27, "deepstack_visual_indexes": [8, 16, 24]}
# per patch size: a 768x1024-like image, a small one, a 2-frame video
GRIDS = {14: [[1, 74, 56], [1, 16, 22], [2, 20, 28]], 16: [[1, 64, 48], [1, 16, 22], [2, 18, 24]]}


def _towers(family: str) -> tuple[Any, Any]:
    """(bf16, fp8) towers of ``family``'s 7B/8B shape on CUDA, the same random weights in both."""
    torch.manual_seed(0)
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as Reference

        from workers.models.spec import VisionSpec
        from workers.models.vision import VisionTower as Ours

        config: Any = Qwen2VLConfig(vision_config=QWEN2_7B, text_config={"hidden_size": 3584}).vision_config
        spec: Any = VisionSpec.from_config(config.to_dict())
    elif family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Reference,
        )

        from workers.models.qwen2_5_vl import WindowVisionTower as Ours
        from workers.models.spec import VisionSpec

        config = Qwen2_5_VLVisionConfig(**QWEN2_5_7B)
        spec = VisionSpec.from_config(config.to_dict(), "qwen2_5_vl")
    else:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as Reference

        from workers.models.qwen3_vl import StackedVisionTower as Ours
        from workers.models.qwen3_vl_spec import Qwen3VisionSpec

        config = Qwen3VLVisionConfig(**QWEN3_8B)
        spec = Qwen3VisionSpec.from_config(config.to_dict())
    state = Reference._from_config(config, dtype=torch.bfloat16).state_dict()
    towers = []
    for setting in ("none", "fp8"):
        with torch.device("meta"):
            tower = Ours(spec)
        wanted = set(tower.state_dict())
        tower.load_state({k: v.detach().to(CUDA, torch.bfloat16) for k, v in state.items() if k in wanted})
        towers.append(serve_linears(tower.eval(), setting, torch.bfloat16))
    return towers[0], towers[1]


def relative_error(got: torch.Tensor, truth: torch.Tensor) -> float:
    return float((got.float() - truth.float()).norm() / truth.float().norm())


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def towers(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    bf16, fp8 = _towers(request.param)
    for tower in (bf16, fp8):  # what the encoder does at start-up (`load_vision_backend`)
        tower.tune_attention()
        tower.warm_up()
    return bf16, fp8


def _pixels(tower: Any, grid: list[int], seed: int) -> torch.Tensor:
    rows = grid[0] * grid[1] * grid[2]
    generator = torch.Generator(device=CUDA).manual_seed(seed)
    return torch.randn(rows, tower.spec.patch_dim, device=CUDA, generator=generator).bfloat16()


def test_every_linear_of_the_tower_is_fp8(towers: tuple[Any, Any]) -> None:
    bf16, fp8 = towers
    linears = [name for name, child in bf16.named_modules() if isinstance(child, torch.nn.Linear)]
    assert fp8_linear_names(fp8) == linears and fp8_linear_names(bf16) == []
    assert all(layer.weight.is_cuda for layer in fp8.modules() if isinstance(layer, Fp8Linear))


def test_fp8_embeddings_are_within_the_bound_of_bf16s(towers: tuple[Any, Any]) -> None:
    bf16, fp8 = towers
    for index, grid in enumerate(GRIDS[bf16.spec.patch_size]):
        pixels = _pixels(bf16, grid, seed=index)
        (truth,), (got,) = (encode_images(tower, [pixels], [grid]) for tower in (bf16, fp8))
        error = relative_error(got, truth)
        print(f"grid {grid}: FP8 against bf16 {error:.4f}")
        assert got.shape == truth.shape and got.dtype == truth.dtype
        assert FLOOR < error < BOUND, f"grid {grid}: {error:.4f}"


def test_the_encoders_batches_give_each_image_what_it_gets_alone(towers: tuple[Any, Any]) -> None:
    _, fp8 = towers
    grids = GRIDS[fp8.spec.patch_size]
    pixels = [_pixels(fp8, grid, seed=10 + index) for index, grid in enumerate(grids)]
    batched = encode_images(fp8, pixels, grids)
    for grid, alone_pixels, in_batch in zip(grids, pixels, batched, strict=True):
        (alone,) = encode_images(fp8, [alone_pixels], [grid])
        error = relative_error(in_batch, alone)
        print(f"grid {grid}: batched against alone {error:.2e}")
        assert in_batch.shape == alone.shape and error < BATCH_BOUND


def test_the_towers_norms_quantize_for_their_fp8_linears_with_the_unfused_paths_result(
    towers: tuple[Any, Any],
) -> None:
    _, fp8_tower = towers
    grid = GRIDS[fp8_tower.spec.patch_size][0]
    pixels = _pixels(fp8_tower, grid, seed=20)
    rows = torch.empty(grid[0] * grid[1] * grid[2], 1, device=CUDA, dtype=torch.bfloat16)
    qkvs = [fp8_weight_of(block.attn.qkv) for block in fp8_tower.blocks]
    assert all(quantizes_for(weight, rows) for weight in qkvs), "the fused path is not taken at this image's rows"
    with quantized_norms(False):
        assert not any(quantizes_for(weight, rows) for weight in qkvs)
        (unfused,) = encode_images(fp8_tower, [pixels], [grid])
    (fused,) = encode_images(fp8_tower, [pixels], [grid])
    error = relative_error(fused, unfused)
    print(f"grid {grid}: fused quantization against unfused {error:.2e} (equal: {torch.equal(fused, unfused)})")
    assert fused.shape == unfused.shape and error <= FUSED_BOUND


def _norm_inputs(rows: int, hidden: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=CUDA).manual_seed(seed)
    scales = 10.0 ** torch.empty(rows, 1, device=CUDA).uniform_(-2, 2, generator=g)
    stream = (torch.randn(rows, hidden, device=CUDA, generator=g) * scales + 2.5).bfloat16()
    update = torch.randn(rows, hidden, device=CUDA, generator=g).bfloat16()
    weight = (torch.randn(hidden, device=CUDA, generator=g) * 2).bfloat16()
    bias = (torch.randn(hidden, device=CUDA, generator=g) * 0.1).bfloat16()
    return update, stream, weight, bias


@pytest.mark.parametrize("hidden", [1280, 1152])
@pytest.mark.parametrize("kind", ["layer_norm", "add_rms_norm", "rms_norm"])
def test_norm_quantize_on_the_gpu_is_the_norm_kernel_then_the_quantize_kernel(hidden: int, kind: str) -> None:
    """Compiled, the fused kernel writes what the unfused pair writes, bit for bit: the same scales, FP8 bytes and
    sums (a difference here means the compiler treated the two kernels' norm arithmetic differently)."""
    update, stream, weight, bias = _norm_inputs(4133, hidden, seed=hidden)
    if kind == "layer_norm":
        normed, summed = norm.fused_add_layer_norm(update, stream, weight, bias, 1e-6)
        got = fp8_norm.norm_quantize(update, stream, weight, 1e-6, bias)
    elif kind == "add_rms_norm":
        normed, summed = norm.fused_add_rms_norm(update, stream, weight, 1e-6)
        got = fp8_norm.norm_quantize(update, stream, weight, 1e-6)
    else:
        normed, summed = norm.rms_norm(stream, weight, 1e-6), None
        got = fp8_norm.norm_quantize(stream, None, weight, 1e-6)
    q_ref, s_ref = fp8.quantize_triton(normed, hidden)
    q, s, got_summed = got
    assert torch.equal(s, s_ref), f"{int((s != s_ref).sum())} scales differ"
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), f"{int((q != q_ref).sum())} FP8 values differ"
    assert (got_summed is None and summed is None) or torch.equal(got_summed, summed)


@pytest.mark.parametrize("width", [5120, 4304])  # Qwen2-VL's ViT MLP, Qwen3-VL's
def test_quick_gelu_quantize_on_the_gpu_is_the_gelu_kernel_then_the_quantize_kernel(width: int) -> None:
    """Compiled, the fused activation+quantization writes what quick_gelu's kernel then the quantize kernel write,
    bit for bit."""
    from workers.kernels import fp8_act
    from workers.kernels.vision import quick_gelu

    g = torch.Generator(device=CUDA).manual_seed(width)
    scales = 10.0 ** torch.empty(4133, 1, device=CUDA).uniform_(-2, 1.5, generator=g)
    hidden = (torch.randn(4133, width, device=CUDA, generator=g) * scales).bfloat16()
    q_ref, s_ref = fp8.quantize_triton(quick_gelu(hidden), width)
    q, s = fp8_act.quick_gelu_quantize(hidden)
    assert torch.equal(s, s_ref), f"{int((s != s_ref).sum())} scales differ"
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), f"{int((q != q_ref).sum())} FP8 values differ"


@pytest.mark.parametrize("n", [3840, 6840])  # the ViT's qkv (torch._scaled_mm); Qwen2.5-VL-7B's gate|up (Triton GEMM)
def test_the_gemm_on_prequantized_rows_is_fp8_matmuls(n: int) -> None:
    """`fp8_matmul_quantized` on the quantize kernel's output is `fp8_matmul` on the bf16 rows, exactly."""
    from workers.models.fp8 import quantize_per_channel

    g = torch.Generator(device=CUDA).manual_seed(n)
    x = torch.randn(4133, 1280, device=CUDA, generator=g).bfloat16()
    w, w_scale = quantize_per_channel(torch.randn(n, 1280, device=CUDA, generator=g))
    bias = torch.randn(n, device=CUDA, generator=g).bfloat16()
    expected = fp8.fp8_matmul(x, w, w_scale, (1, 1280), bias)
    x_q, x_s = fp8.quantize_triton(x, 1280)
    got = fp8.fp8_matmul_quantized(x_q, x_s, w, w_scale, (1, 1280), bias, torch.bfloat16)
    assert torch.equal(got, expected)
