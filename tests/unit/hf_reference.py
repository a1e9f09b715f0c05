"""transformers' Qwen2-VL as the reference our model code is checked against (tests only).

Builds tiny checkpoints in both on-disk layouts and wraps the few HF calls the parity tests need
(vision tower, get_rope_index, forward logits, greedy generate), hiding transformers 5.17's API details:
the vision tower returns a ``BaseModelOutputWithPooling`` whose ``pooler_output`` is the merged output,
and ``get_rope_index`` needs ``mm_token_type_ids`` (0 text, 1 image, 2 video) rather than finding
vision tokens itself.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration

# Real Qwen2-VL special ids, so the tiny models exercise the same id ranges as the real ones.
BOS_TOKEN_ID = 151643
IM_END_TOKEN_ID = 151645
VISION_START_TOKEN_ID = 151652
VISION_END_TOKEN_ID = 151653
IMAGE_TOKEN_ID = 151655
VIDEO_TOKEN_ID = 151656
VOCAB_SIZE = 151936

# Larger than HF's 0.02 so activations and logits of the 64-wide model are O(1), as in a trained model,
# and the top-2 logit gaps that greedy parity depends on are far above rounding noise.
INIT_STD = 0.2


def tiny_config(tie_word_embeddings: bool = False) -> Qwen2VLConfig:
    return Qwen2VLConfig(
        text_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": VOCAB_SIZE,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": IM_END_TOKEN_ID,
            "initializer_range": INIT_STD,
        },
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "num_heads": 2,
            "hidden_size": 64,
            "mlp_ratio": 4,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "initializer_range": INIT_STD,
        },
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_TOKEN_ID,
        vision_end_token_id=VISION_END_TOKEN_ID,
        tie_word_embeddings=tie_word_embeddings,
    )


def build_tiny_model(seed: int, tie_word_embeddings: bool = False) -> Qwen2VLForConditionalGeneration:
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(tiny_config(tie_word_embeddings))
    # HF's init leaves biases at zero and norms at one; randomise them so loading them is observable.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, INIT_STD)
            elif "norm" in name or "ln_q" in name:
                param.normal_(1.0, INIT_STD)
    return model.eval()


def save_transformers5_layout(model: Qwen2VLForConditionalGeneration, out_dir: Path) -> Path:
    """Module-layout keys (``model.language_model.*``, ``model.visual.*``), nested config, sharded."""
    # transformers 5.17 writes hub-layout keys unless told otherwise.
    model.save_pretrained(out_dir, save_original_format=False, max_shard_size="20MB")
    return out_dir


def save_hub_layout(model: Qwen2VLForConditionalGeneration, out_dir: Path) -> Path:
    """Hub-layout keys plus a hand-written flat config.json exactly like Qwen/Qwen2-VL-2B-Instruct's."""
    model.save_pretrained(out_dir)
    text, vision = model.config.text_config, model.config.vision_config
    config = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "attention_dropout": 0.0,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": IM_END_TOKEN_ID,
        "vision_start_token_id": VISION_START_TOKEN_ID,
        "vision_end_token_id": VISION_END_TOKEN_ID,
        "vision_token_id": 151654,
        "image_token_id": IMAGE_TOKEN_ID,
        "video_token_id": VIDEO_TOKEN_ID,
        "hidden_act": "silu",
        "hidden_size": text.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": text.intermediate_size,
        "max_position_embeddings": text.max_position_embeddings,
        "max_window_layers": 28,
        "model_type": "qwen2_vl",
        "num_attention_heads": text.num_attention_heads,
        "num_hidden_layers": text.num_hidden_layers,
        "num_key_value_heads": text.num_key_value_heads,
        "rms_norm_eps": text.rms_norm_eps,
        "rope_theta": text.rope_parameters["rope_theta"],
        "sliding_window": 32768,
        "tie_word_embeddings": model.config.tie_word_embeddings,
        "torch_dtype": "float32",
        "transformers_version": "4.41.2",
        "use_cache": True,
        "use_sliding_window": False,
        "vision_config": {
            "depth": vision.depth,
            "embed_dim": vision.embed_dim,
            "mlp_ratio": vision.mlp_ratio,
            "num_heads": vision.num_heads,
            "in_chans": vision.in_channels,
            "hidden_size": vision.hidden_size,
            "patch_size": vision.patch_size,
            "spatial_merge_size": vision.spatial_merge_size,
            "spatial_patch_size": vision.patch_size,
            "temporal_patch_size": vision.temporal_patch_size,
        },
        "rope_scaling": {"type": "mrope", "mrope_section": list(text.rope_parameters["mrope_section"])},
        "vocab_size": text.vocab_size,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    # The chat checkpoints stop on either <|im_end|> or <|endoftext|>; only generation_config says so.
    generation = {
        "bos_token_id": BOS_TOKEN_ID,
        "pad_token_id": BOS_TOKEN_ID,
        "eos_token_id": [IM_END_TOKEN_ID, BOS_TOKEN_ID],
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out_dir


def load_reference(path: Path) -> Qwen2VLForConditionalGeneration:
    return Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def token_types(input_ids: Sequence[int]) -> torch.Tensor:
    """transformers' ``mm_token_type_ids``: 0 text, 1 image placeholder, 2 video placeholder."""
    kinds = {IMAGE_TOKEN_ID: 1, VIDEO_TOKEN_ID: 2}
    return torch.tensor([[kinds.get(int(t), 0) for t in input_ids]], dtype=torch.int32)


def _media_kwargs(
    model: Qwen2VLForConditionalGeneration,
    input_ids: Sequence[int],
    images: tuple[torch.Tensor, torch.Tensor] | None,
    videos: tuple[torch.Tensor, torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    kwargs: dict[str, torch.Tensor] = {}
    if images is not None:
        kwargs["pixel_values"], kwargs["image_grid_thw"] = images
    if videos is not None:
        kwargs["pixel_values_videos"], kwargs["video_grid_thw"] = videos
    if kwargs:
        kwargs["mm_token_type_ids"] = token_types(input_ids)
    return {name: value.to(model.device) for name, value in kwargs.items()}


@torch.no_grad()
def vision_output(
    model: Qwen2VLForConditionalGeneration, pixel_values: torch.Tensor, grid_thw: torch.Tensor
) -> torch.Tensor:
    out = model.model.visual(pixel_values, grid_thw=grid_thw)
    return out.pooler_output  # last_hidden_state is the pre-merger ViT output


@torch.no_grad()
def rope_index(
    model: Qwen2VLForConditionalGeneration,
    input_ids: Sequence[int],
    image_grids: Sequence[Sequence[int]],
    video_grids: Sequence[Sequence[int]],
) -> tuple[torch.Tensor, int]:
    positions, deltas = model.model.get_rope_index(
        torch.tensor([list(input_ids)]),
        mm_token_type_ids=token_types(input_ids),
        image_grid_thw=torch.tensor(image_grids) if image_grids else None,
        video_grid_thw=torch.tensor(video_grids) if video_grids else None,
    )
    return positions[:, 0], int(deltas.item())


@torch.no_grad()
def logits(
    model: Qwen2VLForConditionalGeneration,
    input_ids: Sequence[int],
    images: tuple[torch.Tensor, torch.Tensor] | None = None,
    videos: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    model.model.rope_deltas = None  # cached across calls by HF; stale values would leak in
    ids = torch.tensor([list(input_ids)], device=model.device)
    out = model(input_ids=ids, use_cache=False, **_media_kwargs(model, input_ids, images, videos))
    return out.logits[0]


@torch.no_grad()
def greedy_generate(
    model: Qwen2VLForConditionalGeneration,
    input_ids: Sequence[int],
    images: tuple[torch.Tensor, torch.Tensor] | None = None,
    videos: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_new_tokens: int = 32,
) -> list[int]:
    model.model.rope_deltas = None
    ids = torch.tensor([list(input_ids)], device=model.device)
    # Plain greedy, as the model tests' own loop: an Instruct checkpoint's generation_config
    # (repetition_penalty 1.05, ...) would otherwise apply even with do_sample=False.
    plain = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=model.generation_config.pad_token_id,
    )
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        generation_config=plain,
        **_media_kwargs(model, input_ids, images, videos),
    )
    return out[0, ids.shape[1] :].tolist()
