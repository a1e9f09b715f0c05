"""The synthetic generator's tables for Qwen2.5-VL: the hub repositories' config.json, tensor names and processor
configs (Qwen/Qwen2.5-VL-3B-Instruct, -7B-Instruct), and a tiny size in which every feature of the vision tower
runs: windows smaller than the grid, blocks of both kinds.

    python -m workers.models.synth --family qwen2_5_vl --size tiny
"""

from __future__ import annotations

from typing import Any, TypedDict

from workers.models import synth
from workers.models.registry import SynthTables


class Vision(TypedDict):
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    window_size: int
    fullatt_block_indexes: list[int]
    tokens_per_second: int


class Size(TypedDict):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    mrope_section: list[int]
    max_position_embeddings: int
    dtype: str
    init_std: float
    max_pixels: int
    video_min_pixels: int
    video_max_pixels: int
    vision: Vision


# The released models' vision tower (one for every size): 112-pixel windows, full attention every 8th block.
_VISION: Vision = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "tokens_per_second": 2,
}

SIZES: dict[str, Size] = {
    # Windows of 2 x 2 merged tokens (56 pixels), so that any image above 56 x 56 pixels has several and a side
    # that is not a multiple of it pads its last; block 1 of 3 attends over whole frames, the others in windows.
    "tiny": {
        **{k: v for k, v in synth.SIZES["tiny"].items() if k != "vision"},  # type: ignore[typeddict-item]
        "max_position_embeddings": 128000,
        "vision": {
            "depth": 3,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_heads": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
            "tokens_per_second": 2,
        },
    },
    # Shapes of Qwen/Qwen2.5-VL-3B-Instruct.
    "3b": {
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "mrope_section": [16, 24, 24],
        "max_position_embeddings": 128000,
        "dtype": "bfloat16",
        "init_std": 0.02,
        "max_pixels": 12845056,
        "video_min_pixels": 100352,
        "video_max_pixels": 602112,
        "vision": _VISION,
    },
    # Shapes of Qwen/Qwen2.5-VL-7B-Instruct.
    "7b": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "mrope_section": [16, 24, 24],
        "max_position_embeddings": 128000,
        "dtype": "bfloat16",
        "init_std": 0.02,
        "max_pixels": 12845056,
        "video_min_pixels": 100352,
        "video_max_pixels": 602112,
        "vision": _VISION,
    },
}


def _size(size: str) -> Size:
    try:
        return SIZES[size]
    except KeyError:
        raise ValueError(f"unknown qwen2_5_vl size {size!r}; expected one of {sorted(SIZES)}") from None


def config_dict(size: str) -> dict[str, Any]:
    """config.json in the hub repositories' flat layout (text fields at the top level)."""
    spec = _size(size)
    vision = spec["vision"]
    config = synth.config_dict("tiny")  # the token ids and Qwen2 fields every Qwen VL config shares
    config |= {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "hidden_size": spec["hidden_size"],
        "initializer_range": spec["init_std"],
        "intermediate_size": spec["intermediate_size"],
        "max_position_embeddings": spec["max_position_embeddings"],
        "max_window_layers": spec["num_hidden_layers"],
        "num_attention_heads": spec["num_attention_heads"],
        "num_hidden_layers": spec["num_hidden_layers"],
        "num_key_value_heads": spec["num_key_value_heads"],
        "tie_word_embeddings": spec["tie_word_embeddings"],
        "torch_dtype": spec["dtype"],
        "vision_config": {
            "depth": vision["depth"],
            "hidden_act": "silu",
            "hidden_size": vision["hidden_size"],
            "intermediate_size": vision["intermediate_size"],
            "num_heads": vision["num_heads"],
            "in_chans": synth.IN_CHANNELS,
            # transformers 5 reads `in_channels`; the hub's `in_chans` is kept for older readers.
            "in_channels": synth.IN_CHANNELS,
            "out_hidden_size": spec["hidden_size"],
            "patch_size": synth.PATCH_SIZE,
            "spatial_merge_size": synth.SPATIAL_MERGE_SIZE,
            "spatial_patch_size": synth.PATCH_SIZE,
            "window_size": vision["window_size"],
            "fullatt_block_indexes": list(vision["fullatt_block_indexes"]),
            "tokens_per_second": vision["tokens_per_second"],
            "temporal_patch_size": synth.TEMPORAL_PATCH_SIZE,
        },
        "rope_scaling": {"type": "mrope", "mrope_section": list(spec["mrope_section"])},
        "vocab_size": spec["vocab_size"],
    }
    return config


def _vision_shapes(spec: Size) -> dict[str, tuple[int, ...]]:
    vision = spec["vision"]
    dim, inter = vision["hidden_size"], vision["intermediate_size"]
    merged = dim * synth.SPATIAL_MERGE_SIZE**2
    kernel = (synth.TEMPORAL_PATCH_SIZE, synth.PATCH_SIZE, synth.PATCH_SIZE)
    shapes: dict[str, tuple[int, ...]] = {"visual.patch_embed.proj.weight": (dim, synth.IN_CHANNELS, *kernel)}
    for i in range(vision["depth"]):
        p = f"visual.blocks.{i}"
        shapes |= {
            f"{p}.norm1.weight": (dim,),
            f"{p}.norm2.weight": (dim,),
            f"{p}.attn.qkv.weight": (3 * dim, dim),
            f"{p}.attn.qkv.bias": (3 * dim,),
            f"{p}.attn.proj.weight": (dim, dim),
            f"{p}.attn.proj.bias": (dim,),
            f"{p}.mlp.gate_proj.weight": (inter, dim),
            f"{p}.mlp.gate_proj.bias": (inter,),
            f"{p}.mlp.up_proj.weight": (inter, dim),
            f"{p}.mlp.up_proj.bias": (inter,),
            f"{p}.mlp.down_proj.weight": (dim, inter),
            f"{p}.mlp.down_proj.bias": (dim,),
        }
    shapes |= {
        "visual.merger.ln_q.weight": (dim,),
        "visual.merger.mlp.0.weight": (merged, merged),
        "visual.merger.mlp.0.bias": (merged,),
        "visual.merger.mlp.2.weight": (spec["hidden_size"], merged),
        "visual.merger.mlp.2.bias": (spec["hidden_size"],),
    }
    return shapes


def weight_shapes(size: str) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, under the hub's names: Qwen2's text model (as Qwen2-VL's), then the tower."""
    spec = _size(size)
    text_spec: Any = spec  # the text fields are Qwen2-VL's SizeSpec's
    return synth.text_shapes(text_spec) | _vision_shapes(spec)


def storage(size: str) -> tuple[str, float]:
    return _size(size)["dtype"], _size(size)["init_std"]


def preprocessor_config(size: str) -> dict[str, Any]:
    # The hub's Qwen2.5-VL repositories use Qwen2-VL's image processor, with their own processor class.
    config = synth.vision_processing(synth.MIN_PIXELS, _size(size)["max_pixels"])
    return {"image_processor_type": "Qwen2VLImageProcessor", **config, "processor_class": "Qwen2_5_VLProcessor"}


def video_preprocessor_config(size: str) -> dict[str, Any]:
    spec = _size(size)
    config = synth.vision_processing(spec["video_min_pixels"], spec["video_max_pixels"])
    return {
        "video_processor_type": "Qwen2VLVideoProcessor",
        **config,
        "processor_class": "Qwen2_5_VLProcessor",
        "min_frames": 4,
        "max_frames": 768,
        "cap_pixels_per_frame": True,
    }


TABLES = SynthTables(
    sizes=tuple(SIZES),
    config=config_dict,
    shapes=weight_shapes,
    storage=storage,
    preprocessor=preprocessor_config,
    video_preprocessor=video_preprocessor_config,
    chat_template=synth.CHAT_TEMPLATE,
    dir_name="qwen2.5-vl",
)
