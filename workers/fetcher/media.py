"""One media item from URL to patches: download, decode, hash, Qwen resize + patchify."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import numpy as np

from common.config import FetcherConfig
from common.protocol import MediaInput
from workers.fetcher.download import fetch_bytes
from workers.fetcher.errors import MediaError
from workers.fetcher.image import ImageProcessorSpec, decode_image, image_patches, normalization_of, num_image_tokens
from workers.fetcher.video import (
    VideoProcessorSpec,
    decode_video,
    preprocess_video,
    validated_fps,
    video_hash,
    with_client_limits,
)
from workers.models.pixels import Normalization


@dataclass
class LoadedImage:
    """A preprocessed image or video (the encoder treats both as patches with a grid)."""

    content_hash: str
    pixel_values: np.ndarray  # (patches, channels * temporal_patch * patch * patch): float32, or uint8 patches
    grid_thw: tuple[int, int, int]
    num_tokens: int
    kind: str = "image"
    normalization: Normalization | None = None  # set for uint8 patches: the encoder's step to pixel values


def load_media(
    item: MediaInput, images: ImageProcessorSpec, videos: VideoProcessorSpec, rules: FetcherConfig, model_key: str
) -> LoadedImage:
    """Runs in a fetcher thread; raises ``MediaError`` with the HTTP status for the client."""
    if item.kind == "video":
        return load_video(item, videos, rules, model_key)
    if item.kind == "image":
        return load_image(item, images, rules, model_key)
    raise MediaError(400, f"unsupported media kind {item.kind!r}")


def load_image(item: MediaInput, spec: ImageProcessorSpec, rules: FetcherConfig, model_key: str) -> LoadedImage:
    """Runs in a fetcher thread; raises ``MediaError`` with the HTTP status for the client."""
    if item.min_pixels is not None or item.max_pixels is not None:
        spec = spec.with_pixel_limits(item.min_pixels or spec.min_pixels, item.max_pixels or spec.max_pixels)
    image = decode_image(fetch_bytes(item.url, rules), rules.max_image_pixels)
    # uint8 patches: a quarter of the bytes to copy, serialise and move to the GPU, where the encoder
    # rescales and normalises them exactly as `preprocess_image` would (tests/unit/test_image_preprocess.py).
    patches, grid = image_patches(image, spec)
    norm = normalization_of(spec, channels=patches.shape[1] // (spec.temporal_patch_size * spec.patch_size**2))
    # Content + every parameter that changes the embedding: equal hashes mean equal ViT output.
    digest = hashlib.sha256()
    digest.update(json.dumps([model_key, image.mode, image.size, repr(spec)], default=str).encode())
    digest.update(image.tobytes())
    tokens = num_image_tokens(grid, spec.merge_size)
    return LoadedImage(digest.hexdigest(), patches, grid, tokens, normalization=norm)


def load_video(item: MediaInput, spec: VideoProcessorSpec, rules: FetcherConfig, model_key: str) -> LoadedImage:
    fps = validated_fps(item.fps)
    spec = with_client_limits(spec, item.min_pixels, item.max_pixels)
    # Videos get their own (larger) download limit.
    data = fetch_bytes(item.url, dataclasses.replace(rules, max_media_bytes=rules.max_video_bytes))
    video = decode_video(data, fps, spec, rules.max_video_frames, rules.max_image_pixels)
    pixel_values, grid, resized = preprocess_video(video, spec, rules.max_video_tokens)
    content_hash = video_hash(model_key, spec, fps, resized)
    return LoadedImage(content_hash, pixel_values, grid, num_image_tokens(grid, spec.frames.merge_size), "video")
