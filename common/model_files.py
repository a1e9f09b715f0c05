"""Which model family a checkpoint directory holds, and whether it has the files every process reads.

Torch-free, so that every process checks the same things at start-up, the gateway (which imports nothing of the
workers) and the launcher's preflight included. The family is the checkpoint's ``config.json`` ``model_type``,
never a flag; ``architectures`` decides only where ``model_type`` is absent. The model code of each family is
`workers.models.registry`'s; this module only names the families it has.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.quantization import serving_quantization

# model_type -> the architecture class names Hugging Face writes for it. One entry per family that
# `workers.models.registry` implements (a unit test keeps the two lists equal).
FAMILIES: dict[str, tuple[str, ...]] = {
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLModel"),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel"),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLModel"),
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)

CONFIG_FILE = "config.json"
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
# What a tokenizer is read from: the fast tokenizer's one file, or the slow one's vocabulary and merges.
TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"))


class UnsupportedModel(ValueError):
    """The checkpoint's model_type is not one of the families the server implements."""


class CheckpointFileError(ValueError):
    """A file the processes read is missing, unreadable, or disagrees with another one."""


def read_config(root: Path) -> dict[str, Any]:
    """The checkpoint's config.json as a dict; CheckpointFileError naming the file when it cannot be."""
    return read_json_object(root / CONFIG_FILE, "the model's configuration")


def model_family(config: dict[str, Any], where: str = CONFIG_FILE) -> str:
    """The supported model_type of a parsed config.json: its ``model_type``, or, where that is absent, the family
    of its ``architectures``. UnsupportedModel names the type found and the supported ones."""
    architectures = [str(name) for name in config.get("architectures") or []]
    model_type = config.get("model_type")
    if model_type is None:
        known = [family for name in architectures for family, names in FAMILIES.items() if name in names]
        if not known:
            raise UnsupportedModel(
                f"{where} has no model_type, and its architectures {architectures} are none of a supported family; "
                f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        return known[0]
    model_type = str(model_type)
    if model_type not in FAMILIES:
        raise UnsupportedModel(
            f"model_type {model_type!r} in {where} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    foreign = [name for name in architectures if _family_of_architecture(name) not in (None, model_type)]
    if foreign:
        raise CheckpointFileError(
            f"{where} disagrees with itself: model_type {model_type!r} but architectures {foreign} "
            f"(of {_family_of_architecture(foreign[0])!r})"
        )
    return model_type


def check_model_files(root: Path, quantization: str = "auto") -> str:
    """The family of the checkpoint at ``root`` once every file the processes read is there: config.json of a
    supported model_type and weight format (``quantization``: the ``[model]`` setting it is served with),
    preprocessor_config.json, a tokenizer and the safetensors weights (with every shard its index names). Raises
    UnsupportedModel, `common.quantization.UnsupportedQuantization` or CheckpointFileError, each naming the file at
    fault."""
    if not root.is_dir():
        raise CheckpointFileError(f"the model directory {root} does not exist (set [model] path / VLM_MODEL)")
    config = read_config(root)
    family = model_family(config, str(root / CONFIG_FILE))
    serving_quantization(quantization, config, str(root / CONFIG_FILE))
    _check_image_processor(root)
    if not any(all((root / name).is_file() for name in files) for files in TOKENIZER_FILES):
        raise CheckpointFileError(f"{root} has no tokenizer: neither tokenizer.json nor vocab.json with merges.txt")
    _check_weights(root)
    return family


def _family_of_architecture(name: str) -> str | None:
    return next((family for family, names in FAMILIES.items() if name in names), None)


def _check_image_processor(root: Path) -> None:
    # transformers reads processor_config.json's image_processor section first, preprocessor_config.json else.
    nested = root / "processor_config.json"
    if nested.is_file() and isinstance(read_json_object(nested, "the processor").get("image_processor"), dict):
        return
    read_json_object(
        root / IMAGE_PROCESSOR_FILE, "the image processor's settings: patch, merge, mean/std, pixel limits"
    )


def _check_weights(root: Path) -> None:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index, "the safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointFileError(f"{index} has no weight_map")
        missing = sorted({str(name) for name in weight_map.values() if not (root / str(name)).is_file()})
        if missing:
            raise CheckpointFileError(f"{index} names shard files that are missing: {missing}")
        return
    if not any(root.glob("*.safetensors")):
        raise CheckpointFileError(f"{root} has no weights: no model.safetensors nor model.safetensors.index.json")


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path`` (``what`` it is, for the message); CheckpointFileError naming the file where it is
    missing, unreadable or not an object."""
    if not path.is_file():
        raise CheckpointFileError(f"{path} is missing ({what})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointFileError(f"{path} cannot be read as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointFileError(f"{path} must hold a JSON object")
    return data
