"""``[encoder] quantization`` (`workers.models.vision_fp8`): the vision tower's linear layers in FP8 or not, for every
family's tower, on tiny synthetic checkpoints (unquantized, and in both hub FP8 formats).

The embedding bound of load-time FP8: e4m3 keeps 3 mantissa bits, so a weight rounds to within half its relative step
of 2^-3, i.e. 2^-4, uniformly: an RMS relative error of 2^-4 / sqrt(3) ~ 0.036 per element. A linear's output sums K
products whose errors are independent, so its relative error has about that RMS too (it averages down against the
output's size, not below the elements' own); the residual stream carries the blocks' errors to the output, where they
add in quadrature with the merger's. On CPU the activations are not quantized (`fp8_linear` dequantizes the weight
and multiplies in the activations' dtype), so the tower's output stays near one layer's 0.036: docs/quantization.md
gives the measured figures; `EMBEDDING_BOUND` is twice that, and a floor shows the layers did change."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers.quantizers.quantizers_utils import should_convert_module

from common.config import Config
from common.model_files import read_config
from common.quantization import FP8_BLOCK, FP8_CHANNEL, checkpoint_quantization
from workers.encoder.backends import load_vision_backend
from workers.models.fp8 import FP8, Fp8Linear, quantize_per_channel
from workers.models.registry import checkpoint_family
from workers.models.synth import generate_checkpoint
from workers.models.vision_fp8 import fp8_linear_names, serve_linears

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
EMBEDDING_BOUND = 0.08  # relative L2 distance of the FP8 tower's embeddings to the unquantized tower's (see above)
EMBEDDING_FLOOR = 0.005  # below it the weights were not rounded at all
GRID = torch.tensor([[1, 16, 20], [2, 8, 8], [1, 8, 12]])  # two images and a 2-frame video in one forward


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_checkpoint(tmp_path_factory.mktemp("vision-fp8") / request.param, "tiny", 0, request.param)


@pytest.fixture(scope="module", params=[(f, q) for f in FAMILIES for q in (FP8_BLOCK, FP8_CHANNEL)], ids=str)
def fp8_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family, method = request.param
    root = tmp_path_factory.mktemp("vision-fp8") / f"{family}-{method}"
    return generate_checkpoint(root, "tiny", 0, family, quantization=method)


def tower(path: Path, setting: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    return serve_linears(checkpoint_family(path).vision_tower(path, dtype=dtype), setting, dtype)


def linear_names(module: nn.Module) -> list[str]:
    return [name for name, child in module.named_modules() if isinstance(child, (nn.Linear, Fp8Linear))]


def embeddings(module: nn.Module) -> torch.Tensor:
    pixels = torch.randn(int(GRID.prod(dim=1).sum()), module.spec.patch_dim, generator=torch.Generator().manual_seed(3))
    return module(pixels, GRID).float()  # (Qwen3-VL's: the merged rows and every DeepStack set, stacked)


def distance(got: torch.Tensor, truth: torch.Tensor) -> float:
    return float((got - truth).norm() / truth.norm())


def test_fp8_makes_every_linear_of_the_tower_fp8_and_nothing_else(checkpoint: Path) -> None:
    plain, fp8 = tower(checkpoint, "auto"), tower(checkpoint, "fp8")
    assert fp8_linear_names(plain) == []  # an unquantized checkpoint's tower stays as it is under "auto"
    intended = linear_names(plain)
    assert fp8_linear_names(fp8) == intended
    # qkv, proj, the MLP's two or three, and the merger's two; Qwen3-VL's DeepStack mergers' too
    assert any(name.endswith("attn.qkv") for name in intended) and any("merger" in name for name in intended)
    kept = {name: t for name, t in fp8.state_dict().items() if not name.endswith(("weight_scale",))}
    for name, before in plain.state_dict().items():
        module = name.rpartition(".")[0]
        if module in intended and name.endswith(".weight"):
            values, scale = quantize_per_channel(before)
            assert kept[name].dtype == FP8 and torch.equal(kept[name].float(), values.float())
            assert torch.equal(fp8.state_dict()[module + ".weight_scale"], scale)
        else:  # biases, norms, the patch embedding, position tables: untouched, in the model dtype
            assert kept[name].dtype == torch.float32 and torch.equal(kept[name], before), name


def test_fp8_embeddings_are_close_to_the_unquantized_towers(checkpoint: Path) -> None:
    truth = embeddings(tower(checkpoint, "auto"))
    got = embeddings(tower(checkpoint, "fp8"))
    assert got.shape == truth.shape
    assert EMBEDDING_FLOOR < distance(got, truth) < EMBEDDING_BOUND, distance(got, truth)


def test_fp8_in_bfloat16_is_as_close(checkpoint: Path) -> None:
    truth = embeddings(tower(checkpoint, "auto"))  # fp32
    bf16 = distance(embeddings(tower(checkpoint, "auto", torch.bfloat16)), truth)
    fp8 = distance(embeddings(tower(checkpoint, "fp8", torch.bfloat16)), truth)
    assert bf16 < fp8 < EMBEDDING_BOUND, (bf16, fp8)


def test_qwen2_5_vls_fused_gate_up_runs_fp8_as_the_unfused_layers(tmp_path: Path) -> None:
    """The CUDA path's fused gate/up GEMM (`GatedMlp.fp8_gate_up`, run here by its CPU fallbacks) on FP8 layers,
    quantized at load and stored block-wise, equals the reference's op-by-op path on the same FP8 weights."""
    plain = generate_checkpoint(tmp_path / "plain", "tiny", 0, "qwen2_5_vl")
    block = generate_checkpoint(tmp_path / "block", "tiny", 0, "qwen2_5_vl", quantization=FP8_BLOCK)
    for module in (tower(plain, "fp8"), tower(block, "auto")):
        pixels = torch.randn(int(GRID.prod(dim=1).sum()), module.spec.patch_dim)
        fused, unfused = module.encode(pixels, GRID, fused=True), module.encode(pixels, GRID, fused=False)
        assert torch.allclose(fused, unfused, rtol=1e-5, atol=1e-5)
        mlp = module.blocks[0].mlp
        weight, _ = mlp.fp8_gate_up()  # the layers' FP8 data are views of the fused weight: no second copy
        assert mlp.gate_proj.weight.data_ptr() == weight.data.data_ptr()
        assert mlp.up_proj.weight.data_ptr() == weight.data[mlp.gate_proj.out_features :].data_ptr()


def skipped_by_config(module: str, found: dict) -> bool:
    """Whether the checkpoint's config leaves the tower's ``module`` unquantized, by each format's own rule, under
    the hub name (``visual.…``) or transformers' module name (``model.visual.…``): FineGrainedFP8's
    ``modules_to_not_convert`` through transformers' ``should_convert_module``; compressed-tensors' ``ignore``
    (compressed_tensors/utils/match.py ``match_name``: ``re:`` entries by ``re.match``, others by name)."""
    names = ("visual." + module, "model.visual." + module)
    if found["quant_method"] == "fp8":
        return any(not should_convert_module(name, found.get("modules_to_not_convert")) for name in names)
    patterns = found.get("ignore") or []
    return any(
        re.match(entry[3:], name) if entry.startswith("re:") else entry == name for entry in patterns for name in names
    )


def test_auto_follows_the_fp8_checkpoints_config(fp8_checkpoint: Path) -> None:
    config = read_config(fp8_checkpoint)
    found = config["quantization_config"]
    assert checkpoint_quantization(config) is not None
    auto = tower(fp8_checkpoint, "auto")
    covered = [name for name in linear_names(auto) if not skipped_by_config(name, found)]
    assert covered and len(covered) < len(linear_names(auto))  # blocks quantized, mergers left out by the config
    assert fp8_linear_names(auto) == covered


def test_none_dequantizes_an_fp8_towers_weights_exactly(fp8_checkpoint: Path) -> None:
    auto, none = tower(fp8_checkpoint, "auto"), tower(fp8_checkpoint, "none")
    assert fp8_linear_names(none) == []
    fp8 = dict(auto.named_modules())
    for name, layer in none.named_modules():
        if isinstance(layer, nn.Linear) and isinstance(fp8[name], Fp8Linear):
            assert torch.equal(layer.weight, fp8[name].fp8_weight().dequantize(torch.float32))
            assert torch.equal(layer.bias, fp8[name].bias)
    assert torch.equal(embeddings(none), embeddings(auto))  # on CPU the FP8 layers compute exactly that


def test_fp8_keeps_an_fp8_towers_stored_layers_and_quantizes_the_rest(fp8_checkpoint: Path) -> None:
    auto, fp8 = tower(fp8_checkpoint, "auto"), tower(fp8_checkpoint, "fp8")
    assert fp8_linear_names(fp8) == linear_names(auto)  # the mergers too now
    stored = dict(auto.named_modules())
    for name in fp8_linear_names(auto):
        layer = dict(fp8.named_modules())[name]
        assert layer.block == stored[name].block and torch.equal(layer.scale, stored[name].scale)
        assert torch.equal(layer.weight.float(), stored[name].weight.float())  # not rounded twice


def test_the_encoder_loads_the_tower_as_the_setting_says(checkpoint: Path, tmp_path: Path) -> None:
    cfg = Config()
    cfg.model.path, cfg.run_dir, cfg.encoder.quantization = str(checkpoint), str(tmp_path), "fp8"
    loaded = load_vision_backend(cfg, torch.device("cpu"), torch.float32)
    assert isinstance(loaded, nn.Module) and fp8_linear_names(loaded) == linear_names(loaded)
