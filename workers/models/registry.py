"""The model families the server implements, chosen from a checkpoint's ``config.json``, never from a flag.

One module per family (``workers/models/<model_type>.py``) defines ``FAMILY``, a `Family`: how its config is read,
its vision tower, its language model, its M-RoPE index rule and its synthetic checkpoint's tables. The modules are
imported on first use, so that a process pays only for the family it serves. Which model types exist is
`common.model_files.FAMILIES`'s list (the gateway, which imports nothing of the workers, checks the same one).

To add a family: its module with ``FAMILY``, a line in `FAMILY_MODULES`, its model_type and architectures in
`common.model_files.FAMILIES`.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from common.model_files import SUPPORTED_MODEL_TYPES, UnsupportedModel, check_model_files, read_config
from common.quantization import serving_quantization

if TYPE_CHECKING:
    import torch
    from torch import nn

    from workers.models.spec import ModelSpec
    from workers.models.weights import CheckpointWeights

# model_type -> the module whose FAMILY implements it.
FAMILY_MODULES: dict[str, str] = {
    "qwen2_vl": "workers.models.qwen2_vl",
    "qwen2_5_vl": "workers.models.qwen2_5_vl",
    "qwen3_vl": "workers.models.qwen3_vl",
}


class LoadModel(Protocol):
    """``cls.from_checkpoint``: the module built from a checkpoint directory (or its open weights)."""

    def __call__(
        self,
        path: str | Path | CheckpointWeights,
        device: torch.device | str = ...,
        dtype: torch.dtype | None = ...,
        spec: ModelSpec | None = ...,
    ) -> nn.Module: ...


class RopePositions(Protocol):
    """M-RoPE ids [3, T] of expanded prompt ids and the decode delta (`workers.models.mrope.rope_positions`);
    ``video_seconds``: each video's seconds per temporal grid step, for families whose video ids are in time."""

    def __call__(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        image_grids: Sequence[Sequence[int]],
        video_grids: Sequence[Sequence[int]],
        spec: ModelSpec,
        past_length: int = ...,
        past_delta: int = ...,
        video_seconds: Sequence[float] | None = ...,
    ) -> tuple[torch.Tensor, int]: ...


@dataclass(frozen=True)
class SynthTables:
    """What `workers.models.synth` writes for a family: the Hugging Face repository's files, per size."""

    sizes: tuple[str, ...]
    config: Callable[[str], dict[str, Any]]  # config.json
    shapes: Callable[[str], dict[str, tuple[int, ...]]]  # every tensor under the hub's names, in file order
    storage: Callable[[str], tuple[str, float]]  # (dtype name, init std) of the weights
    preprocessor: Callable[[str], dict[str, Any]]  # preprocessor_config.json
    video_preprocessor: Callable[[str], dict[str, Any]]  # video_preprocessor_config.json
    chat_template: str
    dir_name: str  # e.g. "qwen2-vl": generated checkpoints are named <dir_name>-<size>-seed<seed>
    # The tokenizer files, where the family's differ from Qwen2-VL's (Qwen3's added tokens); None: synth's own
    write_tokenizer: Callable[[Path], None] | None = None
    # A "Thinking" variant's chat template (its generation prompt opens `<think>`); None: the family has none
    thinking_chat_template: str | None = None


@dataclass(frozen=True)
class Family:
    """Everything that differs between model families, behind one name (the checkpoint's model_type)."""

    model_type: str
    # (config.json, generation_config.json or None) -> the spec every process reads.
    read_spec: Callable[[dict[str, Any], dict[str, Any] | None], ModelSpec]
    vision_tower: LoadModel
    language_model: LoadModel
    rope_positions: RopePositions
    # The synthetic generator's tables: sizes, config.json, tensor shapes, processor configs.
    synth: SynthTables
    # Whether `workers.models.tensor_parallel` shards its language model (Megatron's split of Qwen2's or Qwen3's
    # layers); a family without it is refused at start-up when [decoder] tensor_parallel > 1.
    tensor_parallel: bool = False
    # Whether its processor writes each video's frame times into the prompt (Qwen3-VL: "<1.5 seconds>" before each
    # temporal step's tokens), which the fetcher then samples, sizes and times by `workers.fetcher.video_qwen3_vl`.
    video_timestamps: bool = False


def family(model_type: str) -> Family:
    """The family of a model_type; UnsupportedModel naming the supported ones otherwise."""
    if model_type not in FAMILY_MODULES:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    found: Family = importlib.import_module(FAMILY_MODULES[model_type]).FAMILY
    return found


def checkpoint_family(path: str | Path, quantization: str = "auto") -> Family:
    """The family of the checkpoint at ``path``, once its files are all there and its weight format is one served
    with ``[model] quantization`` (`common.model_files`); raises ValueError naming the unsupported type or format or
    the file at fault. Every process calls this at start-up."""
    return family(check_model_files(Path(path), quantization))


def read_spec(path: str | Path, quantization: str = "auto") -> ModelSpec:
    """The spec of the checkpoint at ``path``, read by its family (`checkpoint_family` checks its files first), with
    the weight format ``[model] quantization`` serves it in."""
    root = Path(path)
    found = checkpoint_family(root, quantization)
    generation = root / "generation_config.json"
    config = read_config(root)
    spec = found.read_spec(config, json.loads(generation.read_text()) if generation.is_file() else None)
    return dataclasses.replace(spec, quantization=serving_quantization(quantization, config))
