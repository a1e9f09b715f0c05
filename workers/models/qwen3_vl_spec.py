"""Dimensions of a Qwen3-VL (dense) checkpoint, read from its nested config.json.

Kept apart from `workers.models.spec` (whose `ModelSpec` is Qwen2-VL's) until the model registry takes both. Rope
settings are read from either spelling: the hub's ``rope_scaling`` + ``rope_theta`` or transformers 5's
``rope_parameters``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.quantization import Quantization

MODEL_TYPE = "qwen3_vl"
# LayerNorm eps of every vision LayerNorm, fixed in the reference implementation (not in config).
VISION_LAYER_NORM_EPS = 1e-6

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Qwen3VisionSpec:
    depth: int
    embed_dim: int  # the config's vision `hidden_size`
    intermediate_size: int
    num_heads: int
    in_chans: int
    out_hidden_size: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_chans * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merged_dim(self) -> int:
        return self.embed_dim * self.spatial_merge_size**2

    @property
    def grid_side(self) -> int:
        """Side of the square grid of learned position embeddings."""
        return int(self.num_position_embeddings**0.5)

    @classmethod
    def from_config(cls, vision: dict[str, Any]) -> Qwen3VisionSpec:
        rope = vision.get("rope_parameters") or {}
        spec = cls(
            depth=int(vision["depth"]),
            embed_dim=int(vision["hidden_size"]),
            intermediate_size=int(vision["intermediate_size"]),
            num_heads=int(vision["num_heads"]),
            in_chans=int(vision.get("in_channels", 3)),
            out_hidden_size=int(vision["out_hidden_size"]),
            patch_size=int(vision.get("patch_size", 16)),
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
            num_position_embeddings=int(vision["num_position_embeddings"]),
            deepstack_visual_indexes=tuple(int(i) for i in vision.get("deepstack_visual_indexes", ())),
            hidden_act=str(vision.get("hidden_act", "gelu_pytorch_tanh")),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )
        spec.validate()
        return spec

    def validate(self) -> None:
        if self.embed_dim % self.num_heads or self.head_dim % 4:
            raise ValueError(
                f"vision hidden_size {self.embed_dim} / num_heads {self.num_heads} must be a multiple of 4"
            )
        if self.grid_side**2 != self.num_position_embeddings:
            raise ValueError(f"vision num_position_embeddings {self.num_position_embeddings} is not a square")
        if any(not 0 <= i < self.depth for i in self.deepstack_visual_indexes):
            raise ValueError(
                f"deepstack_visual_indexes {list(self.deepstack_visual_indexes)} outside 0..{self.depth - 1}"
            )


@dataclass(frozen=True)
class Qwen3VLSpec:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    mrope_interleaved: bool
    vocab_size: int
    tie_word_embeddings: bool
    vision: Qwen3VisionSpec
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    dtype: torch.dtype
    quantization: Quantization | None = None  # as `ModelSpec.quantization`

    @property
    def num_deepstack(self) -> int:
        return len(self.vision.deepstack_visual_indexes)

    @classmethod
    def from_dir(cls, path: str | Path) -> Qwen3VLSpec:
        return cls.from_config(json.loads((Path(path) / "config.json").read_text()))

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Qwen3VLSpec:
        if config.get("model_type") != MODEL_TYPE:
            raise ValueError(f"model_type {config.get('model_type')!r} is not {MODEL_TYPE!r}")
        text = config["text_config"]
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        spec = cls(
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]),
            num_layers=int(text["num_hidden_layers"]),
            num_heads=int(text["num_attention_heads"]),
            num_kv_heads=int(text.get("num_key_value_heads") or text["num_attention_heads"]),
            head_dim=int(text.get("head_dim", 128)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 5000000.0))),
            # transformers' default where the config names none
            mrope_section=tuple(int(s) for s in rope.get("mrope_section", (24, 20, 20))),
            mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
            vocab_size=int(text["vocab_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            vision=Qwen3VisionSpec.from_config(config["vision_config"]),
            image_token_id=int(config.get("image_token_id", 151655)),
            video_token_id=int(config.get("video_token_id", 151656)),
            vision_start_token_id=int(config.get("vision_start_token_id", 151652)),
            vision_end_token_id=int(config.get("vision_end_token_id", 151653)),
            dtype=_DTYPES[str(text.get("dtype") or config.get("dtype") or config.get("torch_dtype") or "float32")],
        )
        spec.validate()
        return spec

    def validate(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} not a multiple of num_key_value_heads")
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(
                f"mrope_section {list(self.mrope_section)} must sum to head_dim // 2 = {self.head_dim // 2}"
            )
        if not self.mrope_interleaved:
            raise ValueError("only interleaved M-RoPE (mrope_interleaved) is implemented for Qwen3-VL")
        if self.vision.out_hidden_size != self.hidden_size:
            raise ValueError(f"vision out_hidden_size {self.vision.out_hidden_size} != hidden_size {self.hidden_size}")
        if self.num_deepstack > self.num_layers:
            raise ValueError(f"{self.num_deepstack} DeepStack feature sets but {self.num_layers} decoder layers")
