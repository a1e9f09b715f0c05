"""One media item from URL to patches: download, decode, hash, Qwen resize + patchify."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

from common.config import FetcherConfig
from common.protocol import MediaInput
from workers.fetcher.download import fetch_bytes
from workers.fetcher.image import ImageProcessorSpec, decode_image, num_image_tokens, preprocess_image


@dataclass
class LoadedImage:
    content_hash: str
    pixel_values: np.ndarray  # (patches, channels * temporal_patch * patch * patch), float32
    grid_thw: tuple[int, int, int]
    num_tokens: int


def load_image(item: MediaInput, spec: ImageProcessorSpec, rules: FetcherConfig, model_key: str) -> LoadedImage:
    """Runs in a fetcher thread; raises ``MediaError`` with the HTTP status for the client."""
    if item.min_pixels is not None or item.max_pixels is not None:
        spec = spec.with_pixel_limits(item.min_pixels or spec.min_pixels, item.max_pixels or spec.max_pixels)
    image = decode_image(fetch_bytes(item.url, rules), rules.max_image_pixels)
    pixel_values, grid = preprocess_image(image, spec)
    # Content + every parameter that changes the embedding: equal hashes mean equal ViT output.
    digest = hashlib.sha256()
    digest.update(json.dumps([model_key, image.mode, image.size, repr(spec)], default=str).encode())
    digest.update(image.tobytes())
    return LoadedImage(digest.hexdigest(), pixel_values, grid, num_image_tokens(grid, spec.merge_size))
