"""Synthetic Qwen3-VL (dense) checkpoints with seeded random weights, in the Hugging Face repositories' layout.

The files are those of Qwen/Qwen3-VL-{2B,4B,8B}-Instruct: a nested config.json (``text_config`` with
``rope_scaling: {mrope_interleaved, mrope_section}``, ``vision_config`` with ``deepstack_visual_indexes``),
module-layout tensor names (``model.language_model.*``, ``model.visual.*``, ``lm_head.weight``), Qwen's tokenizer
with Qwen3's added tokens, a chat template that inserts the vision tokens, ``preprocessor_config.json`` and
``video_preprocessor_config.json``. Weights stream tensor by tensor into safetensors as in `workers.models.synth`.

    python -m workers.models.qwen3_vl_synth --size tiny --out /tmp/qwen3-vl-tiny --seed 0
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, TypedDict

from tokenizers import AddedToken

from workers.models import synth
from workers.models.synth import (  # the Qwen2-VL generator's format-level helpers, shared as they are
    _plan_shards,
    _write_json,
    _write_safetensors,
)

GENERATOR_VERSION = 1


class VisionShape(TypedDict):
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_position_embeddings: int
    deepstack_visual_indexes: list[int]


class SizeShape(TypedDict):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    mrope_section: list[int]
    rope_theta: float
    max_position_embeddings: int
    dtype: str
    init_std: float
    image_min_pixels: int
    image_max_pixels: int
    vision: VisionShape


# Every feature on a CPU-sized model: 3 decoder layers so that DeepStack (two feature sets, added after layers 0
# and 1) leaves one layer without; a 6x6 learned position grid, which every test image's grid differs from, so
# the bilinear interpolation always runs; head_dim 16, whose 8 rotary slots the interleaved M-RoPE shares as
# T H W T H W T T (mrope_section [4, 2, 2]).
_TINY: SizeShape = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "mrope_section": [4, 2, 2],
    "rope_theta": 5000000.0,
    "max_position_embeddings": 262144,
    "dtype": "float32",
    # As synth's tiny: sharp attention, so that greedy parity depends on positions.
    "init_std": 0.2,
    "image_min_pixels": 4 * 32 * 32,
    "image_max_pixels": 512 * 32 * 32,  # 512 image tokens at most, so CPU prompts stay short
    "vision": {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "num_position_embeddings": 36,
        "deepstack_visual_indexes": [0, 1],
    },
}

# The shapes of Qwen/Qwen3-VL-{2B,4B,8B}-Instruct: 2B and 4B share their vision tower (24 blocks of 1024), 8B has
# the 27-block 1152-wide one (transformers' Qwen3VLVisionConfig defaults); parameter counts 2.13B, 4.44B, 8.77B.
# The hub is out of reach here: every value below agrees with the configs of those checkpoints that public projects
# embed in their code (the 4B's and 8B's whole text and vision configs, the 2B's text widths, heads and layers).
_VISION_SMALL: VisionShape = {
    "depth": 24,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_heads": 16,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [5, 11, 17],
}
_VISION_8B: VisionShape = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
}
_REAL = {
    "head_dim": 128,
    "vocab_size": 151936,
    "mrope_section": [24, 20, 20],
    "rope_theta": 5000000.0,
    "max_position_embeddings": 262144,
    "dtype": "bfloat16",
    "init_std": 0.02,
    "image_min_pixels": 65536,
    "image_max_pixels": 16777216,
}

SIZES: dict[str, SizeShape] = {
    "tiny": _TINY,
    "2b": {  # type: ignore[typeddict-item]
        **_REAL,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
        "vision": _VISION_SMALL,
    },
    "4b": {  # type: ignore[typeddict-item]
        **_REAL,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
        "vision": _VISION_SMALL,
    },
    "8b": {  # type: ignore[typeddict-item]
        **_REAL,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
        "vision": _VISION_8B,
    },
}

PATCH_SIZE = 16
TEMPORAL_PATCH_SIZE = 2
SPATIAL_MERGE_SIZE = 2
IN_CHANNELS = 3
IMAGE_MEAN = [0.5, 0.5, 0.5]
IMAGE_STD = [0.5, 0.5, 0.5]
VIDEO_MIN_PIXELS = 4096
VIDEO_MAX_PIXELS = 25165824

# Qwen3's tokens after Qwen2-VL's specials, at their hub ids; none of them is `special` in the hub files.
QWEN3_ADDED_TOKENS: dict[str, int] = {
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<|fim_prefix|>": 151659,
    "<|fim_middle|>": 151660,
    "<|fim_suffix|>": 151661,
    "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663,
    "<|file_sep|>": 151664,
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}

# The vision and message parts of Qwen3-VL-Instruct's template (tools left out): no default system prompt
# (unlike Qwen2-VL's), and each image or video one `<|vision_start|><|..._pad|><|vision_end|>` that the
# processor expands (a video per frame, with its timestamp).
CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- macro render_content(content, count_vision) %}{%- if content is string %}{{- content }}"
    "{%- else %}{%- for item in content %}"
    "{%- if item.type == 'image' or 'image' in item or 'image_url' in item %}"
    "{%- if count_vision %}{%- set image_count.value = image_count.value + 1 %}{%- endif %}"
    "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif item.type == 'video' or 'video' in item %}"
    "{%- if count_vision %}{%- set video_count.value = video_count.value + 1 %}{%- endif %}"
    "{%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in item %}{{- item.text }}{%- endif %}{%- endfor %}{%- endif %}{%- endmacro %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{{- '<|im_start|>system\\n' + render_content(message.content, false) + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'user' or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content, true) + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + render_content(message.content, true)"
    " + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# A Qwen3-VL "Thinking" checkpoint's template: the generation prompt opens the thinking (`<think>\n`), so the model's
# answer starts inside it and closes it with `</think>`. `enable_thinking=false` (Qwen3's hybrid templates' switch)
# gives the closed empty block instead, so that one synthetic checkpoint covers both styles of prompt.
THINKING_CHAT_TEMPLATE = CHAT_TEMPLATE.removesuffix(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
) + (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)


def _shape(size: str) -> SizeShape:
    try:
        return SIZES[size]
    except KeyError:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}") from None


# --------------------------------------------------------------------------- config


def config_dict(size: str) -> dict[str, Any]:
    """config.json as the hub's Qwen3-VL repositories have it (written by transformers' Qwen3VLConfig)."""
    shape = _shape(size)
    vision = shape["vision"]
    text = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": synth.BOS_TOKEN_ID,
        "dtype": shape["dtype"],
        "eos_token_id": synth.EOS_TOKEN_ID,
        "head_dim": shape["head_dim"],
        "hidden_act": "silu",
        "hidden_size": shape["hidden_size"],
        "initializer_range": shape["init_std"],
        "intermediate_size": shape["intermediate_size"],
        "max_position_embeddings": shape["max_position_embeddings"],
        "model_type": "qwen3_vl_text",
        "num_attention_heads": shape["num_attention_heads"],
        "num_hidden_layers": shape["num_hidden_layers"],
        "num_key_value_heads": shape["num_key_value_heads"],
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "mrope_interleaved": True,
            "mrope_section": list(shape["mrope_section"]),
            "rope_type": "default",
        },
        "rope_theta": shape["rope_theta"],
        "use_cache": True,
        "vocab_size": shape["vocab_size"],
    }
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "image_token_id": synth.SPECIAL_TOKENS["<|image_pad|>"],
        "model_type": "qwen3_vl",
        "text_config": text,
        "tie_word_embeddings": shape["tie_word_embeddings"],
        "transformers_version": "4.57.0.dev0",
        "video_token_id": synth.SPECIAL_TOKENS["<|video_pad|>"],
        "vision_config": {
            "deepstack_visual_indexes": list(vision["deepstack_visual_indexes"]),
            "depth": vision["depth"],
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": vision["hidden_size"],
            "in_channels": IN_CHANNELS,
            "initializer_range": shape["init_std"],
            "intermediate_size": vision["intermediate_size"],
            "model_type": "qwen3_vl",  # the hub's files say so; transformers renames it on load
            "num_heads": vision["num_heads"],
            "num_position_embeddings": vision["num_position_embeddings"],
            "out_hidden_size": shape["hidden_size"],
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": SPATIAL_MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        },
        "vision_end_token_id": synth.SPECIAL_TOKENS["<|vision_end|>"],
        "vision_start_token_id": synth.SPECIAL_TOKENS["<|vision_start|>"],
    }


# --------------------------------------------------------------------------- weights


def _text_shapes(shape: SizeShape) -> dict[str, tuple[int, ...]]:
    hidden, inter, head_dim = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q_dim, kv_dim = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    prefix = "model.language_model"
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}.embed_tokens.weight": (shape["vocab_size"], hidden)}
    for i in range(shape["num_hidden_layers"]):
        p = f"{prefix}.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (q_dim, hidden),
            f"{p}.self_attn.k_proj.weight": (kv_dim, hidden),
            f"{p}.self_attn.v_proj.weight": (kv_dim, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, q_dim),
            f"{p}.self_attn.q_norm.weight": (head_dim,),
            f"{p}.self_attn.k_norm.weight": (head_dim,),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
        }
    shapes[f"{prefix}.norm.weight"] = (hidden,)
    if not shape["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (shape["vocab_size"], hidden)
    return shapes


def _merger_shapes(prefix: str, dim: int, out: int, postshuffle: bool) -> dict[str, tuple[int, ...]]:
    merged = dim * SPATIAL_MERGE_SIZE**2
    norm = merged if postshuffle else dim  # DeepStack mergers normalise after concatenating the 2x2 window
    return {
        f"{prefix}.norm.weight": (norm,),
        f"{prefix}.norm.bias": (norm,),
        f"{prefix}.linear_fc1.weight": (merged, merged),
        f"{prefix}.linear_fc1.bias": (merged,),
        f"{prefix}.linear_fc2.weight": (out, merged),
        f"{prefix}.linear_fc2.bias": (out,),
    }


def _vision_shapes(shape: SizeShape) -> dict[str, tuple[int, ...]]:
    vision = shape["vision"]
    dim, mlp_dim, out = vision["hidden_size"], vision["intermediate_size"], shape["hidden_size"]
    kernel = (TEMPORAL_PATCH_SIZE, PATCH_SIZE, PATCH_SIZE)
    shapes: dict[str, tuple[int, ...]] = {
        "model.visual.patch_embed.proj.weight": (dim, IN_CHANNELS, *kernel),
        "model.visual.patch_embed.proj.bias": (dim,),
        "model.visual.pos_embed.weight": (vision["num_position_embeddings"], dim),
    }
    for i in range(vision["depth"]):
        p = f"model.visual.blocks.{i}"
        shapes |= {
            f"{p}.norm1.weight": (dim,),
            f"{p}.norm1.bias": (dim,),
            f"{p}.norm2.weight": (dim,),
            f"{p}.norm2.bias": (dim,),
            f"{p}.attn.qkv.weight": (3 * dim, dim),
            f"{p}.attn.qkv.bias": (3 * dim,),
            f"{p}.attn.proj.weight": (dim, dim),
            f"{p}.attn.proj.bias": (dim,),
            f"{p}.mlp.linear_fc1.weight": (mlp_dim, dim),
            f"{p}.mlp.linear_fc1.bias": (mlp_dim,),
            f"{p}.mlp.linear_fc2.weight": (dim, mlp_dim),
            f"{p}.mlp.linear_fc2.bias": (dim,),
        }
    shapes |= _merger_shapes("model.visual.merger", dim, out, postshuffle=False)
    for k in range(len(vision["deepstack_visual_indexes"])):
        shapes |= _merger_shapes(f"model.visual.deepstack_merger_list.{k}", dim, out, postshuffle=True)
    return shapes


def weight_shapes(size: str) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint under the hub's names, in file order."""
    shape = _shape(size)
    return _text_shapes(shape) | _vision_shapes(shape)


def parameter_count(size: str) -> int:
    return sum(math.prod(s) for s in weight_shapes(size).values())


def write_weights(out_dir: Path, size: str, seed: int) -> list[Path]:
    """model.safetensors, or 4 GB shards with their index when it does not fit (as synth.write_weights)."""
    shape = _shape(size)
    dtype_name, std = shape["dtype"], shape["init_std"]
    shapes = weight_shapes(size)
    itemsize = synth._torch_dtype(dtype_name).itemsize
    shards = _plan_shards(shapes, itemsize, synth.MAX_SHARD_BYTES)
    if len(shards) == 1:
        path = out_dir / "model.safetensors"
        _write_safetensors(path, shards[0], shapes, seed, dtype_name, std)
        return [path]
    paths, weight_map = [], {}
    for i, names in enumerate(shards, start=1):
        path = out_dir / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(path, names, shapes, seed, dtype_name, std)
        weight_map |= dict.fromkeys(names, path.name)
        paths.append(path)
    total = sum(math.prod(s) for s in shapes.values()) * itemsize
    _write_json(
        out_dir / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
    )
    return paths


# --------------------------------------------------------------------------- tokenizer and processors


def write_tokenizer(out_dir: Path) -> None:
    """synth's Qwen tokenizer with Qwen3's added tokens after its specials, and the Qwen3-VL chat template."""
    tokenizer = synth.build_tokenizer()
    added = sorted(QWEN3_ADDED_TOKENS, key=QWEN3_ADDED_TOKENS.__getitem__)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    for token, token_id in QWEN3_ADDED_TOKENS.items():
        if tokenizer.token_to_id(token) != token_id:
            raise RuntimeError(f"{token} landed on id {tokenizer.token_to_id(token)}, expected {token_id}")
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    _write_vocab(out_dir)
    config = synth.tokenizer_config()
    config["added_tokens_decoder"] |= {
        str(i): synth._added_token_entry(t) | {"special": False} for t, i in QWEN3_ADDED_TOKENS.items()
    }
    config["chat_template"] = CHAT_TEMPLATE
    config["model_max_length"] = 262144
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", synth.special_tokens_map())
    _write_json(out_dir / "chat_template.json", {"chat_template": CHAT_TEMPLATE})


def _write_vocab(out_dir: Path) -> None:
    vocab_text = json.dumps(synth.full_vocab(), ensure_ascii=False, separators=(",", ":"))
    (out_dir / "vocab.json").write_text(vocab_text, encoding="utf-8")
    _, merges = synth._trained_bpe()
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")


def _processing(min_pixels: int, max_pixels: int) -> dict[str, Any]:
    return {
        "size": {"longest_edge": max_pixels, "shortest_edge": min_pixels},
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": SPATIAL_MERGE_SIZE,
        "image_mean": IMAGE_MEAN,
        "image_std": IMAGE_STD,
        "processor_class": "Qwen3VLProcessor",
    }


def preprocessor_config(size: str) -> dict[str, Any]:
    shape = _shape(size)
    config = _processing(shape["image_min_pixels"], shape["image_max_pixels"])
    return {**config, "image_processor_type": "Qwen2VLImageProcessorFast"}


def video_preprocessor_config(size: str) -> dict[str, Any]:
    _shape(size)
    # fps, min/max_frames: Qwen3VLVideoProcessor's defaults, written out so that the fetcher reads them from the
    # file. cap_pixels_per_frame: qwen-vl-utils' total-video pixel budget, as synth writes for Qwen2-VL.
    return {
        **_processing(VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS),
        "video_processor_type": "Qwen3VLVideoProcessor",
        "do_sample_frames": True,
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768,
        "cap_pixels_per_frame": True,
    }


# --------------------------------------------------------------------------- checkpoint


def _write_all(out_dir: Path, size: str, seed: int) -> None:
    _write_json(out_dir / "config.json", config_dict(size))
    _write_json(out_dir / "generation_config.json", synth.generation_config())
    _write_json(out_dir / "preprocessor_config.json", preprocessor_config(size))
    _write_json(out_dir / "video_preprocessor_config.json", video_preprocessor_config(size))
    write_tokenizer(out_dir)
    write_weights(out_dir, size, seed)
    meta = {"generator": "vlm-serve qwen3_vl_synth", "version": GENERATOR_VERSION, "size": size, "seed": seed}
    _write_json(out_dir / synth.META_FILE, meta)


def generate_checkpoint(out_dir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write a complete Qwen3-VL checkpoint directory; built beside it and renamed into place."""
    _shape(size)
    out_dir = Path(out_dir).expanduser().absolute()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_all(tmp_dir, size, seed)
        tmp_dir.chmod(0o755)
        synth._swap_into_place(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--out", required=True, type=Path, help="checkpoint directory to create")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = generate_checkpoint(args.out, args.size, args.seed)
    print(
        f"wrote {path} ({args.size}, seed {args.seed}, {parameter_count(args.size) / 1e9:.3f}B params)", file=sys.stderr
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
