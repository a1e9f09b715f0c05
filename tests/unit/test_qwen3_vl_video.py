"""Qwen3-VL videos against transformers' own pieces on the tiny synthetic checkpoint: frame sampling, sizes, pixel
values and patch layout (``Qwen3VLVideoProcessor``), the timestamp text (``Qwen3VLProcessor``), the expanded prompt
ids and the M-RoPE index (``Qwen3VLModel.get_rope_index``).

transformers' video processor resizes and normalises with torchvision, which is not installable here: how its
pieces are called without it is in `tests.qwen3_vl_video_reference` (the size its resize asks for is captured, the
pixels' resize is PIL's, its normalize is torchvision's arithmetic). The torchvision comparison is GPU-marked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

from benchmarks.media import jpeg_bytes, mjpeg_avi, video_frames
from common.config import FetcherConfig
from common.protocol import MediaInput
from tests import qwen3_vl_video_reference as reference
from workers.fetcher.media import load_timed_video
from workers.fetcher.video import DecodedVideo
from workers.fetcher.video_qwen3_vl import (
    Qwen3VideoSpec,
    frame_timestamps,
    preprocess,
    sample_indices,
    timestamp_text,
)
from workers.fetcher.worker import TimestampTokens
from workers.models import qwen3_vl_synth
from workers.models.mrope import expand_media_placeholders, frame_rope_positions
from workers.models.registry import family
from workers.models.spec import ModelSpec

RULES = FetcherConfig()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen3_vl_synth.generate_checkpoint(tmp_path_factory.mktemp("qwen3_vl") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="module")
def processor(tiny_path: Path) -> Qwen3VLVideoProcessor:
    return Qwen3VLVideoProcessor.from_pretrained(str(tiny_path))


@pytest.fixture(scope="module")
def spec(tiny_path: Path) -> Qwen3VideoSpec:
    return Qwen3VideoSpec.from_dir(tiny_path)


@pytest.fixture(scope="module")
def model_spec(tiny_path: Path) -> ModelSpec:
    return ModelSpec.from_dir(tiny_path)


def test_family_times_its_videos() -> None:
    assert family("qwen3_vl").video_timestamps
    assert not family("qwen2_vl").video_timestamps and not family("qwen2_5_vl").video_timestamps


def test_spec_reads_the_video_processor_config(spec: Qwen3VideoSpec, processor: Qwen3VLVideoProcessor) -> None:
    assert (spec.frames.min_pixels, spec.frames.max_pixels) == (
        processor.size.shortest_edge,
        processor.size.longest_edge,
    )
    assert (spec.fps, spec.min_frames, spec.max_frames) == (processor.fps, processor.min_frames, processor.max_frames)
    assert (spec.cap_pixels_per_frame, spec.max_video_tokens) == (
        processor.cap_pixels_per_frame,
        processor.max_video_tokens,
    )
    assert spec.frames.patch_size == processor.patch_size == 16


# --------------------------------------------------------------------------- frames


@pytest.mark.parametrize(
    ("total", "video_fps", "fps"),
    [
        *[(16, 8.0, 2.0), (16, 8.0, 4.0), (16, 8.0, 1.0), (16, 8.0, 30.0), (17, 8.0, 8.0), (30, 10.0, 1.5)],
        *[(3, 8.0, 2.0), (5000, 25.0, 2.0), (10_000, 30.0, 30.0), (45, 29.97, 2.0), (7, 24.0, 3.0)],
    ],
)
def test_frames_are_transformers_sample_frames(
    processor: Qwen3VLVideoProcessor, total: int, video_fps: float, fps: float
) -> None:
    metadata = VideoMetadata(total_num_frames=total, fps=video_fps)
    want = processor.sample_frames(metadata, fps=fps).tolist()
    assert sample_indices(total, video_fps, fps, processor.min_frames, processor.max_frames) == want


def test_timestamps_are_the_processors(processor: Qwen3VLVideoProcessor) -> None:
    for indices, video_fps in [([0, 5, 10, 15], 8.0), ([0, 2, 4, 6, 9], 8.0), ([0, 3, 6], 29.97), ([4], 2.0)]:
        want = Qwen3VLProcessor._calculate_timestamps(None, list(indices), video_fps, 2)  # type: ignore[arg-type]
        assert frame_timestamps(indices, video_fps, 2) == want
    assert timestamp_text(0.3125) == "<0.3 seconds>" and timestamp_text(12.25) == "<12.2 seconds>"


# --------------------------------------------------------------------------- sizes and pixels


@pytest.mark.parametrize(
    ("frames", "height", "width"),
    [(4, 112, 160), (8, 112, 160), (5, 64, 96), (3, 20, 50), (8, 480, 640), (768, 480, 640), (2, 1080, 1920)],
)
def test_sizes_are_transformers_resize(
    spec: Qwen3VideoSpec, processor: Qwen3VLVideoProcessor, frames: int, height: int, width: int
) -> None:
    video = DecodedVideo([np.zeros((height, width, 3), np.uint8)] * frames, frames, 8.0, list(range(frames)))
    _, grid, resized = preprocess(video, spec, max_video_tokens=10**9)  # the server's cap out of the way
    assert resized.shape[1:3] == reference.resized_size(processor, frames, height, width)
    assert grid == (-(-frames // 2), resized.shape[1] // 16, resized.shape[2] // 16)


def test_server_token_cap_shrinks_frames(spec: Qwen3VideoSpec) -> None:
    video = DecodedVideo([np.zeros((480, 640, 3), np.uint8)] * 8, 8, 8.0, list(range(8)))
    _, grid, _ = preprocess(video, spec, max_video_tokens=200)
    assert grid[0] * grid[1] * grid[2] // 4 <= 200


@pytest.mark.parametrize(("frames", "height", "width"), [(4, 112, 160), (5, 64, 96)])
def test_pixels_are_transformers_preprocess(
    spec: Qwen3VideoSpec, processor: Qwen3VLVideoProcessor, frames: int, height: int, width: int
) -> None:
    rng = np.random.default_rng(frames)
    source = [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(frames)]
    values, grid, resized = preprocess(DecodedVideo(source, frames, 8.0, list(range(frames))), spec, 24576)
    want, want_grid = reference.pixels(processor, resized)
    assert list(grid) == want_grid
    torch.testing.assert_close(torch.from_numpy(values), want, rtol=0, atol=0)


def test_fetcher_loads_a_clip(spec: Qwen3VideoSpec) -> None:
    """16 frames at 8 fps: fps 2 samples frames 0, 5, 10, 15; 160x112 becomes 160x128 (grid 8x10)."""
    clip = mjpeg_avi([jpeg_bytes(f) for f in video_frames(160, 112, 16, seed=5)], 160, 112, 8)
    import base64

    url = "data:video/x-msvideo;base64," + base64.b64encode(clip).decode()
    loaded = load_timed_video(MediaInput("video", url, fps=2), spec, RULES, "m")
    assert loaded.grid_thw == (2, 8, 10) and loaded.num_tokens == 40
    # (0/8 + 5/8) / 2 and (10/8 + 15/8) / 2
    assert loaded.frame_texts == ["<0.3 seconds>", "<1.6 seconds>"]
    default = load_timed_video(MediaInput("video", url), spec, RULES, "m")
    assert default.content_hash == loaded.content_hash  # the processor's fps (2) where the request has none
    four = load_timed_video(MediaInput("video", url, fps=4), spec, RULES, "m")
    assert four.grid_thw == (4, 8, 10) and len(four.frame_texts or []) == 4


# --------------------------------------------------------------------------- prompt and M-RoPE


def _hf_replacement(processor: Qwen3VLVideoProcessor, grid: list[int], indices: list[int], video_fps: float) -> str:
    metadata = VideoMetadata(total_num_frames=max(indices) + 1, fps=video_fps, frames_indices=indices)
    return reference.replacement(processor, grid, metadata)


VIDEOS = {  # grid, sampled indices, source fps
    "four_frames": ([2, 8, 10], [0, 5, 10, 15], 8.0),
    "odd_frames": ([3, 4, 6], [0, 2, 4, 6, 9], 8.0),
    "ntsc": ([4, 6, 4], [0, 12, 24, 36, 48, 60, 72, 84], 29.97),
}


@pytest.fixture(scope="module")
def tokenizer(tiny_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_path))


def _prompts(
    tiny_path: Path,
    tokenizer: Any,
    model_spec: ModelSpec,
    names: list[str],
    image: list[int] | None,
    processor: Qwen3VLVideoProcessor,
) -> tuple[list[int], list[int]]:
    """(ours: the single-placeholder prompt expanded as the decoder does, transformers': the processor's text)."""
    head = "<|im_start|>user\n" + ("<|vision_start|><|image_pad|><|vision_end|>" if image else "")
    one = head + "<|vision_start|><|video_pad|><|vision_end|>" * len(names) + "What happens?<|im_end|>\n"
    ids = tokenizer.encode(one, add_special_tokens=False)
    timestamps = TimestampTokens(str(tiny_path))
    media: list[tuple[str, list[int]]] = [("image", image)] if image else []
    texts: list[list[list[int]] | None] = [None] if image else []
    for name in names:
        grid, indices, video_fps = VIDEOS[name]
        media.append(("video", grid))
        texts.append([timestamps.ids(t) for t in (timestamp_text(s) for s in frame_timestamps(indices, video_fps, 2))])
    ours = expand_media_placeholders(ids, media, model_spec, texts)
    text = one
    if image:
        text = text.replace("<|image_pad|>", "<|image_pad|>" * (image[0] * image[1] * image[2] // 4), 1)
    pieces = text.split("<|video_pad|>")
    text = pieces[0] + "".join(
        _hf_replacement(processor, *VIDEOS[n]) + rest for n, rest in zip(names, pieces[1:], strict=True)
    )
    return ours, tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("names", [["four_frames"], ["odd_frames"], ["ntsc", "four_frames"]])
def test_expanded_prompt_is_the_processors(
    tiny_path: Path, tokenizer: Any, model_spec: ModelSpec, processor: Qwen3VLVideoProcessor, names: list[str]
) -> None:
    ours, want = _prompts(tiny_path, tokenizer, model_spec, names, None, processor)
    assert ours == want
    steps = sum(VIDEOS[name][0][0] for name in names)
    assert tokenizer.decode(ours, skip_special_tokens=False).count(" seconds><|vision_start|>") == steps


@pytest.fixture(scope="module")
def hf_model(tiny_path: Path) -> Qwen3VLForConditionalGeneration:
    return Qwen3VLForConditionalGeneration.from_pretrained(tiny_path, dtype=torch.float32).eval()


@pytest.mark.parametrize(
    ("names", "image"),
    [(["four_frames"], None), (["odd_frames"], None), (["ntsc", "four_frames"], [1, 6, 8])],
)
def test_rope_index_is_get_rope_index(
    tiny_path: Path,
    tokenizer: Any,
    model_spec: ModelSpec,
    hf_model: Qwen3VLForConditionalGeneration,
    processor: Qwen3VLVideoProcessor,
    names: list[str],
    image: list[int] | None,
) -> None:
    ids, _ = _prompts(tiny_path, tokenizer, model_spec, names, image, processor)
    videos = [VIDEOS[name][0] for name in names]
    ours, delta = frame_rope_positions(ids, [image] if image else [], videos, model_spec)
    tensor = torch.tensor([ids])
    types = (tensor == model_spec.image_token_id).int() + 2 * (tensor == model_spec.video_token_id).int()
    want, want_delta = hf_model.model.get_rope_index(
        tensor,
        mm_token_type_ids=types,
        image_grid_thw=torch.tensor([image]) if image else None,
        video_grid_thw=torch.tensor(videos),
    )
    torch.testing.assert_close(ours, want[:, 0], rtol=0, atol=0)
    assert delta == int(want_delta.item())


def test_expansion_checks_timestamps(model_spec: ModelSpec) -> None:
    ids = [1, model_spec.video_token_id, 2]
    with pytest.raises(ValueError, match="2 temporal steps has 1 timestamps"):
        expand_media_placeholders(ids, [("video", [2, 4, 4])], model_spec, [[[5]]])
    plain = expand_media_placeholders(ids, [("video", [2, 4, 4])], model_spec, [None])
    assert plain == [1, *[model_spec.video_token_id] * 8, 2]
