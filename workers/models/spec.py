"""Model dimensions and special token ids of a Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint, read from its directory.

Two config layouts exist in the wild and both are accepted:

* the hub layout (e.g. Qwen/Qwen2-VL-2B-Instruct): text fields at the top level, ``vision_config``
  nested, ``rope_scaling: {"type": "mrope", "mrope_section": [...]}``, vision ``in_chans``;
* the transformers-5 layout: ``text_config`` and ``vision_config`` nested, rope settings under
  ``rope_parameters``, vision ``in_channels``.

Everything the serving code needs is copied into plain frozen dataclasses so that no process has to
import transformers at run time, and so that token ids always come from the checkpoint's files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.model_files import model_family
from common.quantization import Quantization

# The families whose config this spec reads.
SPEC_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class VisionSpec:
    """Dimensions of the vision tower (ViT + patch merger). Qwen2.5-VL's adds a gated MLP of
    ``intermediate_size``, windows of ``window_size`` pixels and full attention only in
    ``fullatt_block_indexes``; Qwen2-VL's leaves those at their zero values."""

    depth: int
    embed_dim: int
    num_heads: int
    mlp_ratio: float
    in_chans: int
    out_hidden_size: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    hidden_act: str = "quick_gelu"
    rope_theta: float = 10000.0
    intermediate_size: int = 0  # gated MLP's width (Qwen2.5-VL); 0: embed_dim * mlp_ratio, ungated
    window_size: int = 0  # pixels a side of an attention window (Qwen2.5-VL); 0: every block attends per frame
    fullatt_block_indexes: tuple[int, ...] = ()
    # Video M-RoPE in time (Qwen2.5-VL): temporal ids step by seconds per grid step x this; 0: by one
    tokens_per_second: float = 0.0
    # Qwen3-VL: the learned position table's size, and the blocks whose outputs are DeepStack feature sets
    num_position_embeddings: int = 0
    deepstack_visual_indexes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # A tuple whichever sequence it was built from (a JSON round trip, as in an ONNX export's metadata, gives
        # a list), so that specs of one checkpoint compare equal.
        object.__setattr__(self, "fullatt_block_indexes", tuple(self.fullatt_block_indexes))
        object.__setattr__(self, "deepstack_visual_indexes", tuple(self.deepstack_visual_indexes))

    @property
    def windowed(self) -> bool:
        return self.window_size > 0

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def mlp_hidden_dim(self) -> int:
        return self.intermediate_size or int(self.embed_dim * self.mlp_ratio)

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch row of ``pixel_values``: C * T * P * P."""
        return self.in_chans * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merged_dim(self) -> int:
        """Width of the merger MLP input: ``merge**2`` neighbouring patches concatenated."""
        return self.embed_dim * self.spatial_merge_size**2

    @classmethod
    def from_config(cls, vision: dict[str, Any], model_type: str = "qwen2_vl") -> VisionSpec:
        if model_type == "qwen2_5_vl":
            return cls.from_qwen2_5_vl(vision)
        if model_type == "qwen3_vl":
            return cls.from_qwen3_vl(vision)
        rope = vision.get("rope_parameters") or {}
        spec = cls(
            depth=int(_require(vision, "depth", "vision_config")),
            embed_dim=int(_require(vision, "embed_dim", "vision_config")),
            num_heads=int(_first(vision, ("num_heads", "num_attention_heads"), "vision_config")),
            mlp_ratio=float(vision.get("mlp_ratio", 4)),
            in_chans=int(vision.get("in_chans", vision.get("in_channels", 3))),
            # Qwen2-VL calls the merger's output width `hidden_size`; later variants `out_hidden_size`.
            out_hidden_size=int(_first(vision, ("out_hidden_size", "hidden_size"), "vision_config")),
            patch_size=int(_scalar(vision.get("patch_size", vision.get("spatial_patch_size", 14)))),
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            temporal_patch_size=int(_scalar(vision.get("temporal_patch_size", 2))),
            hidden_act=str(vision.get("hidden_act", "quick_gelu")),
            rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", 10000.0))),
        )
        spec.validate()
        return spec

    @classmethod
    def from_qwen2_5_vl(cls, vision: dict[str, Any]) -> VisionSpec:
        """Qwen2.5-VL's vision_config: ``hidden_size`` is the tower's width, ``out_hidden_size`` the merger's."""
        rope = vision.get("rope_parameters") or {}
        spec = cls(
            depth=int(_require(vision, "depth", "vision_config")),
            embed_dim=int(_require(vision, "hidden_size", "vision_config")),
            num_heads=int(_first(vision, ("num_heads", "num_attention_heads"), "vision_config")),
            mlp_ratio=0.0,
            in_chans=int(vision.get("in_chans", vision.get("in_channels", 3))),
            out_hidden_size=int(_require(vision, "out_hidden_size", "vision_config")),
            patch_size=int(_scalar(vision.get("patch_size", vision.get("spatial_patch_size", 14)))),
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            temporal_patch_size=int(_scalar(vision.get("temporal_patch_size", 2))),
            hidden_act=str(vision.get("hidden_act", "silu")),
            rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", 10000.0))),
            # transformers' defaults where the config names none
            intermediate_size=int(vision.get("intermediate_size", 3420)),
            window_size=int(vision.get("window_size", 112)),
            fullatt_block_indexes=tuple(int(i) for i in vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
            tokens_per_second=float(vision.get("tokens_per_second", 4)),
        )
        spec.validate()
        return spec

    @classmethod
    def from_qwen3_vl(cls, vision: dict[str, Any]) -> VisionSpec:
        """Qwen3-VL's vision_config: as Qwen2.5-VL's widths, an ungated MLP of ``intermediate_size``, learned
        position embeddings and DeepStack (the tower itself reads `qwen3_vl_spec.Qwen3VisionSpec`)."""
        rope = vision.get("rope_parameters") or {}
        spec = cls(
            depth=int(_require(vision, "depth", "vision_config")),
            embed_dim=int(_require(vision, "hidden_size", "vision_config")),
            num_heads=int(_first(vision, ("num_heads", "num_attention_heads"), "vision_config")),
            mlp_ratio=0.0,
            in_chans=int(vision.get("in_chans", vision.get("in_channels", 3))),
            out_hidden_size=int(_require(vision, "out_hidden_size", "vision_config")),
            patch_size=int(_scalar(vision.get("patch_size", 16))),
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            temporal_patch_size=int(_scalar(vision.get("temporal_patch_size", 2))),
            hidden_act=str(vision.get("hidden_act", "gelu_pytorch_tanh")),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            intermediate_size=int(_require(vision, "intermediate_size", "vision_config")),
            num_position_embeddings=int(_require(vision, "num_position_embeddings", "vision_config")),
            deepstack_visual_indexes=tuple(int(i) for i in vision.get("deepstack_visual_indexes", ())),
        )
        spec.validate()
        return spec

    def validate(self) -> None:
        if self.windowed and self.window_size % (self.patch_size * self.spatial_merge_size):
            raise ValueError(
                f"vision window_size {self.window_size} is not a multiple of patch_size x spatial_merge_size"
            )
        if self.embed_dim % self.num_heads:
            raise ValueError(f"vision embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")
        if self.head_dim % 4:
            # The 2-D rotary embedding splits each head in (h, w) halves of rotated pairs.
            raise ValueError(f"vision head_dim {self.head_dim} must be a multiple of 4 for 2-D rotary")
        if self.spatial_merge_size < 1:
            raise ValueError(f"vision spatial_merge_size must be >= 1, got {self.spatial_merge_size}")


@dataclass(frozen=True)
class ModelSpec:
    """Everything the model code and the serving pipeline need to know about one checkpoint."""

    # Text decoder.
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    # Vision tower.
    vision: VisionSpec
    # Special tokens, always taken from the checkpoint files.
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Dtype the checkpoint was saved in (the natural serving dtype).
    dtype: torch.dtype
    model_type: str = "qwen2_vl"
    # Qwen3-VL's text model: q and k RMS-normalised per head before rotary, M-RoPE axes interleaved.
    qk_norm: bool = False
    mrope_interleaved: bool = False
    # How the linear weights are stored or quantized at load (`common.quantization`); None: in ``dtype``.
    quantization: Quantization | None = None

    @property
    def num_kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def num_deepstack(self) -> int:
        """DeepStack feature sets per visual token (Qwen3-VL), added after decoder layers 0 .. this - 1."""
        return len(self.vision.deepstack_visual_indexes)

    @property
    def embedding_sets(self) -> int:
        """Feature sets of one image in the embedding cache: the merged output and the DeepStack sets, one entry
        of [embedding_sets, tokens, hidden]; 1 (an entry of [tokens, hidden]) for the families without DeepStack."""
        return 1 + self.num_deepstack

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelSpec:
        """Read ``config.json`` (and ``generation_config.json`` if present) from a checkpoint directory."""
        root = Path(path)
        config_path = root / "config.json"
        if not config_path.is_file():
            raise ValueError(f"{root} has no config.json; is it a model checkpoint directory?")
        config = json.loads(config_path.read_text())
        generation_path = root / "generation_config.json"
        generation = json.loads(generation_path.read_text()) if generation_path.is_file() else None
        return cls.from_config(config, generation)

    @classmethod
    def from_config(cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelSpec:
        """Build a spec from already-parsed config dicts (either layout)."""
        model_type = model_family(config) if config.get("model_type") or config.get("architectures") else "qwen2_vl"
        if model_type not in SPEC_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not read by ModelSpec (only {SPEC_MODEL_TYPES})")
        if "vision_config" not in config:
            raise ValueError(f"config has no vision_config; not a {model_type} config")

        text = _text_fields(config)
        if text.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported (Qwen2-VL checkpoints do not use it)")

        hidden_size = int(_require(text, "hidden_size", "text config"))
        num_heads = int(_require(text, "num_attention_heads", "text config"))
        num_kv_heads = int(text.get("num_key_value_heads") or num_heads)
        head_dim = int(text.get("head_dim") or hidden_size // num_heads)
        rope = _rope_fields(text)
        qwen3 = model_type == "qwen3_vl"
        # transformers' own defaults where the config names none (made for head_dim 128; checked below)
        mrope_section = tuple(int(s) for s in rope.get("mrope_section", (24, 20, 20) if qwen3 else (16, 24, 24)))

        spec = cls(
            hidden_size=hidden_size,
            intermediate_size=int(_require(text, "intermediate_size", "text config")),
            num_layers=int(_require(text, "num_hidden_layers", "text config")),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            # transformers' default when the field is absent.
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6 if qwen3 else 1e-5)),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 5_000_000.0 if qwen3 else 1_000_000.0))),
            mrope_section=mrope_section,
            vocab_size=int(_require(text, "vocab_size", "text config")),
            tie_word_embeddings=_tie_word_embeddings(config),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            vision=VisionSpec.from_config(config["vision_config"], model_type),
            image_token_id=int(_token_id(config, "image_token_id")),
            video_token_id=int(_token_id(config, "video_token_id")),
            vision_start_token_id=int(_token_id(config, "vision_start_token_id")),
            vision_end_token_id=_optional_token_id(config, "vision_end_token_id"),
            eos_token_ids=_eos_token_ids(config, generation_config),
            dtype=_dtype(config),
            model_type=model_type,
            qk_norm=qwen3,
            mrope_interleaved=qwen3 and bool(rope.get("mrope_interleaved", True)),
        )
        spec.validate()
        return spec

    def validate(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(
                f"mrope_section {list(self.mrope_section)} must have 3 entries summing to head_dim // 2 "
                f"= {self.head_dim // 2}"
            )
        if self.vision.out_hidden_size != self.hidden_size:
            raise ValueError(
                f"vision out_hidden_size {self.vision.out_hidden_size} != text hidden_size {self.hidden_size}"
            )
        if self.qk_norm and not self.mrope_interleaved:
            raise ValueError("only interleaved M-RoPE (mrope_interleaved) is implemented for Qwen3-VL")
        if self.num_deepstack > self.num_layers:
            raise ValueError(f"{self.num_deepstack} DeepStack feature sets but {self.num_layers} decoder layers")
        if not self.eos_token_ids:
            raise ValueError("no eos_token_id in generation_config.json or config.json")


def _text_fields(config: dict[str, Any]) -> dict[str, Any]:
    # transformers-5 saves nest text fields in `text_config`; hub configs keep them at the top level.
    # Some saves have both (a partial text_config plus top-level fields), so merge with the nested
    # values winning.
    nested = config.get("text_config") or {}
    top = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
    return {**top, **nested}


def _rope_fields(text: dict[str, Any]) -> dict[str, Any]:
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"rope_parameters / rope_scaling must be a mapping, not {rope!r}")
    # Hub configs say "mrope", transformers 5 rewrites that to "default"; scaled variants (yarn, ...)
    # would need frequency changes we do not implement.
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ValueError(f"unsupported rope type {rope_type!r}; only plain M-RoPE is implemented")
    return rope


def _tie_word_embeddings(config: dict[str, Any]) -> bool:
    # Pre-v5 saves may put the flag in text_config only; transformers ORs both, and so do we.
    nested = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", False) or nested.get("tie_word_embeddings", False))


def _token_id(config: dict[str, Any], key: str) -> int:
    value = _optional_token_id(config, key)
    if value is None:
        raise ValueError(f"config.json has no {key}; special token ids must come from the checkpoint")
    return value


def _optional_token_id(config: dict[str, Any], key: str) -> int | None:
    value = config.get(key)
    if value is None:
        value = (config.get("text_config") or {}).get(key)
    return None if value is None else int(value)


def _eos_token_ids(config: dict[str, Any], generation_config: dict[str, Any] | None) -> tuple[int, ...]:
    # generation_config.json is authoritative: chat checkpoints list several stop tokens there
    # (e.g. <|im_end|> and <|endoftext|>) while config.json has only one.
    candidates = [
        (generation_config or {}).get("eos_token_id"),
        config.get("eos_token_id"),
        (config.get("text_config") or {}).get("eos_token_id"),
    ]
    for value in candidates:
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        return tuple(dict.fromkeys(int(i) for i in ids))
    return ()


def _dtype(config: dict[str, Any]) -> torch.dtype:
    nested = config.get("text_config") or {}
    name = config.get("dtype") or config.get("torch_dtype") or nested.get("dtype") or nested.get("torch_dtype")
    if name is None:
        return torch.float32
    name = str(name).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported checkpoint dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _require(fields: dict[str, Any], key: str, where: str) -> Any:
    if fields.get(key) is None:
        raise ValueError(f"{where} is missing {key!r}")
    return fields[key]


def _first(fields: dict[str, Any], keys: tuple[str, ...], where: str) -> Any:
    for key in keys:
        if fields.get(key) is not None:
            return fields[key]
    raise ValueError(f"{where} is missing all of {list(keys)}")


def _scalar(value: Any) -> int:
    # transformers types patch sizes as int | list; Qwen2-VL only ever uses square patches.
    if isinstance(value, list | tuple):
        if len(set(value)) != 1:
            raise ValueError(f"non-uniform patch size {value} is not supported")
        return int(value[0])
    return int(value)
