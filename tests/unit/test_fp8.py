"""FP8 weights (`workers.models.fp8`): both hub formats, as the synthetic generator writes them, load into FP8 layers
whose weights equal the format's definition, and the model on them answers as transformers does on the same
checkpoint.

The definition is transformers' own loading of each format, dequantizing at load (FineGrainedFP8 with ``accelerate``,
compressed-tensors with the ``compressed-tensors`` package: both in the test extras, so both run on the CPU), and a
transcription of its dequantization (`transformers_dequantize`) besides, which says what that definition is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForImageTextToText, CompressedTensorsConfig, FineGrainedFP8Config

from common.quantization import FP8_BLOCK, FP8_CHANNEL, Quantization
from workers.models.fp8 import FP8, Fp8Linear, Fp8Weight, fuse_weights, quantize_per_channel
from workers.models.paged import fuse_layers
from workers.models.registry import checkpoint_family, read_spec
from workers.models.synth import generate_checkpoint
from workers.models.synth_fp8 import quantize_per_block
from workers.models.tensor_parallel import check_tensor_parallel
from workers.models.weights import CheckpointWeights

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def transformers_dequantize(weight: torch.Tensor, scale: torch.Tensor, block: list[int] | None) -> torch.Tensor:
    """transformers/integrations/finegrained_fp8.py ``_dequantize_fp8_weight`` (transformers 5.24, lines 285-303),
    in fp32; ``block`` None: compressed-tensors' per-channel ``weight * weight_scale`` (compressed_tensors/
    quantization/lifecycle/forward.py ``_dequantize``: ``x_q.to(scale.dtype) * scale``, the scale [out, 1])."""
    scale = scale.to(torch.float32)
    weight = weight.to(torch.float32)
    if block is None:
        return weight.mul_(scale)
    rows, cols = weight.shape[-2:]
    full, rem = divmod(cols, block[1])
    scale = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    weight[..., : full * block[1]].unflatten(-1, (full, block[1])).mul_(scale[..., :full, None])
    if rem:
        weight[..., full * block[1] :].mul_(scale[..., full:])
    return weight


@pytest.fixture(scope="module", params=[(f, q) for f in FAMILIES for q in (FP8_BLOCK, FP8_CHANNEL)], ids=str)
def fp8_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    family, method = request.param
    root = tmp_path_factory.mktemp("fp8") / f"{family}-{method}"
    return generate_checkpoint(root, "tiny", 0, family, quantization=method), method


def fp8_layers(module: nn.Module) -> dict[str, Fp8Linear]:
    return {name: child for name, child in module.named_modules() if isinstance(child, Fp8Linear)}


def test_both_formats_load_with_weights_equal_to_the_format(fp8_checkpoint: tuple[Path, str]) -> None:
    path, method = fp8_checkpoint
    spec = read_spec(path)
    assert spec.quantization is not None and spec.quantization.method == method
    found = checkpoint_family(path)
    language = found.language_model(path, dtype=torch.float32, spec=spec)
    tower = found.vision_tower(path, dtype=torch.float32)
    raw = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    scale_suffix = "weight_scale_inv" if method == FP8_BLOCK else "weight_scale"
    quantized = sorted(k.removesuffix("." + scale_suffix) for k in raw if k.endswith(scale_suffix))
    loaded = {**fp8_layers(language), **{"visual." + n: m for n, m in fp8_layers(tower).items()}}
    # every linear the checkpoint quantized, and no other, is an FP8 layer (decoder layers' and vision blocks')
    assert len(loaded) == len(quantized) == 7 * spec.num_layers + len(fp8_layers(tower))
    assert "lm_head" not in loaded and not any("merger" in name for name in loaded)
    weights = CheckpointWeights(path)
    for name, layer in loaded.items():
        full = name if name.startswith("visual.") else "model." + name
        stored = weights.load([full + ".weight", full + "." + scale_suffix])
        assert layer.weight.dtype == FP8 and layer.scale.dtype == torch.float32
        expected = transformers_dequantize(
            stored[full + ".weight"], stored[full + "." + scale_suffix], [128, 128] if method == FP8_BLOCK else None
        )
        assert torch.equal(layer.fp8_weight().dequantize(torch.float32), expected), name


def transformers_fp8_model(path: Path, method: str) -> nn.Module:
    """transformers' own model of the FP8 checkpoint, its quantizer dequantizing each FP8 weight into fp32 at load
    (its FP8 compute needs the `kernels` package's hub kernels and a GPU)."""
    dequantize = (
        FineGrainedFP8Config(dequantize=True) if method == FP8_BLOCK else CompressedTensorsConfig(dequantize=True)
    )
    return AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32, quantization_config=dequantize)


def test_fp8_weights_equal_transformers_own_loading_of_the_format(fp8_checkpoint: tuple[Path, str]) -> None:
    path, method = fp8_checkpoint
    spec = read_spec(path)
    found = checkpoint_family(path)
    language = found.language_model(path, dtype=torch.float32, spec=spec)
    tower = found.vision_tower(path, dtype=torch.float32)
    ours = {"model.language_model." + n: m for n, m in fp8_layers(language).items()}
    ours |= {"model.visual." + n: m for n, m in fp8_layers(tower).items()}
    theirs = dict(transformers_fp8_model(path, method).named_modules())
    assert ours and set(ours) <= set(theirs)
    for name, layer in ours.items():
        assert torch.equal(layer.fp8_weight().dequantize(torch.float32), theirs[name].weight.detach()), name


def test_logits_equal_transformers_on_the_fp8_checkpoint(fp8_checkpoint: tuple[Path, str]) -> None:
    path, method = fp8_checkpoint
    reference = transformers_fp8_model(path, method)
    spec = read_spec(path)
    model = checkpoint_family(path).language_model(path, dtype=torch.float32, spec=spec)
    ids = torch.tensor([[15, 27, 301, 9, 4000, 12, 77, 5]])
    with torch.inference_mode():
        expected = reference(input_ids=ids).logits[0]
        positions = torch.arange(ids.shape[1]).expand(3, -1)
        ours = model(model.embed(ids[0]), positions, model.new_cache(), all_logits=True)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)


def test_load_time_fp8_quantizes_the_decoder_layers_per_channel(tmp_path: Path) -> None:
    path = generate_checkpoint(tmp_path / "plain", "tiny", 0, "qwen2_5_vl")
    spec = read_spec(path, "fp8")
    assert spec.quantization == Quantization(FP8_CHANNEL, skip=("lm_head",), in_checkpoint=False)
    model = checkpoint_family(path).language_model(path, dtype=torch.float32, spec=spec)
    plain = checkpoint_family(path).language_model(path, dtype=torch.float32, spec=read_spec(path))
    layers = fp8_layers(model)
    assert len(layers) == 7 * spec.num_layers and isinstance(model.lm_head, nn.Linear)
    for name, layer in layers.items():
        weight = plain.get_submodule(name).weight
        assert layer.scale.shape == (weight.shape[0], 1)
        torch.testing.assert_close(layer.scale, weight.abs().amax(dim=1, keepdim=True) / 448)
        # e4m3 keeps 3 mantissa bits: each weight within half a step (1/16 of its power of two) of the original
        error = (layer.fp8_weight().dequantize(torch.float32) - weight).abs()
        assert bool((error <= weight.abs() / 16 + layer.scale * 2**-9).all()), name


@pytest.mark.parametrize("rows", [(64, 32, 32), (256, 128, 128), (200, 72)])
def test_fused_fp8_weights_dequantize_to_their_parts(rows: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    parts = [Fp8Weight(*quantize_per_block(torch.randn(n, 300)), (128, 128)) for n in rows]
    fused = fuse_weights(parts)
    assert fused.block == ((128, 128) if all(n % 128 == 0 for n in rows[:-1]) else (1, 128))
    whole = torch.cat([part.dequantize(torch.float32) for part in parts])
    assert torch.equal(fused.dequantize(torch.float32), whole)
    channel = [Fp8Weight(*quantize_per_channel(torch.randn(n, 300)), (1, 300)) for n in rows]
    fused = fuse_weights(channel)
    assert torch.equal(fused.dequantize(torch.float32), torch.cat([p.dequantize(torch.float32) for p in channel]))


def test_fused_layers_point_at_the_fp8_weights_they_fused(fp8_checkpoint: tuple[Path, str]) -> None:
    path, _ = fp8_checkpoint
    model = checkpoint_family(path).language_model(path, dtype=torch.float32, spec=read_spec(path))
    before = {n: m.fp8_weight().dequantize(torch.float32) for n, m in fp8_layers(model).items()}
    fused = fuse_layers(model)
    attn = model.layers[0].self_attn
    q_rows = attn.q_proj.weight.shape[0]
    assert isinstance(fused[0].qkv_weight, Fp8Weight)
    assert attn.q_proj.weight.data_ptr() == fused[0].qkv_weight.data.data_ptr()
    torch.testing.assert_close(
        fused[0].qkv_weight.dequantize(torch.float32)[:q_rows], before["layers.0.self_attn.q_proj"]
    )
    for name, layer in fp8_layers(model).items():  # the modules' own forward still sees the same weights
        assert torch.equal(layer.fp8_weight().dequantize(torch.float32), before[name])


def test_tensor_parallel_shards_per_channel_fp8_and_refuses_block_splits_that_cut_blocks(
    fp8_checkpoint: tuple[Path, str],
) -> None:
    """The tiny shapes' 2-rank shards are narrower than a 128 x 128 block: a block-wise checkpoint is refused at
    start-up, a per-channel one shards (tests/unit/test_tensor_parallel_fp8.py runs both)."""
    path, method = fp8_checkpoint
    spec = read_spec(path)
    check_tensor_parallel(spec, 1)
    if method == FP8_CHANNEL:
        check_tensor_parallel(spec, 2)
        return
    with pytest.raises(ValueError, match=r"must hold whole blocks, .* not multiples of 128: q_proj: "):
        check_tensor_parallel(spec, 2)
