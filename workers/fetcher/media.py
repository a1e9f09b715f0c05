"""One media item from URL to patches: download, decode, hash, Qwen resize + patchify.

An image seen before (the same bytes under the same processing parameters, e.g. every later turn of a
conversation) skips decoding and resizing: `DecodedMemo` remembers what its bytes became (content hash, grid,
tokens), which is all the cache lookup and the prompt need. Its patches are made again only if the cache no
longer holds its embedding (`LoadedImage.decode_again`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from common.config import FetcherConfig
from common.protocol import MediaInput
from workers.fetcher import video_qwen3_vl
from workers.fetcher.download import fetch_bytes
from workers.fetcher.errors import MediaError
from workers.fetcher.image import ImageProcessorSpec, decode_image, image_patches, normalization_of, num_image_tokens
from workers.fetcher.video import (
    VideoProcessorSpec,
    decode_sampled,
    decode_video,
    preprocess_video,
    second_per_grid,
    validated_fps,
    video_hash,
    with_client_limits,
)
from workers.models.pixels import Normalization


@dataclass
class LoadedImage:
    """A preprocessed image or video (the encoder treats both as patches with a grid)."""

    content_hash: str
    # (patches, channels * temporal_patch * patch * patch): float32, or uint8 patches; None for an image known
    # from the memo, whose patches `decode_again` makes where the cache no longer holds its embedding.
    pixel_values: np.ndarray | None
    grid_thw: tuple[int, int, int]
    num_tokens: int
    kind: str = "image"
    normalization: Normalization | None = None  # set for uint8 patches: the encoder's step to pixel values
    decode_again: Callable[[], LoadedImage] | None = None
    second_per_grid_t: float | None = None  # videos: `workers.fetcher.video.second_per_grid`
    # Qwen3-VL videos: the text before each temporal step's tokens, "<1.5 seconds>" (`video_qwen3_vl.frame_texts`)
    frame_texts: list[str] | None = None


@dataclass(frozen=True)
class MemoEntry:
    content_hash: str
    grid_thw: tuple[int, int, int]
    num_tokens: int
    normalization: Normalization | None


class DecodedMemo:
    """What an image's bytes became under given processing parameters, for the last ``capacity`` images
    (a few hundred bytes each). Shared by a fetcher's threads."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, MemoEntry] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: str) -> MemoEntry | None:
        with self.lock:
            entry = self.entries.get(key)
            if entry is not None:
                self.entries.move_to_end(key)
            return entry

    def put(self, key: str, entry: MemoEntry) -> None:
        with self.lock:
            self.entries[key] = entry
            self.entries.move_to_end(key)
            while len(self.entries) > self.capacity:
                self.entries.popitem(last=False)


def load_media(
    item: MediaInput,
    images: ImageProcessorSpec,
    videos: VideoProcessorSpec | video_qwen3_vl.Qwen3VideoSpec,
    rules: FetcherConfig,
    model_key: str,
    memo: DecodedMemo | None = None,
) -> LoadedImage:
    """Runs in a fetcher thread; raises ``MediaError`` with the HTTP status for the client."""
    if item.kind == "video" and isinstance(videos, video_qwen3_vl.Qwen3VideoSpec):
        return load_timed_video(item, videos, rules, model_key)
    if item.kind == "video":
        return load_video(item, videos, rules, model_key)
    if item.kind == "image":
        return load_image(item, images, rules, model_key, memo)
    raise MediaError(400, f"unsupported media kind {item.kind!r}")


def load_image(
    item: MediaInput, spec: ImageProcessorSpec, rules: FetcherConfig, model_key: str, memo: DecodedMemo | None = None
) -> LoadedImage:
    """Runs in a fetcher thread; raises ``MediaError`` with the HTTP status for the client."""
    if item.min_pixels is not None or item.max_pixels is not None:
        spec = spec.with_pixel_limits(item.min_pixels or spec.min_pixels, item.max_pixels or spec.max_pixels)
    data = fetch_bytes(item.url, rules)
    if memo is None:
        return decode_and_patchify(data, spec, rules, model_key)
    key = hashlib.sha256(json.dumps([model_key, repr(spec)]).encode() + data).hexdigest()
    known = memo.get(key)
    if known is None:
        loaded = decode_and_patchify(data, spec, rules, model_key)
        memo.put(key, MemoEntry(loaded.content_hash, loaded.grid_thw, loaded.num_tokens, loaded.normalization))
        return loaded
    return LoadedImage(
        known.content_hash,
        None,
        known.grid_thw,
        known.num_tokens,
        normalization=known.normalization,
        decode_again=lambda: decode_and_patchify(data, spec, rules, model_key),
    )


def decode_and_patchify(data: bytes, spec: ImageProcessorSpec, rules: FetcherConfig, model_key: str) -> LoadedImage:
    image = decode_image(data, rules.max_image_pixels)
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
    tokens = num_image_tokens(grid, spec.frames.merge_size)
    return LoadedImage(
        content_hash, pixel_values, grid, tokens, "video", second_per_grid_t=second_per_grid(video, spec)
    )


def load_timed_video(
    item: MediaInput, spec: video_qwen3_vl.Qwen3VideoSpec, rules: FetcherConfig, model_key: str
) -> LoadedImage:
    """A Qwen3-VL video: transformers' frame rule and sizes (`workers.fetcher.video_qwen3_vl`), and each temporal
    step's timestamp text for the prompt."""
    fps = spec.fps if item.fps is None else validated_fps(item.fps)
    spec = spec.with_client_limits(item.min_pixels, item.max_pixels)
    data = fetch_bytes(item.url, dataclasses.replace(rules, max_media_bytes=rules.max_video_bytes))
    video = decode_sampled(data, video_qwen3_vl.frame_sampler(spec, fps, rules), rules.max_image_pixels)
    pixel_values, grid, resized = video_qwen3_vl.preprocess(video, spec, rules.max_video_tokens)
    # (the timestamps are not in the hash: the same pixels give the same embeddings at any time)
    content_hash = video_hash(model_key, spec, fps, resized)
    tokens = num_image_tokens(grid, spec.frames.merge_size)
    texts = video_qwen3_vl.frame_texts(video, spec)
    return LoadedImage(content_hash, pixel_values, grid, tokens, "video", frame_texts=texts)
