"""transformers' Qwen3-VL video processing without torchvision (tests only): the pieces of ``Qwen3VLVideoProcessor``
and ``Qwen3VLProcessor`` that run without it, called as transformers calls them, and where they call torchvision:

- ``resize``: transformers' own ``Qwen3VLVideoProcessor.resize`` runs (its per-frame cap and ``smart_resize``) and
  the size it asks torchvision for is captured; the frames are then resized to that size with PIL bicubic
  (`workers.fetcher.video.resize_frames_to`), where torchvision would resize bicubic with antialiasing;
- ``normalize``: torchvision's ``normalize`` is ``tensor.sub_(mean).div_(std)`` on float32, done here in torch;
  transformers' ``_preprocess`` (its fused rescale, ``patchify``, grids) runs on the resized frames;
- ``replace_video_token``: transformers' method, called on a stand-in for the processor (its constructor wants a
  video processor that can run, i.e. torchvision) holding the attributes the method reads.

Frames are read with decord (as transformers' decord backend does) at the indices transformers'
``sample_frames`` picks.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from transformers.image_utils import SizeDict
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_processing_utils import BaseVideoProcessor
from transformers.video_utils import VideoMetadata

from workers.fetcher.video import decode_sampled, resize_frames_to


def resized_size(processor: Qwen3VLVideoProcessor, frames: int, height: int, width: int) -> tuple[int, int]:
    """The (h, w) transformers' ``resize`` asks torchvision for, captured."""
    asked: list[SizeDict] = []

    def capture(self: Any, image: torch.Tensor, size: SizeDict, **kwargs: Any) -> torch.Tensor:
        asked.append(size)
        return image

    original = BaseVideoProcessor.resize
    BaseVideoProcessor.resize = capture  # type: ignore[method-assign]
    try:
        processor.resize(
            torch.zeros(1, frames, 3, height, width),
            size=processor.size,
            resample=None,
            factor=processor.patch_size * processor.merge_size,
            temporal_factor=processor.temporal_patch_size,
            cap_pixels_per_frame=processor.cap_pixels_per_frame,
        )
    finally:
        BaseVideoProcessor.resize = original  # type: ignore[method-assign]
    return int(asked[0].height), int(asked[0].width)


def _torchvision_normalize(image: torch.Tensor, mean: Any, std: Any, inplace: bool = False) -> torch.Tensor:
    mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    return image.sub(mean).div(std)


def pixels(processor: Qwen3VLVideoProcessor, resized: np.ndarray) -> tuple[torch.Tensor, list[int]]:
    """transformers' ``_preprocess`` on frames (N, h, w, 3) uint8 already resized: (pixel_values_videos, grid)."""
    video = torch.from_numpy(resized).permute(0, 3, 1, 2).contiguous()
    original = processor.normalize
    processor.normalize = _torchvision_normalize  # type: ignore[method-assign]
    try:
        out = processor._preprocess(
            videos=[video],
            do_resize=False,
            size=processor.size,
            resample=None,
            do_rescale=processor.do_rescale,
            rescale_factor=processor.rescale_factor,
            do_normalize=processor.do_normalize,
            image_mean=processor.image_mean,
            image_std=processor.image_std,
            patch_size=processor.patch_size,
            temporal_patch_size=processor.temporal_patch_size,
            merge_size=processor.merge_size,
            cap_pixels_per_frame=processor.cap_pixels_per_frame,
            return_tensors="pt",
        )
    finally:
        processor.normalize = original  # type: ignore[method-assign]
    return out["pixel_values_videos"], out["video_grid_thw"][0].tolist()


def replacement(processor: Qwen3VLVideoProcessor, grid: list[int], metadata: VideoMetadata) -> str:
    """``Qwen3VLProcessor.replace_video_token`` for one video: its text in place of ``<|video_pad|>``."""
    stand_in = SimpleNamespace(
        video_processor=processor,
        video_token="<|video_pad|>",
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
    )
    stand_in._calculate_timestamps = lambda *a: Qwen3VLProcessor._calculate_timestamps(stand_in, *a)  # type: ignore[arg-type]
    inputs = {"video_grid_thw": torch.tensor([grid]), "video_metadata": [metadata]}
    return Qwen3VLProcessor.replace_video_token(stand_in, inputs, 0)  # type: ignore[arg-type]


def video_inputs(
    processor: Qwen3VLVideoProcessor, data: bytes, fps: float, max_frame_pixels: int
) -> tuple[torch.Tensor, list[int], str]:
    """A video file's (pixel_values_videos, video_grid_thw, the text for its ``<|video_pad|>``) as transformers'
    processor makes them at ``fps``, with the two torchvision steps as the module docstring says."""
    found: list[VideoMetadata] = []

    def sample(total: int, video_fps: float) -> list[int]:
        metadata = VideoMetadata(total_num_frames=total, fps=video_fps)
        metadata.frames_indices = processor.sample_frames(metadata, fps=fps)
        found.append(metadata)
        return [int(i) for i in metadata.frames_indices]

    video = decode_sampled(data, sample, max_frame_pixels)
    height, width = video.frames[0].shape[:2]
    size = resized_size(processor, len(video.frames), height, width)
    values, grid = pixels(processor, resize_frames_to(video.frames, *size, int(processor.resample)))
    return values, grid, replacement(processor, grid, found[0])
