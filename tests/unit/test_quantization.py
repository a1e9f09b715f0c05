"""The checkpoint's quantization_config as every process reads it (`common.quantization`): the two FP8 formats of the
Hugging Face hub are recognised, anything else is refused by name with what is supported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common.model_files import check_model_files
from common.quantization import (
    FP8_BLOCK,
    FP8_CHANNEL,
    Quantization,
    UnsupportedQuantization,
    checkpoint_quantization,
    serving_quantization,
)

# As Qwen's FP8 checkpoints write it (e.g. Qwen3-VL-8B-Instruct-FP8's config.json).
BLOCK_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head", "model.visual.merger"],
}

# As llm-compressor's FP8_DYNAMIC scheme writes it.
CHANNEL_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "ignore": ["lm_head", "re:.*visual.*"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "strategy": "token",
                "symmetric": True,
                "dynamic": True,
            },
            "output_activations": None,
        }
    },
}


def with_quantization(quantization: dict[str, Any] | None, nested: bool = False) -> dict[str, Any]:
    config: dict[str, Any] = {"model_type": "qwen2_5_vl", "text_config": {}}
    if quantization is not None:
        (config["text_config"] if nested else config)["quantization_config"] = quantization
    return config


def test_an_unquantized_checkpoint_has_no_format() -> None:
    assert checkpoint_quantization(with_quantization(None)) is None


@pytest.mark.parametrize("nested", [False, True])
def test_block_fp8_is_read_at_the_top_level_or_in_text_config(nested: bool) -> None:
    found = checkpoint_quantization(with_quantization(BLOCK_CONFIG, nested))
    assert found == Quantization(FP8_BLOCK, skip=("lm_head", "model.visual.merger"))


def test_compressed_tensors_fp8_is_read_with_its_ignore_list() -> None:
    found = checkpoint_quantization(with_quantization(CHANNEL_CONFIG))
    assert found == Quantization(FP8_CHANNEL, skip=("lm_head", "re:.*visual.*"))


def changed(base: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    copy = json.loads(json.dumps(base))
    target = copy
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return copy


@pytest.mark.parametrize(
    ("quantization", "named"),
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "quant_method 'awq'"),
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
        (changed(BLOCK_CONFIG, ("weight_block_size",), [64, 64]), "weight_block_size [64, 64]"),
        (changed(BLOCK_CONFIG, ("weight_block_size",), None), "weight_block_size None"),
        (changed(BLOCK_CONFIG, ("activation_scheme",), "static"), "activation_scheme 'static'"),
        (changed(BLOCK_CONFIG, ("fmt",), "e5m2"), "fmt 'e5m2'"),
        (changed(CHANNEL_CONFIG, ("format",), "int-quantized"), "format 'int-quantized'"),
        (changed(CHANNEL_CONFIG, ("config_groups", "group_0", "weights", "type"), "int"), "weights"),
        (changed(CHANNEL_CONFIG, ("config_groups", "group_0", "weights", "strategy"), "tensor"), "weights"),
        (
            changed(CHANNEL_CONFIG, ("config_groups", "group_0", "input_activations", "dynamic"), False),
            "input_activations",
        ),
        (changed(CHANNEL_CONFIG, ("kv_cache_scheme",), {"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    ],
)
def test_other_formats_are_refused_by_name_with_what_is_supported(quantization: dict[str, Any], named: str) -> None:
    with pytest.raises(UnsupportedQuantization) as raised:
        checkpoint_quantization(with_quantization(quantization))
    assert named in str(raised.value)
    assert "supported: FP8 block-wise" in str(raised.value) and "compressed-tensors FP8 W8A8" in str(raised.value)


def test_the_setting_decides_what_an_unquantized_checkpoint_becomes() -> None:
    plain = with_quantization(None)
    assert serving_quantization("auto", plain) is None
    assert serving_quantization("none", plain) is None
    assert serving_quantization("fp8", plain) == Quantization(FP8_CHANNEL, skip=("lm_head",), in_checkpoint=False)


@pytest.mark.parametrize("setting", ["none", "fp8"])
def test_a_quantized_checkpoint_is_served_as_it_is_or_refused(setting: str) -> None:
    stored = with_quantization(BLOCK_CONFIG)
    assert serving_quantization("auto", stored) == checkpoint_quantization(stored)
    with pytest.raises(ValueError, match=f"quantization = '{setting}' but .* holds fp8-block weights"):
        serving_quantization(setting, stored)


def test_check_model_files_refuses_an_unknown_format(tmp_path: Path) -> None:
    # the check every process makes at start-up (gateway, fetcher, encoder, decoder, the launcher's preflight)
    (tmp_path / "config.json").write_text(json.dumps(with_quantization({"quant_method": "awq"})))
    with pytest.raises(UnsupportedQuantization, match="quant_method 'awq' is not supported"):
        check_model_files(tmp_path)
