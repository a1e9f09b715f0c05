"""Video preprocessing: Qwen's frame-count rule, resize budget, patch layout, refusals."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from benchmarks.media import jpeg_bytes, mjpeg_avi, video_frames
from common.config import FetcherConfig
from common.protocol import MediaInput
from gateway.errors import ApiError
from gateway.prompt import PromptBuilder
from gateway.schema import parse_chat_request
from workers.fetcher.errors import MediaError
from workers.fetcher.image import ImageProcessorSpec
from workers.fetcher.media import load_video
from workers.fetcher.video import (
    VideoProcessorSpec,
    decode_video,
    frame_indices,
    frame_pixel_limits,
    patchify_video,
    preprocess_video,
    resize_frames,
    smart_nframes,
    video_hash,
)
from workers.models.synth import demo_checkpoint

SPEC = VideoProcessorSpec(ImageProcessorSpec(min_pixels=3136, max_pixels=100352))
RULES = FetcherConfig()


def clip(frames: int = 16, width: int = 96, height: int = 64, fps: int = 8) -> bytes:
    return mjpeg_avi([jpeg_bytes(f) for f in video_frames(width, height, frames, seed=1)], width, height, fps)


def data_url(data: bytes) -> str:
    import base64

    return "data:video/x-msvideo;base64," + base64.b64encode(data).decode()


# --------------------------------------------------------------------------- frame count (qwen-vl-utils smart_nframes)


@pytest.mark.parametrize(
    ("total", "video_fps", "fps", "expected"),
    [
        (16, 8.0, 2.0, 4),  # 2 s at 2 fps
        (16, 8.0, 4.0, 8),  # fps changes the count
        (16, 8.0, 1.0, 4),  # 2 frames wanted, clamped up to FPS_MIN_FRAMES
        (16, 8.0, 30.0, 16),  # 60 wanted, clamped to the frames there are
        (17, 8.0, 8.0, 16),  # 17 wanted: the cap is the even number below the total
        (30, 10.0, 1.5, 4),  # 4.5 -> floored to a multiple of 2
        (30, 10.0, 2.5, 6),  # 7.5 -> 6
        (3, 8.0, 2.0, 2),  # fewer frames than the minimum: as many even frames as exist
        (5000, 25.0, 2.0, 400),
    ],
)
def test_frame_count(total: int, video_fps: float, fps: float, expected: int) -> None:
    assert smart_nframes(total, video_fps, fps, 4, 768, 2) == expected


def test_frame_count_max_clamp() -> None:
    assert smart_nframes(10_000, 30.0, 30.0, 4, 768, 2) == 768
    assert smart_nframes(10_000, 30.0, 30.0, 4, 11, 2) == 10  # a cap is floored to an even count


def test_one_frame_is_refused() -> None:
    with pytest.raises(MediaError) as caught:
        smart_nframes(1, 8.0, 2.0, 4, 768, 2)
    assert caught.value.status == 400


def test_frame_indices_are_linspace_rounded() -> None:
    assert frame_indices(16, 4) == [0, 5, 10, 15]
    assert frame_indices(16, 16) == list(range(16))
    assert frame_indices(10, 4) == [0, 3, 6, 9]
    assert frame_indices(100, 6) == list(np.linspace(0, 99, 6).round().astype(int))


# --------------------------------------------------------------------------- resize


def test_frames_resize_to_one_smart_size() -> None:
    frames = [np.full((64, 96, 3), k, dtype=np.uint8) for k in range(4)]
    resized = resize_frames(frames, SPEC.frames, *frame_pixel_limits(SPEC, 4, 24576))
    assert resized.shape == (4, 56, 84, 3)  # round(64 / 28) * 28, round(96 / 28) * 28
    assert [int(f.mean()) for f in resized] == [0, 1, 2, 3]


def test_per_frame_budget_is_a_share_of_the_video_budget() -> None:
    # qwen-vl-utils: max(min(VIDEO_MAX_PIXELS, total_pixels / nframes * 2), 1.05 * min_pixels)
    assert frame_pixel_limits(SPEC, 4, 24576) == (3136, 100352)  # the per-frame cap binds
    total = int(100 * 28 * 28 * 0.9)
    assert frame_pixel_limits(SPEC, 8, 100) == (3136, total * 2 // 8)
    assert frame_pixel_limits(SPEC, 768, 100) == (3136, int(3136 * 1.05))  # floored
    small = dataclasses.replace(SPEC, max_video_tokens=100)  # the checkpoint's own budget counts too
    assert frame_pixel_limits(small, 8, 24576) == (3136, total * 2 // 8)
    frames = [np.zeros((480, 640, 3), dtype=np.uint8)] * 8
    resized = resize_frames(frames, SPEC.frames, *frame_pixel_limits(SPEC, 8, 100))
    assert resized.shape[1] * resized.shape[2] <= total * 2 // 8
    assert resized.shape[1] % 28 == 0 and resized.shape[2] % 28 == 0


def test_frames_of_different_sizes_are_refused() -> None:
    frames = [np.zeros((64, 96, 3), np.uint8), np.zeros((64, 98, 3), np.uint8)]
    with pytest.raises(MediaError, match="change size"):
        resize_frames(frames, SPEC.frames, 3136, 100352)


# --------------------------------------------------------------------------- patch layout


def reference_patchify(frames_chw: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """transformers 5.x ``Qwen2VLVideoProcessor.patchify`` (video_processing_qwen2_vl.py, lines 283-311),
    transcribed from torch to numpy for one video: ``(num_frames, C, H, W)`` channels-first, padded with
    the last frame to a multiple of temporal_patch_size (lines 286-289)."""
    batch = frames_chw[None]
    _, num_frames, channel, height, width = batch.shape
    if pad := -num_frames % temporal:
        batch = np.concatenate([batch, np.repeat(batch[:, -1:], pad, axis=1)], axis=1)
        num_frames += pad
    grid_t, grid_h, grid_w = num_frames // temporal, height // patch, width // patch
    patches = batch.reshape(1, grid_t, temporal, channel, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    patches = patches.transpose(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return patches.reshape(grid_t * grid_h * grid_w, channel * temporal * patch * patch)


@pytest.mark.parametrize("count", [4, 6, 3])
def test_patch_layout_matches_transformers(count: int) -> None:
    # Raw values (no rescale or normalise) make every element identifiable, so equality checks the order.
    spec = ImageProcessorSpec(do_rescale=False, do_normalize=False)
    rng = np.random.default_rng(count)
    frames = rng.integers(0, 256, (count, 56, 84, 3), dtype=np.uint8)
    values, grid = patchify_video(frames, spec)
    expected = reference_patchify(frames.transpose(0, 3, 1, 2).astype(np.float32), 14, 2, 2)
    assert grid == ((count + 1) // 2, 4, 6)
    assert values.dtype == np.float32 and values.shape == expected.shape
    np.testing.assert_array_equal(values, expected)


def test_normalisation_is_clip_mean_std() -> None:
    # transformers' rescale_and_normalize: (x * rescale_factor - mean) / std per channel.
    frames = np.random.default_rng(0).integers(0, 256, (2, 28, 28, 3), dtype=np.uint8)
    values, _ = patchify_video(frames, SPEC.frames)
    mean, std = np.array(SPEC.frames.image_mean), np.array(SPEC.frames.image_std)
    normalised = ((frames / 255.0 - mean) / std).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(values, reference_patchify(normalised, 14, 2, 2), atol=1e-5)


# --------------------------------------------------------------------------- decoding and the whole path


def test_decode_samples_qwen_frames() -> None:
    video = decode_video(clip(), 2.0, SPEC, 768, RULES.max_image_pixels)
    assert (video.total_frames, video.video_fps, len(video.frames)) == (16, 8.0, 4)
    assert video.frames[0].shape == (64, 96, 3)
    capped = decode_video(clip(), 8.0, SPEC, 6, RULES.max_image_pixels)  # the fetcher's frame limit
    assert len(capped.frames) == 6


def test_load_video_grid_tokens_and_hash() -> None:
    url = data_url(clip())
    two = load_video(MediaInput("video", url, fps=2), SPEC, RULES, "m")
    four = load_video(MediaInput("video", url, fps=4), SPEC, RULES, "m")
    again = load_video(MediaInput("video", url), SPEC, RULES, "m")  # fps defaults to 2
    assert (two.kind, two.grid_thw, two.num_tokens) == ("video", (2, 4, 6), 12)
    assert (four.grid_thw, four.num_tokens) == ((4, 4, 6), 24)
    assert two.pixel_values.shape == (2 * 4 * 6, 3 * 2 * 14 * 14)
    assert again.content_hash == two.content_hash != four.content_hash
    smaller = load_video(MediaInput("video", url, fps=2, max_pixels=28 * 28 * 5), SPEC, RULES, "m")
    assert smaller.grid_thw == (2, 2, 4) and smaller.content_hash != two.content_hash


def test_load_video_sends_the_seconds_one_grid_step_spans() -> None:
    """Qwen2.5-VL's second_per_grid_ts: the temporal patch size over the sampled frames' rate (a 2-second clip
    of 16 frames: 4 frames sampled at fps 2, 8 at fps 4)."""
    url = data_url(clip())
    assert load_video(MediaInput("video", url, fps=2), SPEC, RULES, "m").second_per_grid_t == pytest.approx(1.0)
    assert load_video(MediaInput("video", url, fps=4), SPEC, RULES, "m").second_per_grid_t == pytest.approx(0.5)


def test_hash_covers_frames_and_fps() -> None:
    frames = np.zeros((2, 28, 28, 3), np.uint8)
    base = video_hash("m", SPEC, 2.0, frames)
    assert video_hash("m", SPEC, 4.0, frames) != base
    assert video_hash("m", SPEC, 2.0, frames + 1) != base


def test_preprocess_matches_parts() -> None:
    video = decode_video(clip(), 4.0, SPEC, 768, RULES.max_image_pixels)
    values, grid, resized = preprocess_video(video, SPEC, 24576)
    assert grid == (4, 4, 6) and resized.shape == (8, 56, 84, 3)
    np.testing.assert_array_equal(values, patchify_video(resized, SPEC.frames)[0])


@pytest.mark.parametrize(
    "data",
    [b"plain text, not a video at all" * 20, jpeg_bytes(video_frames(32, 32, 1, seed=0)[0]), b""],
    ids=["text", "jpeg", "empty"],
)
def test_non_video_bytes_are_400(data: bytes) -> None:
    with pytest.raises(MediaError) as caught:
        decode_video(data, 2.0, SPEC, 768, RULES.max_image_pixels)
    assert caught.value.status == 400


@pytest.mark.parametrize("fraction", [0.5, 0.05])
def test_truncated_video_is_400(fraction: float) -> None:
    data = clip()
    with pytest.raises(MediaError) as caught:
        decode_video(data[: int(len(data) * fraction)], 2.0, SPEC, 768, RULES.max_image_pixels)
    assert caught.value.status == 400


def test_frames_the_decoder_misreads_are_400_that_say_re_encode() -> None:
    # decord reads 8-px-wide MJPEG frames with the wrong row size; the file itself is complete.
    with pytest.raises(MediaError, match="re-encode") as caught:
        decode_video(clip(width=8, height=8), 2.0, SPEC, 768, RULES.max_image_pixels)
    assert caught.value.status == 400


def test_oversized_frames_are_413() -> None:
    with pytest.raises(MediaError) as caught:
        decode_video(clip(), 2.0, SPEC, 768, max_frame_pixels=96 * 64 - 1)
    assert caught.value.status == 413


@pytest.mark.parametrize("fps", [0, -1, 1000, float("nan")])
def test_bad_fps_is_400(fps: float) -> None:
    with pytest.raises(MediaError) as caught:
        load_video(MediaInput("video", data_url(clip()), fps=fps), SPEC, RULES, "m")
    assert caught.value.status == 400


def test_spec_from_checkpoint_prefers_video_config(tmp_path: object) -> None:
    from pathlib import Path

    root = Path(str(tmp_path))
    (root / "preprocessor_config.json").write_text('{"min_pixels": 3136, "max_pixels": 401408}')
    assert VideoProcessorSpec.from_dir(root).frames.max_pixels == 401408  # falls back to the image limits
    (root / "video_preprocessor_config.json").write_text(
        '{"size": {"shortest_edge": 3136, "longest_edge": 100352}, "min_frames": 2, "max_video_tokens": 5000}'
    )
    spec = VideoProcessorSpec.from_dir(root)
    assert (spec.frames.max_pixels, spec.min_frames, spec.max_video_tokens) == (100352, 2, 5000)


# --------------------------------------------------------------------------- gateway: schema and prompt


@pytest.fixture(scope="module")
def prompts() -> PromptBuilder:
    return PromptBuilder(demo_checkpoint())


def test_prompt_renders_videos_and_images_in_order(prompts: PromptBuilder) -> None:
    request = parse_chat_request(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "video_url", "video_url": {"url": "data:a", "fps": 4, "max_pixels": 5000}},
                        {"type": "image_url", "image_url": {"url": "data:b"}},
                        {"type": "video_url", "video_url": {"url": "data:c"}},
                        {"type": "text", "text": "?"},
                    ],
                }
            ]
        }
    )
    prompt = prompts.build(request.messages)
    assert prompt.media == [
        MediaInput("video", "data:a", None, 5000, 4.0),
        MediaInput("image", "data:b"),
        MediaInput("video", "data:c"),
    ]
    tokens = prompts.tokenizer.convert_tokens_to_ids(["<|video_pad|>", "<|image_pad|>"])
    pads = [t for t in prompt.token_ids if t in tokens]
    assert pads == [tokens[0], tokens[1], tokens[0]]  # one placeholder each, expanded by the decoder


@pytest.mark.parametrize("video", [{"url": "u", "fps": 0}, {"url": "u", "fps": 61}, {"url": "u", "min_pixels": 0}, {}])
def test_bad_video_parts_are_400(video: dict[str, object]) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": video}]}]}
    with pytest.raises(ApiError) as caught:
        parse_chat_request(body)
    assert caught.value.status == 400


def test_videos_only_in_user_messages(prompts: PromptBuilder) -> None:
    part = {"type": "video_url", "video_url": {"url": "u"}}
    request = parse_chat_request({"messages": [{"role": "assistant", "content": [part]}]})
    with pytest.raises(ApiError, match="videos are only allowed in user messages"):
        prompts.build(request.messages)
