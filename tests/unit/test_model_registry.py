"""The model family comes from the checkpoint's config.json; an unsupported type or a missing file stops start-up
with a message naming the type (and the supported ones) or the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.config import Config
from common.model_files import (
    FAMILIES,
    SUPPORTED_MODEL_TYPES,
    CheckpointFileError,
    UnsupportedModel,
    check_model_files,
    model_family,
)
from workers.models import registry, synth


def fake_checkpoint(root: Path, config: dict | None = None) -> Path:
    """The files `check_model_files` looks for; the weights file is empty (it is not opened)."""
    root.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"]} | (config or {})
    (root / "config.json").write_text(json.dumps(config))
    (root / "preprocessor_config.json").write_text(json.dumps(synth.preprocessor_config("tiny")))
    (root / "tokenizer.json").write_text("{}")
    (root / "model.safetensors").write_bytes(b"")
    return root


def test_every_supported_type_has_a_family_module() -> None:
    assert set(registry.FAMILY_MODULES) == set(FAMILIES)
    for model_type in SUPPORTED_MODEL_TYPES:
        assert registry.family(model_type).model_type == model_type


def test_family_is_the_config_model_type(tmp_path: Path) -> None:
    assert check_model_files(fake_checkpoint(tmp_path / "a")) == "qwen2_vl"


def test_architectures_decide_only_without_a_model_type() -> None:
    assert model_family({"architectures": ["Qwen2VLForConditionalGeneration"]}) == "qwen2_vl"
    with pytest.raises(UnsupportedModel, match="no model_type"):
        model_family({"architectures": ["LlavaForConditionalGeneration"]})


def test_unsupported_model_type_names_it_and_the_supported_types(tmp_path: Path) -> None:
    root = fake_checkpoint(tmp_path, {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"]})
    with pytest.raises(UnsupportedModel) as caught:
        check_model_files(root)
    message = str(caught.value)
    assert "'llava'" in message and str(root / "config.json") in message
    assert all(model_type in message for model_type in SUPPORTED_MODEL_TYPES)
    with pytest.raises(UnsupportedModel, match="supported model types: " + ", ".join(SUPPORTED_MODEL_TYPES)):
        registry.family("llava")


def test_a_config_that_disagrees_with_itself_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(FAMILIES, "other_vl", ("OtherVLForConditionalGeneration",))
    config = {"model_type": "qwen2_vl", "architectures": ["OtherVLForConditionalGeneration"]}
    with pytest.raises(CheckpointFileError, match="model_type 'qwen2_vl' but architectures"):
        check_model_files(fake_checkpoint(tmp_path, config))


@pytest.mark.parametrize(
    ("remove", "named"),
    [
        (["config.json"], "config.json is missing"),
        (["preprocessor_config.json"], "preprocessor_config.json is missing"),
        (["tokenizer.json"], "no tokenizer: neither tokenizer.json"),
        (["model.safetensors"], "no weights: no model.safetensors"),
    ],
)
def test_a_missing_file_is_named(tmp_path: Path, remove: list[str], named: str) -> None:
    root = fake_checkpoint(tmp_path)
    for name in remove:
        (root / name).unlink()
    with pytest.raises(CheckpointFileError, match=named):
        check_model_files(root)


def test_missing_shard_and_bad_json_are_named(tmp_path: Path) -> None:
    root = fake_checkpoint(tmp_path)
    (root / "model.safetensors").unlink()
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointFileError, match=r"missing: \['model-00002-of-00002.safetensors'\]"):
        check_model_files(root)
    (root / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(CheckpointFileError, match=r"preprocessor_config\.json cannot be read as JSON"):
        check_model_files(root)


def test_processor_config_image_section_stands_in_for_preprocessor_config(tmp_path: Path) -> None:
    root = fake_checkpoint(tmp_path)
    (root / "preprocessor_config.json").unlink()
    (root / "processor_config.json").write_text(json.dumps({"image_processor": synth.preprocessor_config("tiny")}))
    assert check_model_files(root) == "qwen2_vl"


def test_prepared_model_refuses_an_unsupported_checkpoint(tmp_path: Path) -> None:
    root = fake_checkpoint(tmp_path, {"model_type": "llava", "architectures": []})
    cfg = Config()
    cfg.model.path = str(root)
    with pytest.raises(ValueError, match="model_type 'llava'"):
        synth.prepared_model(cfg)
