"""The fetcher's video preprocessing against transformers' own video processors (`AutoVideoProcessor`), for each
family's tiny synthetic checkpoint: frame count, pixel values and ``video_grid_thw`` of the same decoded frames.

transformers' video processors need torchvision, which only the GPU box's image has (CPU wheels are not reachable
here), so this is GPU-marked and runs there (issue 27, acceptance 1). The clips are the fetcher's own MJPEG AVIs,
decoded once with decord, as the fetcher decodes them: at two fps, three sizes that resize (up, down, a long thin
one) and one that does not.

- Frame sampling. Qwen2-VL and Qwen2.5-VL: the fetcher follows qwen-vl-utils (`smart_nframes`, indices by
  ``linspace``), which those models were trained with; ``Qwen2VLVideoProcessor.sample_frames`` takes as many
  frames but at ``arange(0, total, total / n)`` (see workers/fetcher/video.py). So the count is compared with
  transformers', the indices with qwen-vl-utils' rule, and the pixels with transformers fed the fetcher's frames
  (``do_sample_frames=False``). Qwen3-VL: ``Qwen3VLVideoProcessor.sample_frames`` is qwen-vl-utils' ``linspace``
  itself, so transformers samples from every decoded frame and everything must agree.
- Pixel values. The fetcher resizes with PIL bicubic, transformers with torchvision's antialiased bicubic: equal
  up to rounding, so they are compared in 8-bit levels (the normalisation undone): at most MAX_LEVELS apart
  anywhere and MEAN_LEVELS on average. A wrong size, frame, order, mean or std is tens of levels off.
"""

from __future__ import annotations

import importlib.util
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks.media import data_url, jpeg_bytes, mjpeg_avi, video_frames
from common.config import FetcherConfig
from common.protocol import MediaInput
from workers.fetcher.media import load_timed_video, load_video
from workers.fetcher.video import VideoProcessorSpec, decode_video, frame_indices
from workers.fetcher.video_qwen3_vl import Qwen3VideoSpec
from workers.models.synth import generate_checkpoint


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "runs on the GPU box, whose image has torchvision beside torch"
    if importlib.util.find_spec("torchvision") is None:
        return "needs torchvision: transformers' video processors are written with it"
    if importlib.util.find_spec("decord") is None:
        return "needs decord, the fetcher's video decoder (carried in .whl)"
    return None


_SKIP_REASON = _skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")]

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
# transformers samples frames itself: its rule is the fetcher's (qwen-vl-utils' linspace)
SAMPLES_LIKE_US = {"qwen3_vl"}
MAX_LEVELS = 3.0
MEAN_LEVELS = 0.5


@dataclass(frozen=True)
class Clip:
    width: int
    height: int
    frames: int
    clip_fps: int
    fps: float  # what the request asks for


CLIPS = {
    "fps2": Clip(160, 112, 16, 8, 2.0),
    "fps4": Clip(160, 112, 16, 8, 4.0),  # twice the frames of the same clip
    "large": Clip(480, 360, 24, 12, 2.0),  # above the tiny checkpoints' pixel cap: resized down
    "long-thin": Clip(600, 76, 16, 8, 2.0),  # aspect ratio 8
    "no-resize": Clip(448, 224, 16, 8, 2.0),  # a multiple of 28 and 32 (within the limits for Qwen2-VL's)
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def checkpoint(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_checkpoint(tmp_path_factory.mktemp(family) / "tiny", "tiny", 0, family=family)


@pytest.fixture(scope="module")
def processor(checkpoint: Path) -> Any:
    from transformers import AutoVideoProcessor

    return AutoVideoProcessor.from_pretrained(str(checkpoint))


def clip_bytes(clip: Clip) -> bytes:
    frames = video_frames(clip.width, clip.height, clip.frames, seed=11)
    return mjpeg_avi([jpeg_bytes(f) for f in frames], clip.width, clip.height, clip.clip_fps)


def every_frame(data: bytes) -> np.ndarray:
    """All frames of the clip as decord decodes them: (N, H, W, 3) uint8."""
    import decord

    with tempfile.NamedTemporaryFile(suffix=".avi") as handle:
        handle.write(data)
        handle.flush()
        reader = decord.VideoReader(handle.name)
        return np.asarray(reader.get_batch(list(range(len(reader)))).asnumpy())


def transformers_output(
    processor: Any, frames: np.ndarray, as_configured: bool = False, **kwargs: Any
) -> tuple[torch.Tensor, list[int]]:
    """(pixel_values_videos, video_grid_thw of the one video) from transformers' video processor; ``as_configured``:
    with the checkpoint's own settings only (Qwen3-VL's processor reads its pixel cap from its file, as we do)."""
    if (
        hasattr(processor, "cap_pixels_per_frame") and not as_configured
    ):  # (releases before the option always used the per-frame cap)
        kwargs["cap_pixels_per_frame"] = True  # as the checkpoint's file says: qwen-vl-utils' total-video budget
    out = processor(videos=[frames], return_tensors="pt", **kwargs)
    return out["pixel_values_videos"].float(), [int(v) for v in out["video_grid_thw"][0]]


def metadata(clip: Clip, total: int) -> Any:
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(total_num_frames=total, fps=float(clip.clip_fps), frames_indices=list(range(total)))


def level_gaps(ours: np.ndarray, theirs: torch.Tensor, spec: VideoProcessorSpec | Qwen3VideoSpec) -> torch.Tensor:
    """|ours - theirs| in 8-bit levels, per value (rows are (channel, frame in temporal patch, patch row, col))."""
    frames = spec.frames
    gap = (torch.from_numpy(np.asarray(ours, dtype=np.float32)) - theirs).abs().reshape(len(ours), 3, -1)
    std = torch.tensor(frames.image_std, dtype=torch.float32)[None, :, None]
    return gap * std / frames.rescale_factor


@pytest.mark.parametrize("name", list(CLIPS))
def test_fetcher_video_equals_transformers_video_processor(
    family: str, checkpoint: Path, processor: Any, name: str
) -> None:
    clip = CLIPS[name]
    data = clip_bytes(clip)
    rules = FetcherConfig()
    item = MediaInput("video", data_url(data, "video/x-msvideo"), fps=clip.fps)
    if family in SAMPLES_LIKE_US:  # Qwen3-VL: its own video path (transformers' rule, timestamps in the prompt)
        timed = Qwen3VideoSpec.from_dir(checkpoint)
        loaded, spec = load_timed_video(item, timed, rules, "key"), timed
    else:
        spec = VideoProcessorSpec.from_dir(checkpoint)
        loaded = load_video(item, spec, rules, "key")
    assert loaded.pixel_values is not None and loaded.normalization is None  # (float pixel values for videos)
    decoded = every_frame(data)
    assert len(decoded) == clip.frames
    if family in SAMPLES_LIKE_US:
        theirs, grid = transformers_output(
            processor,
            decoded,
            as_configured=True,
            do_sample_frames=True,
            fps=clip.fps,
            video_metadata=[metadata(clip, len(decoded))],
        )
    else:
        video = decode_video(data, clip.fps, spec, rules.max_video_frames, rules.max_image_pixels)
        wanted = frame_indices(len(decoded), len(video.frames))  # qwen-vl-utils' rule
        assert np.array_equal(np.stack(video.frames), decoded[wanted])
        _, sampled = transformers_output(
            processor, decoded, do_sample_frames=True, fps=clip.fps, video_metadata=[metadata(clip, len(decoded))]
        )
        assert sampled[0] * spec.frames.temporal_patch_size == len(video.frames)  # as many frames as transformers
        theirs, grid = transformers_output(processor, np.stack(video.frames), do_sample_frames=False)
    assert list(loaded.grid_thw) == grid
    assert loaded.pixel_values.shape == tuple(theirs.shape)
    gaps = level_gaps(loaded.pixel_values, theirs, spec)
    print(f"{family} {name}: grid {grid}, level gap max {gaps.max():.2f}, mean {gaps.mean():.3f}")
    assert float(gaps.max()) <= MAX_LEVELS and float(gaps.mean()) <= MEAN_LEVELS
