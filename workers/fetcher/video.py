"""Video decoding and Qwen2-VL video preprocessing: frame sampling, resize, normalise, patchify.

Frame sampling follows Qwen's qwen-vl-utils (``smart_nframes``, indices by ``linspace``), which is
what Qwen2-VL was trained with; transformers' ``Qwen2VLVideoProcessor.sample_frames`` picks slightly
different frames (``arange`` with a float step). The per-frame pixel budget is qwen-vl-utils' (and
transformers' ``cap_pixels_per_frame=True``): an even share of a whole-video token budget.

Frames are resized with PIL bicubic, as the image path does; qwen-vl-utils and transformers resize
videos with torchvision (bicubic, antialiased), which is not available here, so pixel values can
differ from theirs by rounding. The patch layout is exactly ``Qwen2VLVideoProcessor.patchify``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from PIL import Image

from common.model_files import read_json_object
from workers.fetcher.errors import MediaError
from workers.fetcher.image import ImageProcessorSpec, _rescale_and_normalize, smart_resize

DEFAULT_FPS = 2.0  # qwen-vl-utils FPS
FPS_MIN_FRAMES = 4
FPS_MAX_FRAMES = 768
# qwen-vl-utils: VIDEO_TOTAL_PIXELS = 128000 * 28 * 28 * 0.9, i.e. 90% of a token budget.
_BUDGET_SHARE = 0.9
# qwen-vl-utils floors the per-frame budget at 1.05 x min_pixels so smart_resize can still round.
_MIN_PIXELS_SLACK = 1.05
_MAX_FPS = 60.0
# Frames are decoded in groups this large, so the undecoded source never sits in memory whole.
_DECODE_BATCH = 16


@dataclass(frozen=True)
class VideoProcessorSpec:
    """The checkpoint's video settings: per-frame processing plus the frame-count rules."""

    frames: ImageProcessorSpec
    min_frames: int = FPS_MIN_FRAMES
    max_frames: int = FPS_MAX_FRAMES
    max_video_tokens: int = 128000  # transformers' Qwen2VLVideoProcessor default
    source: str = "video_preprocessor_config.json"

    @property
    def frame_factor(self) -> int:
        return self.frames.temporal_patch_size

    @classmethod
    def from_dir(cls, checkpoint_dir: str | os.PathLike[str]) -> VideoProcessorSpec:
        """``video_preprocessor_config.json`` when the checkpoint has one (its ``size`` / min/max pixels
        are the video limits), else the image processor's settings with Qwen's frame defaults."""
        root = Path(checkpoint_dir)
        path = root / "video_preprocessor_config.json"
        if not path.is_file():
            return cls(ImageProcessorSpec.from_dir(root), source="preprocessor_config.json")
        return cls.from_dict(read_json_object(path, "the video processor's configuration"))

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> VideoProcessorSpec:
        values = {name: config[name] for name in ("min_frames", "max_frames", "max_video_tokens") if config.get(name)}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"video processor {name} must be a positive integer, got {value!r}")
        return cls(ImageProcessorSpec.from_dict(config), **values)


@dataclass
class DecodedVideo:
    frames: list[np.ndarray]  # sampled frames, (H, W, 3) uint8 each, all one size
    total_frames: int
    video_fps: float
    indices: list[int] = field(default_factory=list)  # the sampled frames' indices in the source


# (total frames, the source's fps) -> the indices of the frames to sample
FrameSampler = Callable[[int, float], list[int]]


def second_per_grid(video: DecodedVideo, spec: VideoProcessorSpec) -> float:
    """Seconds one temporal grid step spans: the temporal patch size over the sampled frames' rate (qwen-vl-utils'
    ``video_sample_fps``: frames sampled over the video's duration), as Qwen2.5-VL's processor computes
    ``second_per_grid_ts``."""
    sampled_fps = len(video.frames) / max(video.total_frames, 1e-6) * video.video_fps
    return spec.frames.temporal_patch_size / sampled_fps


# --------------------------------------------------------------------------- frame sampling


def smart_nframes(
    total_frames: int, video_fps: float, fps: float, min_frames: int, max_frames: int, factor: int
) -> int:
    """qwen-vl-utils ``smart_nframes``: frames for ``fps`` per second, clamped, a multiple of ``factor``."""
    low = math.ceil(min_frames / factor) * factor
    high = math.floor(min(max_frames, total_frames) / factor) * factor
    wanted = total_frames / video_fps * fps
    nframes = math.floor(min(max(wanted, low), high, total_frames) / factor) * factor
    if nframes < factor:
        raise MediaError(400, f"video has {total_frames} frame(s); at least {factor} are needed: send a longer video")
    return nframes


def frame_indices(total_frames: int, nframes: int) -> list[int]:
    """qwen-vl-utils: ``torch.linspace(0, total - 1, nframes).round().long()``; numpy rounds halves
    to even like torch."""
    return [int(i) for i in np.linspace(0, total_frames - 1, nframes).round()]


# --------------------------------------------------------------------------- decoding


def decode_video(
    data: bytes, fps: float, spec: VideoProcessorSpec, max_frames: int, max_frame_pixels: int
) -> DecodedVideo:
    """Sampled frames of a video file's bytes (qwen-vl-utils' frame rule); anything undecodable is a 400."""

    def qwen_vl_utils_frames(total: int, video_fps: float) -> list[int]:
        nframes = smart_nframes(
            total, video_fps, fps, spec.min_frames, min(spec.max_frames, max_frames), spec.frame_factor
        )
        return frame_indices(total, nframes)

    return decode_sampled(data, qwen_vl_utils_frames, max_frame_pixels)


def decode_sampled(data: bytes, sample: FrameSampler, max_frame_pixels: int) -> DecodedVideo:
    """The frames ``sample`` picks from a video file's bytes; anything undecodable is a 400."""
    import decord  # only the fetcher needs it, and it is slow to import

    with _temp_file(data) as path:  # decord segfaults on some truncated in-memory streams; files fail cleanly
        try:
            reader = decord.VideoReader(path, ctx=decord.cpu(0), num_threads=1)
        except (RuntimeError, decord.DECORDError) as exc:
            raise MediaError(
                400, f"media is not a decodable video ({_first_line(exc)}): send an MP4, WebM or AVI file"
            ) from exc
        total, video_fps = len(reader), float(reader.get_avg_fps())
        if total < 1 or not math.isfinite(video_fps) or video_fps <= 0:
            raise MediaError(400, f"video reports {total} frames at {video_fps} fps: send a valid video file")
        indices = sample(total, video_fps)
        first = _read_frames(reader, [0])[0]
        height, width = first.shape[:2]
        if height * width > max_frame_pixels:
            raise MediaError(413, f"video frames are {width}x{height}, over the {max_frame_pixels} pixel limit")
        frames = [
            f
            for start in range(0, len(indices), _DECODE_BATCH)
            for f in _read_frames(reader, indices[start : start + _DECODE_BATCH])
        ]
    return DecodedVideo(frames, total, video_fps, indices)


@contextlib.contextmanager
def _temp_file(data: bytes) -> Iterator[str]:
    handle, path = tempfile.mkstemp(prefix="vlm-video-")
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(data)
        yield path
    finally:
        os.unlink(path)


def _read_frames(reader: Any, indices: list[int]) -> list[np.ndarray]:
    import decord

    try:
        batch = reader.get_batch(indices).asnumpy()
    except (RuntimeError, decord.DECORDError, IndexError) as exc:
        # Not always the data's fault: decord misreads MJPEG frames of some small widths (8, 16, 24, 48, 72 px).
        raise MediaError(
            400,
            f"the video's frames could not be decoded ({_first_line(exc)}): the file may be truncated or "
            "corrupt, or encoded in a way the decoder does not support; send the complete file, or re-encode "
            "it (as H.264 MP4, for example)",
        ) from exc
    if batch.ndim != 4 or batch.shape[3] != 3 or batch.dtype != np.uint8:
        raise MediaError(400, f"video decoded to unexpected frames of shape {batch.shape}: send an RGB video")
    return list(batch)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1][:200] if text else type(exc).__name__


# --------------------------------------------------------------------------- preprocessing


def frame_pixel_limits(spec: VideoProcessorSpec, nframes: int, max_video_tokens: int) -> tuple[int, int]:
    """(min, max) pixels per frame: the configured cap, lowered to an even share of the video budget
    (qwen-vl-utils' ``max(min(VIDEO_MAX_PIXELS, total_pixels / nframes * FRAME_FACTOR), 1.05 * min)``)."""
    factor = spec.frames.factor
    tokens = min(spec.max_video_tokens, max_video_tokens)
    total_pixels = int(tokens * factor * factor * _BUDGET_SHARE)
    share = total_pixels * spec.frame_factor // nframes
    max_pixels = max(min(spec.frames.max_pixels, share), int(spec.frames.min_pixels * _MIN_PIXELS_SLACK))
    return spec.frames.min_pixels, max_pixels


def resize_frames(frames: list[np.ndarray], spec: ImageProcessorSpec, min_pixels: int, max_pixels: int) -> np.ndarray:
    """Every frame to one smart-resized (h, w), PIL bicubic like the image path: (N, h, w, 3) uint8."""
    height, width = frames[0].shape[:2]
    return resize_frames_to(frames, *smart_resize(height, width, spec.factor, min_pixels, max_pixels), spec.resample)


def resize_frames_to(frames: list[np.ndarray], new_h: int, new_w: int, resample: int) -> np.ndarray:
    """Every frame (all of the first one's size) to (new_h, new_w) with PIL: (N, new_h, new_w, 3) uint8."""
    height, width = frames[0].shape[:2]
    out = np.empty((len(frames), new_h, new_w, 3), dtype=np.uint8)
    for k, frame in enumerate(frames):
        if frame.shape[:2] != (height, width):
            raise MediaError(400, "video frames change size mid-stream: re-encode the video at one resolution")
        out[k] = (
            frame
            if (new_h, new_w) == (height, width)
            else np.asarray(Image.fromarray(frame).resize((new_w, new_h), resample=resample))
        )
    return out


def patchify_video(frames: np.ndarray, spec: ImageProcessorSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``Qwen2VLVideoProcessor.patchify`` on normalised uint8 frames (N, h, w, C)."""
    values = np.empty(frames.shape, dtype=np.float32)
    for k, frame in enumerate(frames):  # per frame: the float64 temporaries stay one frame large
        values[k] = _rescale_and_normalize(frame, spec)
    return patch_rows(values, spec)


def patch_rows(values: np.ndarray, spec: ImageProcessorSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The processors' ``patchify`` of normalised float32 frames (N, h, w, C): rows (t, block row, block col, row
    in block, col in block), each (channel, frame in temporal patch, patch row, patch col)."""
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    count, height, width, channels = values.shape
    if count % tp:
        # transformers pads with copies of the last frame (qwen-vl-utils' frame counts are multiples already).
        values = np.concatenate([values, np.repeat(values[-1:], tp - count % tp, axis=0)])
        count = values.shape[0]
    grid = (count // tp, height // p, width // p)
    values = values.reshape(grid[0], tp, grid[1] // m, m, p, grid[2] // m, m, p, channels)
    # (t, tp, bh, mh, ph, bw, mw, pw, C) -> (t, bh, bw, mh, mw, C, tp, ph, pw)
    values = values.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    return np.ascontiguousarray(values).reshape(grid[0] * grid[1] * grid[2], channels * tp * p * p), grid


def preprocess_video(
    video: DecodedVideo, spec: VideoProcessorSpec, max_video_tokens: int
) -> tuple[np.ndarray, tuple[int, int, int], np.ndarray]:
    """(pixel_values, grid_thw, resized uint8 frames) for sampled frames."""
    min_pixels, max_pixels = frame_pixel_limits(spec, len(video.frames), max_video_tokens)
    resized = resize_frames(video.frames, spec.frames, min_pixels, max_pixels)
    pixel_values, grid = patchify_video(resized, spec.frames)
    return pixel_values, grid, resized


class FramesSpec(Protocol):
    """A video processor's settings: its per-frame processing under ``frames`` (`VideoProcessorSpec`, Qwen3-VL's)."""

    @property
    def frames(self) -> ImageProcessorSpec: ...


def video_hash(model_key: str, spec: FramesSpec, fps: float, resized: np.ndarray) -> str:
    """The resized frames and every parameter after them fix the ViT input: equal hashes, equal output."""
    digest = hashlib.sha256()
    digest.update(json.dumps(["video", model_key, fps, resized.shape, repr(spec.frames)], default=str).encode())
    digest.update(resized.tobytes())
    return digest.hexdigest()


def validated_fps(fps: float | None) -> float:
    if fps is None:
        return DEFAULT_FPS
    if isinstance(fps, bool) or not isinstance(fps, int | float) or not 0 < fps <= _MAX_FPS:
        raise MediaError(400, f"fps must be a number above 0 and at most {_MAX_FPS:g}, got {fps!r}")
    return float(fps)


def with_client_limits(spec: VideoProcessorSpec, min_pixels: int | None, max_pixels: int | None) -> VideoProcessorSpec:
    if min_pixels is None and max_pixels is None:
        return spec
    return dataclasses.replace(spec, frames=spec.frames.with_pixel_limits(min_pixels, max_pixels))
