"""Qwen2.5-VL's model code against transformers' ``qwen2_5_vl``, on the generator's tiny checkpoint (CPU, fp32):
the window-attention vision tower, the language model's logits, M-RoPE positions (videos in absolute time) and
greedy generation; and the checkpoint itself: the Hugging Face layout, loadable by transformers."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

from tests.unit import hf_reference as hf
from tests.unit.test_model_parity import MEDIA_CASES, Grid, Prompt, make_prompt
from workers.models import synth, synth_qwen2_5_vl
from workers.models.language import KVCache, LanguageModel, merge_media_embeddings
from workers.models.mrope import decode_positions, rope_positions
from workers.models.qwen2_5_vl import WindowVisionTower, window_index
from workers.models.registry import checkpoint_family, read_spec
from workers.models.spec import ModelSpec


@dataclass
class Checkpoint:
    path: Path
    reference: Qwen2_5_VLForConditionalGeneration
    spec: ModelSpec
    vision: WindowVisionTower
    language: LanguageModel


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    path = synth.generate_checkpoint(tmp_path_factory.mktemp("q25") / "tiny", "tiny", 0, family="qwen2_5_vl")
    reference, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # every tensor where transformers looks for it, none left over
    family = checkpoint_family(path)
    vision = family.vision_tower(path, dtype=torch.float32)
    language = family.language_model(path, dtype=torch.float32)
    assert isinstance(vision, WindowVisionTower) and isinstance(language, LanguageModel)
    return Checkpoint(path, reference.eval(), read_spec(path), vision, language)


# --- the checkpoint ---------------------------------------------------------------------------------


def test_tiny_checkpoint_exercises_every_feature(ckpt: Checkpoint) -> None:
    vision = ckpt.spec.vision
    assert ckpt.spec.model_type == "qwen2_5_vl"
    assert 0 < len(vision.fullatt_block_indexes) < vision.depth  # blocks of both kinds
    assert vision.window_size // vision.patch_size < 8  # windows smaller than the test images' grids
    assert (vision.hidden_act, vision.tokens_per_second) == ("silu", 2.0)
    config = ckpt.reference.config.vision_config
    assert (config.window_size, list(config.fullatt_block_indexes)) == (vision.window_size, [1])


@pytest.mark.parametrize("size", ["3b", "7b"])
def test_real_shapes_are_the_hub_repositories(size: str) -> None:
    config = synth_qwen2_5_vl.config_dict(size)
    spec = ModelSpec.from_config(config, {"eos_token_id": [151645, 151643]})
    expected = {"3b": (2048, 36, 16, 2, True), "7b": (3584, 28, 28, 4, False)}[size]
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.tie_word_embeddings) == expected
    assert (spec.vision.embed_dim, spec.vision.depth, spec.vision.mlp_hidden_dim) == (1280, 32, 3420)
    assert spec.vision.fullatt_block_indexes == (7, 15, 23, 31) and spec.vision.window_size == 112
    shapes = synth_qwen2_5_vl.weight_shapes(size)
    assert ("lm_head.weight" in shapes) is not spec.tie_word_embeddings
    assert shapes["visual.merger.mlp.2.weight"] == (spec.hidden_size, 5120)


@pytest.mark.parametrize(
    "name", ["rgb_odd_333x517_jpeg", "rgb_h3000_w4000_jpeg", "grey_L_png", "rgba_partial_alpha_png"]
)
def test_fetcher_pixels_equal_transformers_image_processor(ckpt: Checkpoint, name: str) -> None:
    """The checkpoint's preprocessor_config.json, read by transformers' (PIL) Qwen2-VL image processor, which
    Qwen2.5-VL uses, and by the fetcher: the same pixel values and grid."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.unit.test_image_preprocess import MAX_IMAGE_PIXELS, assert_identical, case_bytes, reference_outputs
    from workers.fetcher.image import ImageProcessorSpec, decode_image, preprocess_image

    written = json.loads((ckpt.path / "preprocessor_config.json").read_text())
    assert written["processor_class"] == "Qwen2_5_VLProcessor"
    reference = Qwen2VLImageProcessorPil.from_pretrained(ckpt.path)
    ours = ImageProcessorSpec.from_dir(ckpt.path)
    assert (ours.max_pixels, reference.size["longest_edge"]) == (written["max_pixels"], written["max_pixels"])
    data = case_bytes(name)
    expected = reference_outputs(reference, Image.open(io.BytesIO(data)))
    assert_identical(preprocess_image(decode_image(data, MAX_IMAGE_PIXELS), ours), expected)


# --- the vision tower -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "grids",
    [
        [[1, 8, 8]],  # a multiple of the 4-patch window
        [[1, 6, 10]],  # not a multiple: the last windows are short
        [[1, 8, 12], [1, 6, 10]],  # two images of different sizes
        [[2, 4, 6], [1, 10, 4]],  # a video's frames window by window, then an image
    ],
)
def test_vision_tower_matches_transformers(ckpt: Checkpoint, grids: list[Grid]) -> None:
    grid = torch.tensor(grids)
    pixels = torch.randn(
        int(grid.prod(dim=1).sum()), ckpt.spec.vision.patch_dim, generator=torch.Generator().manual_seed(3)
    )
    expected = hf.vision_output(ckpt.reference, pixels, grid)
    torch.testing.assert_close(ckpt.vision(pixels, grid), expected, rtol=1e-5, atol=1e-5)


def test_window_index_matches_transformers() -> None:
    from transformers.vision_utils import get_vision_window_index

    grid = torch.tensor([[1, 6, 10], [2, 8, 8], [1, 2, 2]])
    order, lengths = window_index(grid, merge=2, window_size=56, patch_size=14)
    ref_order, ref_cu = get_vision_window_index(grid, spatial_merge_size=2, window_size=56, patch_size=14)
    assert torch.equal(order, ref_order)
    assert [0, *torch.tensor(lengths).cumsum(0).tolist()] == ref_cu.tolist()


# --- M-RoPE -----------------------------------------------------------------------------------------


def reference_rope(ckpt: Checkpoint, prompt: Prompt, seconds: Sequence[float] | None) -> tuple[torch.Tensor, int]:
    positions, deltas = ckpt.reference.model.get_rope_index(
        torch.tensor([prompt.ids]),
        mm_token_type_ids=hf.token_types(prompt.ids),
        image_grid_thw=torch.tensor(prompt.image_grids) if prompt.image_grids else None,
        video_grid_thw=torch.tensor(prompt.video_grids) if prompt.video_grids else None,
        second_per_grid_ts=torch.tensor(seconds) if seconds is not None else None,
    )
    return positions[:, 0], int(deltas.item())


@pytest.mark.parametrize("case", list(MEDIA_CASES))
@pytest.mark.parametrize("seconds", [None, 0.5, 2.0 / 3.0, 4.0], ids=["default", "4fps", "3fps", "halffps"])
def test_rope_positions_match_get_rope_index(ckpt: Checkpoint, case: str, seconds: float | None) -> None:
    prompt = make_prompt(ckpt.spec, MEDIA_CASES[case], seed=1)
    per_video = None if seconds is None else [seconds] * len(prompt.video_grids)
    ours, delta = rope_positions(prompt.ids, prompt.image_grids, prompt.video_grids, ckpt.spec, video_seconds=per_video)
    expected, expected_delta = reference_rope(ckpt, prompt, per_video)
    assert torch.equal(ours, expected)
    assert delta == expected_delta


def test_video_positions_are_in_absolute_time(ckpt: Checkpoint) -> None:
    prompt = make_prompt(ckpt.spec, [("video", (4, 4, 4))], seed=2)
    ours, _ = rope_positions(prompt.ids, [], prompt.video_grids, ckpt.spec, video_seconds=[1.0])
    start = ours[0, prompt.ids.index(ckpt.spec.video_token_id)]
    video = ours[0][torch.tensor(prompt.ids) == ckpt.spec.video_token_id]
    # two tokens a second, one grid step a second: each frame group two ids after the last
    assert sorted(set((video - start).tolist())) == [0, 2, 4, 6]


# --- the language model and generation --------------------------------------------------------------


def embed(ckpt: Checkpoint, prompt: Prompt) -> torch.Tensor:
    embeds = ckpt.language.embed(prompt.ids)
    for pixels, grids, token in (
        (prompt.image_pixels, prompt.image_grids, ckpt.spec.image_token_id),
        (prompt.video_pixels, prompt.video_grids, ckpt.spec.video_token_id),
    ):
        if pixels is not None:
            embeds = merge_media_embeddings(embeds, prompt.ids, ckpt.vision(pixels, torch.tensor(grids)), [token])
    return embeds


def reference_media(prompt: Prompt, seconds: Sequence[float] | None) -> dict[str, torch.Tensor]:
    kwargs: dict[str, torch.Tensor] = {}
    if prompt.image_pixels is not None:
        kwargs |= {"pixel_values": prompt.image_pixels, "image_grid_thw": torch.tensor(prompt.image_grids)}
    if prompt.video_pixels is not None:
        kwargs |= {"pixel_values_videos": prompt.video_pixels, "video_grid_thw": torch.tensor(prompt.video_grids)}
        if seconds is not None:
            kwargs["second_per_grid_ts"] = torch.tensor(seconds)
    if kwargs:
        kwargs["mm_token_type_ids"] = hf.token_types(prompt.ids)
    return kwargs


VIDEO_SECONDS = 2.0  # one sampled frame a second, two a grid step: temporal ids 0, 4 (not 0, 1 as Qwen2-VL)


@pytest.mark.parametrize("case", list(MEDIA_CASES))
def test_logits_match_transformers(ckpt: Checkpoint, case: str) -> None:
    prompt = make_prompt(ckpt.spec, MEDIA_CASES[case], seed=4)
    seconds = [VIDEO_SECONDS] * len(prompt.video_grids)
    positions, _ = rope_positions(prompt.ids, prompt.image_grids, prompt.video_grids, ckpt.spec, video_seconds=seconds)
    ours = ckpt.language(embed(ckpt, prompt), positions, ckpt.language.new_cache(), all_logits=True)
    ckpt.reference.model.rope_deltas = None
    with torch.no_grad():
        expected = ckpt.reference(
            input_ids=torch.tensor([prompt.ids]), use_cache=False, **reference_media(prompt, seconds)
        ).logits[0]
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)


def greedy(ckpt: Checkpoint, prompt: Prompt, seconds: list[float], max_new_tokens: int = 32) -> list[int]:
    cache = KVCache.for_model(ckpt.language)
    positions, delta = rope_positions(
        prompt.ids, prompt.image_grids, prompt.video_grids, ckpt.spec, video_seconds=seconds
    )
    logits = ckpt.language(embed(ckpt, prompt), positions, cache)
    out: list[int] = []
    while True:
        out.append(int(logits.argmax()))
        if out[-1] in ckpt.spec.eos_token_ids or len(out) == max_new_tokens:
            return out
        logits = ckpt.language(ckpt.language.embed(out[-1:]), decode_positions(cache.length, 1, delta), cache)


@pytest.mark.parametrize("case", list(MEDIA_CASES))
def test_greedy_generation_matches_transformers(ckpt: Checkpoint, case: str) -> None:
    prompt = make_prompt(ckpt.spec, MEDIA_CASES[case], seed=6)
    seconds = [VIDEO_SECONDS] * len(prompt.video_grids)
    model = ckpt.reference
    model.model.rope_deltas = None
    ids = torch.tensor([prompt.ids])
    plain = GenerationConfig(
        do_sample=False,
        max_new_tokens=32,
        eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=model.generation_config.pad_token_id,
    )
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=plain,
            **reference_media(prompt, seconds),
        )
    expected = out[0, ids.shape[1] :].tolist()
    assert greedy(ckpt, prompt, seconds) == expected


def test_decoder_places_a_video_in_the_time_the_fetcher_sent(ckpt: Checkpoint) -> None:
    """The scheduler's positions use each video's second_per_grid_t from its PreparedMedia."""
    from common.protocol import PreparedMedia, PreparedRequest, SamplingParams
    from workers.decoder.config import EngineConfig
    from workers.decoder.scheduler import Scheduler

    spec = ckpt.spec
    scheduler = Scheduler(
        EngineConfig(max_model_len=4096, max_running=4, prefill_budget=4096, num_blocks=64, block_size=4), spec, {}
    )
    media = PreparedMedia("video", "hash", [4, 4, 4], 16, second_per_grid_t=VIDEO_SECONDS)
    ids = [11, 12, spec.vision_start_token_id, spec.video_token_id, 13]
    seq = scheduler.prepare(PreparedRequest("r", ids, [media], SamplingParams(max_tokens=2)))
    expected, delta = rope_positions(seq.prompt_ids, [], [[4, 4, 4]], spec, video_seconds=[VIDEO_SECONDS])
    assert torch.equal(seq.positions, expected) and seq.delta == delta
    untimed, _ = rope_positions(seq.prompt_ids, [], [[4, 4, 4]], spec)
    assert not torch.equal(seq.positions, untimed)


def test_the_tensorrt_backend_is_refused_before_start_up(ckpt: Checkpoint) -> None:
    """The TensorRT engine is built for Qwen2-VL's graph only: the launcher's preflight says so, not a restarting
    encoder (onnxruntime runs the windowed export: tests/unit/test_onnx_backend.py)."""
    from common.config import Config
    from ops.deploy import preflight
    from workers.encoder.backends import check_backend

    cfg = Config()
    cfg.model.path = str(ckpt.path)
    cfg.encoder.backend = "tensorrt"
    refusal = (
        r"backend = 'tensorrt' builds only Qwen2-VL's vision tower, not this checkpoint's windowed Qwen2.5-VL one: "
        r"its ONNX export has more inputs"
    )
    with pytest.raises(ValueError, match=refusal):
        preflight(cfg)
    cfg.encoder.backend = "onnxruntime"
    check_backend(cfg, ckpt.spec.vision)


@pytest.mark.parametrize("size", ["tiny", "3b", "7b"])
def test_every_tensor_is_where_transformers_puts_it(size: str) -> None:
    """Each size's tensors, named as the hub repositories name them, are exactly those of transformers' model built
    from the written config.json (on the meta device: no memory), shape for shape."""
    from transformers import Qwen2_5_VLConfig

    config = Qwen2_5_VLConfig(**synth_qwen2_5_vl.config_dict(size))
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    tied = config.tie_word_embeddings
    expected = {
        name: tuple(p.shape) for name, p in model.state_dict().items() if not (tied and name == "lm_head.weight")
    }
    ours = {
        name.replace("visual.", "model.visual.", 1)
        if name.startswith("visual.")
        else name.replace("model.", "model.language_model.", 1): shape
        for name, shape in synth_qwen2_5_vl.weight_shapes(size).items()
    }
    assert ours == expected


def test_cli_writes_the_family(tmp_path: Path) -> None:
    assert synth.main(["--family", "qwen2_5_vl", "--size", "tiny", "--out", str(tmp_path / "q")]) == 0
    assert json.loads((tmp_path / "q" / "config.json").read_text())["model_type"] == "qwen2_5_vl"
    assert json.loads((tmp_path / "q" / synth.META_FILE).read_text())["family"] == "qwen2_5_vl"
