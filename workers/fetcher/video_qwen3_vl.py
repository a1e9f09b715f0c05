"""Qwen3-VL's video processing: transformers' ``Qwen3VLVideoProcessor`` and the frame timestamps of
``Qwen3VLProcessor``, transcribed (transformers 5.24, ``models/qwen3_vl/``; the lines cited are of that version).

Unlike Qwen2-VL's path (`workers.fetcher.video`, which follows qwen-vl-utils), this follows transformers exactly:

- frames: ``sample_frames`` (video_processing_qwen3_vl.py 146-184): ``int(total / video_fps * fps)`` frames,
  clamped to [min_frames, max_frames] and to the frames there are, at ``linspace(0, total - 1, n).round()``;
  any count, an odd one padded with the last frame by ``patchify`` (250-255);
- size: the module's ``smart_resize`` (84-111), whose pixel limits (``size``'s shortest / longest edge) bound the
  whole video (``t_bar * h * w``), with ``resize``'s per-frame cap where ``cap_pixels_per_frame`` (199-204);
- pixels: resized frames, then ``rescale_and_normalize`` fused as transformers' torch backend does
  (image_processing_backends.py 329-369: ``(x - mean / rescale) / (std / rescale)`` in float32), then the patch
  layout of ``patchify`` (239-276), which is Qwen2-VL's;
- timestamps: ``Qwen3VLProcessor._calculate_timestamps`` (processing_qwen3_vl.py 194-205) over the sampled
  frames' indices and the source's fps, written ``<{t:.1f} seconds>`` before each temporal step's tokens
  (``replace_video_token``, 79-104).

The resize itself is torchvision's (bicubic, antialiased) in transformers, which is not installable here: frames
are resized with PIL bicubic as the image path does, so pixel values can differ from transformers' by rounding.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.config import FetcherConfig
from common.model_files import read_json_object
from workers.fetcher.errors import MediaError
from workers.fetcher.image import ImageProcessorSpec, _per_channel
from workers.fetcher.video import DecodedVideo, FrameSampler, patch_rows, resize_frames_to

# Qwen3VLVideoProcessor's class defaults (video_processing_qwen3_vl.py 115-137).
DEFAULT_SIZE = {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}
_FRAME_FIELDS = ("fps", "min_frames", "max_frames", "max_video_tokens")
# smart_resize refuses a long side over 200 times the short one (video_processing_qwen3_vl.py 94-97).
_MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class Qwen3VideoSpec:
    """The checkpoint's ``video_preprocessor_config.json`` as ``Qwen3VLVideoProcessor`` reads it. ``frames``' min and
    max pixels are ``size``'s shortest and longest edge: limits on a whole video's pixels, not a frame's."""

    frames: ImageProcessorSpec
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False  # transformers' default (None) means False, with a warning
    max_video_tokens: int = 768  # tokens per frame at most, where cap_pixels_per_frame
    source: str = "video_preprocessor_config.json"

    @classmethod
    def from_dir(cls, checkpoint_dir: str | os.PathLike[str]) -> Qwen3VideoSpec:
        path = Path(checkpoint_dir) / "video_preprocessor_config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a Qwen3-VL checkpoint needs its video processor config")
        return cls.from_dict(read_json_object(path, "the video processor's configuration"))

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Qwen3VideoSpec:
        frames = ImageProcessorSpec.from_dict({"size": DEFAULT_SIZE, **config})
        values: dict[str, Any] = {name: config[name] for name in _FRAME_FIELDS if config.get(name) is not None}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"video processor {name} must be a positive number, got {value!r}")
            if name != "fps" and not isinstance(value, int):
                raise ValueError(f"video processor {name} must be an integer, got {value!r}")
        if "fps" in values:
            values["fps"] = float(values["fps"])
        cap = config.get("cap_pixels_per_frame")
        if cap is not None and not isinstance(cap, bool):
            raise ValueError(f"video processor cap_pixels_per_frame must be true or false, got {cap!r}")
        return cls(frames, cap_pixels_per_frame=bool(cap), **values)

    def with_client_limits(self, min_pixels: int | None, max_pixels: int | None) -> Qwen3VideoSpec:
        """A request's own ``size`` edges (whole-video pixels), within the configured longest edge."""
        if min_pixels is None and max_pixels is None:
            return self
        return dataclasses.replace(self, frames=self.frames.with_pixel_limits(min_pixels, max_pixels))


def sample_indices(total_frames: int, video_fps: float, fps: float, min_frames: int, max_frames: int) -> list[int]:
    """``Qwen3VLVideoProcessor.sample_frames`` (video_processing_qwen3_vl.py 170-182) with ``fps`` given."""
    count = int(total_frames / video_fps * fps)
    count = min(max(count, min_frames), max_frames, total_frames)
    return [int(i) for i in np.linspace(0, total_frames - 1, count).round().astype(int)]


def smart_resize(
    num_frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """video_processing_qwen3_vl.py ``smart_resize`` (84-111): the limits bound ``t_bar * h * w``."""
    if num_frames < temporal_factor:
        raise MediaError(
            400, f"video gave {num_frames} frame(s); at least {temporal_factor} are needed: send a longer video"
        )
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > _MAX_ASPECT_RATIO:
        raise MediaError(400, f"video frames are {width}x{height}; the aspect ratio must be below 200:1")
    h_bar = round(height / factor) * factor  # Python's round-half-to-even, as transformers'
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_max_pixels(spec: Qwen3VideoSpec, num_frames: int, max_video_tokens: int) -> int:
    """``resize``'s max_pixels (video_processing_qwen3_vl.py 196-204): ``size``'s longest edge, or with
    ``cap_pixels_per_frame`` a per-frame share of it; then lowered to the server's token limit for one video
    ([fetcher] max_video_tokens, which does not bind at transformers' defaults for short videos)."""
    factor = spec.frames.factor
    max_pixels = spec.frames.max_pixels
    if spec.cap_pixels_per_frame:
        frame_cap = spec.max_video_tokens * factor * factor
        per_frame = max(min(frame_cap, spec.frames.max_pixels // num_frames), int(spec.frames.min_pixels * 1.05))
        max_pixels = per_frame * num_frames
    return min(max_pixels, max_video_tokens * spec.frames.temporal_patch_size * factor * factor)


def normalize_frames(frames: np.ndarray, spec: ImageProcessorSpec) -> np.ndarray:
    """transformers' fused ``rescale_and_normalize`` (image_processing_backends.py 329-369): mean and std over the
    rescale factor in float32, then ``(x - mean) / std`` on float32 pixels. (N, h, w, C) uint8 -> float32."""
    values = frames.astype(np.float32)
    channels = values.shape[-1]
    mean = np.array(_per_channel(spec.image_mean, channels), dtype=np.float32)
    std = np.array(_per_channel(spec.image_std, channels), dtype=np.float32)
    if spec.do_rescale and spec.do_normalize:
        scale = np.float32(1.0 / spec.rescale_factor)
        return (values - mean * scale) / (std * scale)
    if spec.do_normalize:
        return (values - mean) / std
    if spec.do_rescale:
        return values * np.float32(spec.rescale_factor)
    return values


def preprocess(
    video: DecodedVideo, spec: Qwen3VideoSpec, max_video_tokens: int
) -> tuple[np.ndarray, tuple[int, int, int], np.ndarray]:
    """(pixel_values, grid_thw, resized uint8 frames) of sampled frames, as ``Qwen3VLVideoProcessor._preprocess``."""
    frames = spec.frames
    height, width = video.frames[0].shape[:2]
    max_pixels = video_max_pixels(spec, len(video.frames), max_video_tokens)
    new_h, new_w = smart_resize(
        len(video.frames), height, width, frames.temporal_patch_size, frames.factor, frames.min_pixels, max_pixels
    )
    resized = resize_frames_to(video.frames, new_h, new_w, frames.resample)
    pixel_values, grid = patch_rows(normalize_frames(resized, frames), frames)
    return pixel_values, grid, resized


def frame_timestamps(indices: list[int], video_fps: float, temporal_patch_size: int) -> list[float]:
    """``Qwen3VLProcessor._calculate_timestamps`` (processing_qwen3_vl.py 194-205): each temporal step's time, the
    mean of its first and last frame's (the indices padded with the last, as the frames are)."""
    padded = list(indices)
    if len(padded) % temporal_patch_size:
        padded.extend(padded[-1] for _ in range(temporal_patch_size - len(padded) % temporal_patch_size))
    seconds = [index / video_fps for index in padded]
    return [
        (seconds[i] + seconds[i + temporal_patch_size - 1]) / 2 for i in range(0, len(seconds), temporal_patch_size)
    ]


def timestamp_text(seconds: float) -> str:
    """The text before a temporal step's tokens (processing_qwen3_vl.py 101)."""
    return f"<{seconds:.1f} seconds>"


def frame_texts(video: DecodedVideo, spec: Qwen3VideoSpec) -> list[str]:
    return [
        timestamp_text(t) for t in frame_timestamps(video.indices, video.video_fps, spec.frames.temporal_patch_size)
    ]


def frame_sampler(spec: Qwen3VideoSpec, fps: float, rules: FetcherConfig) -> FrameSampler:
    """The sampler `decode_sampled` calls: transformers' rule at the request's fps, within the server's frame cap."""
    max_frames = min(spec.max_frames, rules.max_video_frames)
    return lambda total, video_fps: sample_indices(total, video_fps, fps, spec.min_frames, max_frames)
