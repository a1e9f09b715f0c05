"""Qwen3-VL (dense) against transformers' `qwen3_vl`, on the synthetic tiny checkpoint, CPU fp32.

The synthetic checkpoint must load in transformers exactly (every tensor used, none missing) in every size; the
vision tower's merged output and every DeepStack feature set, and the whole model's logits and greedy tokens, must
equal transformers' within the tolerances the Qwen2-VL parity tests use.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    GenerationConfig,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)
from transformers.vision_utils import get_vision_interpolation_indices_and_weights

from workers.models import qwen3_vl_synth
from workers.models.language import KVCache, merge_media_embeddings
from workers.models.mrope import decode_positions, rope_positions
from workers.models.qwen3_vl_spec import Qwen3VLSpec
from workers.models.qwen3_vl_text import DeepStack, Qwen3LanguageModel, interleaved_mrope_axis
from workers.models.qwen3_vl_vision import Qwen3VisionTower, position_interpolation
from workers.models.weights import CheckpointWeights

Grid = tuple[int, int, int]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen3_vl_synth.generate_checkpoint(tmp_path_factory.mktemp("qwen3_vl") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="module")
def reference(tiny_path: Path) -> Qwen3VLForConditionalGeneration:
    return Qwen3VLForConditionalGeneration.from_pretrained(tiny_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def spec(tiny_path: Path) -> Qwen3VLSpec:
    return Qwen3VLSpec.from_dir(tiny_path)


@pytest.fixture(scope="module")
def tower(tiny_path: Path) -> Qwen3VisionTower:
    return Qwen3VisionTower.from_checkpoint(tiny_path, dtype=torch.float32)


def _pixels(grids: list[Grid], spec: Qwen3VLSpec, seed: int = 0) -> torch.Tensor:
    rows = sum(t * h * w for t, h, w in grids)
    return torch.randn(rows, spec.vision.patch_dim, generator=torch.Generator().manual_seed(seed))


# --- the synthetic checkpoint -----------------------------------------------------------------------


def test_tiny_checkpoint_loads_in_transformers_with_every_tensor(tiny_path: Path) -> None:
    _, info = Qwen3VLForConditionalGeneration.from_pretrained(tiny_path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    config = Qwen3VLConfig.from_pretrained(tiny_path)
    assert config.text_config.rope_parameters["mrope_section"] == [4, 2, 2]
    assert config.text_config.rope_parameters["rope_theta"] == 5000000.0
    assert config.vision_config.deepstack_visual_indexes == [0, 1]
    assert config.vision_config.patch_size == 16
    assert config.vision_config.model_type == "qwen3_vl_vision"


def test_tiny_exercises_every_feature(spec: Qwen3VLSpec) -> None:
    assert spec.vision.patch_size == 16
    assert len(spec.vision.deepstack_visual_indexes) >= 2
    assert spec.num_layers > spec.num_deepstack  # a decoder layer without a DeepStack add
    assert spec.vision.grid_side**2 == spec.vision.num_position_embeddings
    assert spec.mrope_section == (4, 2, 2) and spec.mrope_interleaved


@pytest.mark.parametrize("size", ["2b", "4b", "8b"])
def test_real_shapes_are_transformers_parameter_shapes(size: str) -> None:
    # Without writing gigabytes: the model transformers builds from the config has exactly our tensors.
    config = Qwen3VLConfig.from_dict(qwen3_vl_synth.config_dict(size))
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert qwen3_vl_synth.weight_shapes(size) == expected
    Qwen3VLSpec.from_config(qwen3_vl_synth.config_dict(size))


def test_tokenizer_and_processor_files(tiny_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|im_end|>", "<think>")}
    assert ids == {"<|image_pad|>": 151655, "<|video_pad|>": 151656, "<|im_end|>": 151645, "<think>": 151667}
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "hi"}]},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>"
        "hi<|im_end|>\n<|im_start|>assistant\n"
    )
    processor = AutoImageProcessor.from_pretrained(tiny_path)
    assert (processor.patch_size, processor.merge_size, tuple(processor.image_mean)) == (16, 2, (0.5, 0.5, 0.5))
    video = json.loads((tiny_path / "video_preprocessor_config.json").read_text())
    assert video["video_processor_type"] == "Qwen3VLVideoProcessor" and video["patch_size"] == 16


def test_hub_key_layout_reads_through_checkpoint_weights(tiny_path: Path) -> None:
    weights = CheckpointWeights(tiny_path)
    assert "visual.deepstack_merger_list.1.linear_fc2.bias" in weights
    assert "model.layers.0.self_attn.q_norm.weight" in weights


# --- vision tower -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "grids",
    [
        [(1, 6, 8), (1, 4, 10)],  # two image sizes in one batch, neither the 6x6 learned grid
        [(1, 4, 4), (1, 12, 6), (1, 4, 4)],  # smaller and larger than the table, a repeated size (grouped order)
        [(2, 8, 6), (1, 6, 6)],  # a two-frame video beside an image of the table's own size
    ],
)
def test_vision_tower_and_deepstack_match_transformers(
    tower: Qwen3VisionTower, reference: Qwen3VLForConditionalGeneration, spec: Qwen3VLSpec, grids: list[Grid]
) -> None:
    pixels, grid = _pixels(grids, spec), torch.tensor(grids)
    ours = tower(pixels, grid)
    with torch.no_grad():
        ref = reference.model.visual(pixels, grid_thw=grid)
    torch.testing.assert_close(ours.merged, ref.pooler_output, atol=1e-5, rtol=1e-5)
    assert len(ours.deepstack) == len(ref.deepstack_features) == spec.num_deepstack
    for got, want in zip(ours.deepstack, ref.deepstack_features, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert ours.stacked().shape == (1 + spec.num_deepstack, *ours.merged.shape)


def test_position_interpolation_is_transformers_sampling() -> None:
    grid = torch.tensor([[1, 6, 8], [2, 4, 10], [1, 48, 64]])
    ours = position_interpolation(grid, side=48, merge=2)
    want = get_vision_interpolation_indices_and_weights(
        grid, num_grid_per_side=48, mode="bilinear", align_corners=True, spatial_merge_size=2
    )
    torch.testing.assert_close(ours[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(ours[1], want[1], rtol=0, atol=0)


def test_vision_tower_validates_inputs(tower: Qwen3VisionTower, spec: Qwen3VLSpec) -> None:
    with pytest.raises(ValueError, match="pixel_values"):
        tower(torch.zeros(4, 3), torch.tensor([[1, 2, 2]]))
    with pytest.raises(ValueError, match="divisible"):
        tower(torch.zeros(9, spec.vision.patch_dim), torch.tensor([[1, 3, 3]]))
    with pytest.raises(ValueError, match="covers"):
        tower(torch.zeros(5, spec.vision.patch_dim), torch.tensor([[1, 2, 2]]))


# --- text model and the whole model -----------------------------------------------------------------

IM_START, IM_END, NEWLINE = 151644, 151645, 198


@dataclass
class Prompt:
    ids: list[int]
    grids: list[Grid]
    pixels: torch.Tensor | None


def _prompt(spec: Qwen3VLSpec, grids: list[Grid], seed: int = 0) -> Prompt:
    """A chat-shaped prompt with each image's placeholders expanded, random text between."""
    rng = random.Random(seed)
    merge = spec.vision.spatial_merge_size

    def text(n: int) -> list[int]:
        return [rng.randrange(0, 151643) for _ in range(n)]

    ids = [IM_START, *text(1), NEWLINE]
    for t, h, w in grids:
        ids += [spec.vision_start_token_id, *[spec.image_token_id] * (t * h * w // merge**2), spec.vision_end_token_id]
        ids += text(4)
    ids += [IM_END, NEWLINE, IM_START, *text(1), NEWLINE]
    return Prompt(ids, grids, _pixels(grids, spec, seed) if grids else None)


def _token_types(spec: Qwen3VLSpec, ids: list[int]) -> torch.Tensor:
    return torch.tensor([[1 if i == spec.image_token_id else 0 for i in ids]], dtype=torch.int32)


def _hf_kwargs(spec: Qwen3VLSpec, prompt: Prompt) -> dict[str, torch.Tensor]:
    if prompt.pixels is None:
        return {}
    return {
        "pixel_values": prompt.pixels,
        "image_grid_thw": torch.tensor(prompt.grids),
        "mm_token_type_ids": _token_types(spec, prompt.ids),
    }


def _hf_positions(
    reference: Qwen3VLForConditionalGeneration, spec: Qwen3VLSpec, prompt: Prompt
) -> tuple[torch.Tensor, int]:
    if not prompt.grids:
        return torch.arange(len(prompt.ids)).expand(3, -1), 0
    positions, deltas = reference.model.get_rope_index(
        torch.tensor([prompt.ids]),
        mm_token_type_ids=_token_types(spec, prompt.ids),
        image_grid_thw=torch.tensor(prompt.grids),
    )
    return positions[:, 0], int(deltas.item())


def _prefill(
    language: Qwen3LanguageModel, tower: Qwen3VisionTower, spec: Qwen3VLSpec, prompt: Prompt, positions: torch.Tensor
) -> tuple[torch.Tensor, KVCache]:
    embeds = language.embed(prompt.ids)
    deepstack = None
    if prompt.pixels is not None:
        features = tower(prompt.pixels, torch.tensor(prompt.grids))
        embeds = merge_media_embeddings(embeds, prompt.ids, features.merged, [spec.image_token_id])
        deepstack = DeepStack.at_placeholders(prompt.ids, [spec.image_token_id], features.deepstack)
    cache = language.new_cache()
    return language(embeds, positions, cache, deepstack, all_logits=True), cache


@pytest.fixture(scope="module")
def language(tiny_path: Path) -> Qwen3LanguageModel:
    return Qwen3LanguageModel.from_checkpoint(tiny_path, dtype=torch.float32)


CASES: dict[str, list[Grid]] = {
    "text": [],
    "one_image": [(1, 6, 8)],
    "two_images": [(1, 4, 10), (1, 8, 6)],
}


def test_interleaved_mrope_axis_is_transformers_layout() -> None:
    # transformers: slot 3i+1 from h for i < section[1], 3i+2 from w for i < section[2], t elsewhere.
    assert interleaved_mrope_axis([24, 20, 20]).tolist() == [0, 1, 2] * 20 + [0] * 4
    assert interleaved_mrope_axis([4, 2, 2]).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]


def test_rope_cos_sin_match_transformers(
    language: Qwen3LanguageModel, reference: Qwen3VLForConditionalGeneration
) -> None:
    positions = torch.stack([torch.arange(20), torch.arange(20) // 3, torch.arange(20) % 5 + 7])
    cos, sin = language.rope_cos_sin(positions)
    ref_cos, ref_sin = reference.model.language_model.rotary_emb(
        torch.zeros(1, dtype=torch.float32), positions[:, None]
    )
    torch.testing.assert_close(cos, ref_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, ref_sin[0], rtol=0, atol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_image_positions_are_the_qwen2_rules(
    reference: Qwen3VLForConditionalGeneration, spec: Qwen3VLSpec, case: str
) -> None:
    # For images get_rope_index is Qwen2-VL's, so mrope.rope_positions (which reads only these fields) serves.
    prompt = _prompt(spec, CASES[case])
    fields = SimpleNamespace(vision=spec.vision, image_token_id=spec.image_token_id, video_token_id=spec.video_token_id)
    positions, delta = rope_positions(prompt.ids, prompt.grids, [], fields)  # type: ignore[arg-type]
    want, want_delta = _hf_positions(reference, spec, prompt)
    torch.testing.assert_close(positions, want, rtol=0, atol=0)
    assert delta == want_delta


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(
    language: Qwen3LanguageModel,
    tower: Qwen3VisionTower,
    reference: Qwen3VLForConditionalGeneration,
    spec: Qwen3VLSpec,
    case: str,
) -> None:
    prompt = _prompt(spec, CASES[case])
    positions, _ = _hf_positions(reference, spec, prompt)
    ours, _ = _prefill(language, tower, spec, prompt, positions)
    reference.model.rope_deltas = None
    with torch.no_grad():
        ref = reference(input_ids=torch.tensor([prompt.ids]), use_cache=False, **_hf_kwargs(spec, prompt)).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-5)


def test_deepstack_changes_the_logits(
    language: Qwen3LanguageModel, tower: Qwen3VisionTower, reference: Qwen3VLForConditionalGeneration, spec: Qwen3VLSpec
) -> None:
    # The parity above would hold vacuously if the adds were no-ops; without them the logits must move.
    prompt = _prompt(spec, CASES["one_image"])
    positions, _ = _hf_positions(reference, spec, prompt)
    with_deepstack, _ = _prefill(language, tower, spec, prompt, positions)
    features = tower(prompt.pixels, torch.tensor(prompt.grids))
    embeds = merge_media_embeddings(language.embed(prompt.ids), prompt.ids, features.merged, [spec.image_token_id])
    without = language(embeds, positions, language.new_cache(), None, all_logits=True)
    assert (with_deepstack - without).abs().max() > 1e-2


def _greedy(
    language: Qwen3LanguageModel,
    tower: Qwen3VisionTower,
    reference: Qwen3VLForConditionalGeneration,
    spec: Qwen3VLSpec,
    prompt: Prompt,
    max_new_tokens: int,
) -> list[int]:
    """Our eager loop: the prompt in one prefill, then one token a step at position index + delta."""
    positions, delta = _hf_positions(reference, spec, prompt)
    logits, cache = _prefill(language, tower, spec, prompt, positions)
    eos = set(reference.generation_config.eos_token_id)
    out = [int(logits[-1].argmax())]
    while len(out) < max_new_tokens and out[-1] not in eos:
        index = len(prompt.ids) + len(out) - 1
        step = language(language.embed([out[-1]]), decode_positions(index, 1, delta), cache)
        out.append(int(step.argmax()))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_generation_matches_transformers(
    language: Qwen3LanguageModel,
    tower: Qwen3VisionTower,
    reference: Qwen3VLForConditionalGeneration,
    spec: Qwen3VLSpec,
    case: str,
) -> None:
    prompt = _prompt(spec, CASES[case], seed=3)
    ours = _greedy(language, tower, reference, spec, prompt, max_new_tokens=8)
    reference.model.rope_deltas = None
    ids = torch.tensor([prompt.ids])
    plain = GenerationConfig(
        do_sample=False,
        max_new_tokens=8,
        eos_token_id=reference.generation_config.eos_token_id,
        pad_token_id=reference.generation_config.pad_token_id,
    )
    with torch.no_grad():
        ref = reference.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=plain, **_hf_kwargs(spec, prompt)
        )
    assert ours == ref[0, ids.shape[1] :].tolist()
