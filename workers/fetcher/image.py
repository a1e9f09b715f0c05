"""Image decoding and Qwen2-VL preprocessing, bit-identical to transformers 5.17's PIL image processor.

The reference is ``transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil``
(what ``AutoImageProcessor`` picks without torchvision) fed by ``transformers.image_utils.load_image``.
Every float operation below repeats the reference's dtype and order, so ``pixel_values`` come out equal
bit for bit, not merely close.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from workers.fetcher.errors import MediaError
from workers.models.pixels import Normalization

# transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD, the processor's class defaults.
_CLIP_MEAN: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
# The processor's class default ``size``; Qwen2-VL checkpoints override max_pixels with 12845056.
_DEFAULT_MIN_PIXELS = 56 * 56
_DEFAULT_MAX_PIXELS = 28 * 28 * 1280
# transformers' smart_resize refuses anything more elongated than this.
_MAX_ASPECT_RATIO = 200
# The key sets transformers' get_size_dict accepts for ``size``.
_VALID_SIZE_KEYS: tuple[frozenset[str], ...] = tuple(
    frozenset(keys)
    for keys in (
        {"height", "width"},
        {"shortest_edge"},
        {"shortest_edge", "longest_edge"},
        {"longest_edge"},
        {"max_height", "max_width"},
        {"min_pixels", "max_pixels"},
    )
)
# EPS would be rendered by a Ghostscript subprocess: not something to run on bytes from the internet.
_REFUSED_FORMATS = frozenset({"EPS"})


# --------------------------------------------------------------------------- processor configuration


@dataclass(frozen=True)
class ImageProcessorSpec:
    """The Qwen2-VL image processor settings that change ``pixel_values``; defaults are the processor's."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = _DEFAULT_MIN_PIXELS
    max_pixels: int = _DEFAULT_MAX_PIXELS
    image_mean: float | tuple[float, ...] = _CLIP_MEAN
    image_std: float | tuple[float, ...] = _CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    resample: int = int(Image.Resampling.BICUBIC)

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            _require_positive_int(f"image processor {name}", getattr(self, name))
        for name in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            _require_bool(name, getattr(self, name))
        if self.resample not in {int(r) for r in Image.Resampling}:
            raise ValueError(f"image processor resample must be a PIL resampling filter, got {self.resample!r}")
        if not _is_number(self.rescale_factor):
            raise ValueError(f"image processor rescale_factor must be a number, got {self.rescale_factor!r}")
        _require_channel_stats("image_mean", self.image_mean)
        _require_channel_stats("image_std", self.image_std)
        if 0 in _per_channel(self.image_std, 1):
            raise ValueError("image processor image_std must not contain 0: it divides")

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dir(cls, checkpoint_dir: str | os.PathLike[str]) -> ImageProcessorSpec:
        """Read the checkpoint's image processor config, from the file transformers 5.17 would pick.

        transformers prefers a ``processor_config.json`` holding an ``image_processor`` section and falls back
        to ``preprocessor_config.json``.
        """
        root = Path(checkpoint_dir)
        nested = _read_json(root / "processor_config.json")
        if isinstance(nested, dict) and isinstance(nested.get("image_processor"), dict):
            return cls.from_dict(nested["image_processor"])
        path = root / "preprocessor_config.json"
        config = _read_json(path)
        if config is None:
            raise FileNotFoundError(f"{path} not found: the checkpoint needs its Qwen2-VL preprocessor_config.json")
        if not isinstance(config, dict):
            raise ValueError(f"{path} must hold a JSON object")
        return cls.from_dict(config)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ImageProcessorSpec:
        """Build from a preprocessor config dict; keys and precedence as ``Qwen2VLImageProcessorPil(**config)``.

        A missing or null key takes the processor's default, like transformers' ``_set_attributes``.
        """
        min_pixels, max_pixels = _resolve_pixel_limits(config)
        values: dict[str, Any] = {"min_pixels": min_pixels, "max_pixels": max_pixels}
        for field in dataclasses.fields(cls):
            raw = config.get(field.name)
            if field.name in values or raw is None:
                continue
            values[field.name] = _coerce_field(field.name, raw)
        return cls(**values)

    def with_pixel_limits(self, min_pixels: int | None, max_pixels: int | None) -> ImageProcessorSpec:
        """A copy with a request's own pixel budget; ``None`` keeps the configured value.

        Both limits must lie within the configured ``max_pixels``: a client-chosen min_pixels would otherwise
        upscale a 1x1 image to any size it likes, and a larger max_pixels would exceed what the deployment
        budgets per image.
        """
        new_min = self.min_pixels if min_pixels is None else min_pixels
        new_max = self.max_pixels if max_pixels is None else max_pixels
        for name, value in (("min_pixels", new_min), ("max_pixels", new_max)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= self.max_pixels:
                raise MediaError(400, f"{name} must be an integer from 1 to {self.max_pixels}, got {value!r}")
        if new_min > new_max:
            raise MediaError(400, f"min_pixels ({new_min}) must not exceed max_pixels ({new_max})")
        return dataclasses.replace(self, min_pixels=new_min, max_pixels=new_max)


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


def _resolve_pixel_limits(config: Mapping[str, Any]) -> tuple[int, int]:
    """Mirror ``Qwen2VLImageProcessorPil.__init__``: top-level min/max_pixels override ``size``.

    Unlike transformers, a config it would only reject at the first image (``size`` lacking either edge)
    is refused here, at load, and the class default is never mutated by an earlier config.
    """
    raw_size = config.get("size")
    if raw_size is None:
        size: dict[str, Any] = {"shortest_edge": _DEFAULT_MIN_PIXELS, "longest_edge": _DEFAULT_MAX_PIXELS}
    elif isinstance(raw_size, Mapping):
        size = dict(raw_size)
    else:
        raise ValueError(
            f"image processor size must be an object like {{'shortest_edge': ..., 'longest_edge': ...}}, "
            f"got {raw_size!r}"
        )
    if config.get("min_pixels") is not None:
        size["shortest_edge"] = config["min_pixels"]
        size.pop("min_pixels", None)
    if config.get("max_pixels") is not None:
        size["longest_edge"] = config["max_pixels"]
        size.pop("max_pixels", None)
    if frozenset(size) not in _VALID_SIZE_KEYS:
        raise ValueError(
            f"image processor size has keys {sorted(size)}; transformers accepts only one of "
            f"{[sorted(k) for k in _VALID_SIZE_KEYS]}"
        )
    if not size.get("shortest_edge") or not size.get("longest_edge"):
        raise ValueError(
            f"image processor config resolves to size={size}; Qwen2-VL needs both min and max pixels: "
            "set 'min_pixels' and 'max_pixels' (or size.shortest_edge and size.longest_edge)"
        )
    return size["shortest_edge"], size["longest_edge"]


def _coerce_field(name: str, raw: Any) -> Any:
    """JSON lists become tuples so the spec stays hashable; everything else is validated in __post_init__."""
    if name in ("image_mean", "image_std") and isinstance(raw, Sequence) and not isinstance(raw, str):
        return tuple(raw)
    if name == "rescale_factor" and _is_number(raw):
        return float(raw)
    return raw


def _require_positive_int(what: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")


def _require_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"image processor {name} must be true or false, got {value!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _require_channel_stats(name: str, value: Any) -> None:
    values = value if isinstance(value, tuple) else (value,)
    if not values or not all(_is_number(v) for v in values):
        raise ValueError(f"image processor {name} must be a number or a list of numbers, got {value!r}")


# --------------------------------------------------------------------------- decoding


def decode_image(data: bytes, max_image_pixels: int) -> Image.Image:
    """Decode untrusted bytes to the RGB image transformers' ``load_image`` would produce.

    The pixel budget is checked on the header's size, before any pixel is decoded.
    """
    _require_positive_int("max_image_pixels", max_image_pixels)
    if not data:
        raise MediaError(400, "image is empty (0 bytes): send the contents of an image file")
    image = _open(data)
    _check_pixel_budget(image.size, max_image_pixels)
    _load_pixels(image)
    image = _apply_exif_orientation(image)
    return _convert_to_rgb(image)


def _open(data: bytes) -> Image.Image:
    """Parse only the header; Pillow opens lazily and positions animations on their first frame."""
    try:
        return Image.open(io.BytesIO(data), formats=_allowed_formats())
    except Image.DecompressionBombError as exc:
        raise MediaError(
            413, f"image exceeds the decoder's decompression-bomb limit ({exc}): downscale it before sending"
        ) from exc
    except UnidentifiedImageError as exc:
        raise MediaError(
            400,
            "image format not recognised or its header is corrupt: "
            "send an intact PNG, JPEG, WebP, GIF, BMP or TIFF file",
        ) from exc
    except MemoryError:
        raise
    except Exception as exc:
        # Plugins signal malformed headers with a zoo of types (SyntaxError, struct.error, ValueError...).
        raise MediaError(400, f"image header is invalid ({exc}): send an intact image file") from exc


def _allowed_formats() -> list[str]:
    Image.init()
    return [name for name in Image.OPEN if name not in _REFUSED_FORMATS]


def _check_pixel_budget(size: tuple[int, int], max_image_pixels: int) -> None:
    """Refuse before decoding: a few KB of PNG can otherwise inflate to gigabytes.

    Pillow's own decompression-bomb threshold counts too. Pillow only *warns* between 1x and 2x its limit,
    and a thread-safe way to turn that warning into an error is to apply the same threshold here; the
    warnings module's filters are process-global and fetch threads decode concurrently.
    """
    width, height = size
    if width < 1 or height < 1:
        raise MediaError(400, f"image has no pixels ({width}x{height}): send a non-empty image")
    pixels = width * height
    pillow_limit = Image.MAX_IMAGE_PIXELS
    if pixels > max_image_pixels:
        raise MediaError(
            413,
            f"image is {width}x{height} = {pixels} pixels; the limit is {max_image_pixels} "
            "pixels: downscale it before sending",
        )
    if pillow_limit is not None and pixels > pillow_limit:
        raise MediaError(
            413,
            f"image is {width}x{height} = {pixels} pixels, over the decoder's "
            f"decompression-bomb limit of {pillow_limit}: downscale it before sending",
        )


def _load_pixels(image: Image.Image) -> None:
    """Decode the whole first frame now, so truncated or corrupt data fails here with a 400."""
    try:
        image.load()
    except Image.DecompressionBombError as exc:
        raise MediaError(
            413, f"image exceeds the decoder's decompression-bomb limit ({exc}): downscale it before sending"
        ) from exc
    except MemoryError:
        raise
    except Exception as exc:
        raise MediaError(400, f"image data is truncated or corrupt ({exc}): send the complete file") from exc


def _apply_exif_orientation(image: Image.Image) -> Image.Image:
    """Rotate/flip as the EXIF Orientation tag says, as ``load_image`` does before the processor sees it."""
    try:
        return ImageOps.exif_transpose(image)
    except MemoryError:
        raise
    except Exception as exc:
        raise MediaError(400, f"image EXIF metadata is malformed ({exc}): re-save the image without EXIF") from exc


def _convert_to_rgb(image: Image.Image) -> Image.Image:
    """transformers' ``convert_to_rgb`` (5.21 and later; Qwen's own qwen-vl-utils does the same):
    anything with transparency (an alpha band or a palette/colour-key ``transparency``) is composited
    over white, everything else is a plain ``convert("RGB")`` (so 16-bit greyscale is clipped at 255)."""
    if image.mode == "RGB":
        return image
    try:
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return image.convert("RGB")
    except ValueError as exc:
        raise MediaError(400, f"image pixel mode {image.mode} cannot be converted to RGB: send an RGB image") from exc


# --------------------------------------------------------------------------- Qwen2-VL preprocessing


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen2-VL ``smart_resize``: sides become multiples of ``factor``, area within the limits."""
    if height < 1 or width < 1:
        raise MediaError(400, f"image has no pixels ({width}x{height}): send a non-empty image")
    ratio = max(height, width) / min(height, width)
    if ratio > _MAX_ASPECT_RATIO:
        raise MediaError(
            400,
            f"image is {width}x{height}, an aspect ratio of {ratio:.1f}:1; at most "
            f"{_MAX_ASPECT_RATIO}:1 is supported: crop or pad the image",
        )
    # round() is Python's round-half-to-even, exactly as in transformers.
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess_image(image: Image.Image, spec: ImageProcessorSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``pixel_values`` (float32, one row per patch) and ``grid_thw`` as the transformers processor gives them."""
    pixels = _resized(image, spec)
    grid = (1, pixels.shape[0] // spec.patch_size, pixels.shape[1] // spec.patch_size)
    return _patchify(pixels, spec), grid


def image_patches(image: Image.Image, spec: ImageProcessorSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The same patches before rescaling and normalising: the resized uint8 values, a quarter of the bytes
    of ``pixel_values``. ``normalize_patches(patches, normalization_of(spec, channels))`` (numpy or torch, on
    any device) gives exactly `preprocess_image`'s float32 values: the encoder does that step on the GPU."""
    pixels = _resized(image, spec)
    if pixels.dtype != np.uint8:
        raise MediaError(400, f"image pixel mode {image.mode} has no 8-bit form: send an RGB image")
    grid = (1, pixels.shape[0] // spec.patch_size, pixels.shape[1] // spec.patch_size)
    return _patchify(pixels, spec, normalize=False), grid


def _resized(image: Image.Image, spec: ImageProcessorSpec) -> np.ndarray:
    if spec.do_convert_rgb:
        image = _convert_to_rgb(image)
    pixels = _as_hwc(np.asarray(image))
    if spec.do_resize:
        height, width = smart_resize(pixels.shape[0], pixels.shape[1], spec.factor, spec.min_pixels, spec.max_pixels)
        pixels = _resize(pixels, height, width, spec.resample, image.mode)
    _check_patchable(pixels.shape, spec)
    return pixels


def normalization_of(spec: ImageProcessorSpec, channels: int) -> Normalization:
    """The rescale and normalize steps of ``spec`` for patches of ``channels`` channels, as the encoder applies
    them (`workers.models.pixels.normalize_patches`)."""
    if not spec.do_normalize:
        return Normalization(spec.rescale_factor if spec.do_rescale else None, None, None)
    mean, std = _per_channel(spec.image_mean, channels), _per_channel(spec.image_std, channels)
    return Normalization(spec.rescale_factor if spec.do_rescale else None, tuple(mean), tuple(std))


def num_image_tokens(grid_thw: tuple[int, int, int], merge_size: int) -> int:
    """LLM tokens for one image: each merge_size x merge_size block of patches becomes one token."""
    grid_t, grid_h, grid_w = grid_thw
    if grid_h % merge_size or grid_w % merge_size:
        raise ValueError(f"grid {grid_thw} does not divide into {merge_size}x{merge_size} merge blocks")
    return grid_t * grid_h * grid_w // (merge_size * merge_size)


def _as_hwc(pixels: np.ndarray) -> np.ndarray:
    return pixels[:, :, None] if pixels.ndim == 2 else pixels


def _resize(pixels: np.ndarray, height: int, width: int, resample: int, mode: str) -> np.ndarray:
    """PIL resize of the uint8 array, as transformers' numpy ``resize`` does via ``to_pil_image``.

    Going through the array (not the original PIL image) matters only without RGB conversion, e.g. a
    palette image is resized as its index plane, exactly like the reference.
    """
    if pixels.dtype != np.uint8:
        # transformers would rescale or reject such arrays on its way to PIL; only reachable with
        # do_convert_rgb off, which no Qwen2-VL checkpoint uses.
        raise MediaError(400, f"image pixel mode {mode} cannot be resized without RGB conversion: send an RGB image")
    if pixels.shape[:2] == (height, width):
        return pixels  # PIL returns an unchanged copy for a same-size resize
    source = Image.fromarray(pixels[:, :, 0] if pixels.shape[2] == 1 else pixels)
    return _as_hwc(np.asarray(source.resize((width, height), resample=resample)))


def _check_patchable(shape: tuple[int, ...], spec: ImageProcessorSpec) -> None:
    height, width, channels = shape
    if height % spec.factor or width % spec.factor:
        raise MediaError(
            400,
            f"image is {width}x{height}; with resizing disabled both sides must be multiples "
            f"of {spec.factor}: crop or pad the image",
        )
    for name, stats in (("image_mean", spec.image_mean), ("image_std", spec.image_std)):
        if spec.do_normalize and isinstance(stats, tuple) and len(stats) != channels:
            raise MediaError(
                400, f"image has {channels} channel(s) but {name} has {len(stats)} values: send an RGB image"
            )


def _patchify(pixels: np.ndarray, spec: ImageProcessorSpec, normalize: bool = True) -> np.ndarray:
    """Normalize (or not: uint8 out) and lay out patches in transformers' order, one band of merge blocks
    at a time.

    Rows are ordered (block row, block col, row in block, col in block) and each row holds
    (channel, temporal copy, patch row, patch col). Working per band keeps the float temporaries small;
    the result is still computed element by element with the reference's operations.
    """
    p, m, t = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    height, width, channels = pixels.shape
    band_rows, blocks_h, blocks_w = m * p, height // (m * p), width // (m * p)
    out = np.empty((blocks_h, blocks_w, m, m, channels, t, p, p), dtype=np.float32 if normalize else pixels.dtype)
    for i in range(blocks_h):
        band = pixels[i * band_rows : (i + 1) * band_rows]
        if normalize:
            band = _rescale_and_normalize(band, spec)
        # (row-in-block, patch row, block col, col-in-block, patch col, C) -> (block col, rib, cib, C, pr, pc)
        band = band.reshape(m, p, blocks_w, m, p, channels).transpose(2, 0, 3, 5, 1, 4)
        # The reference repeats a still image temporal_patch_size times along the time axis.
        out[i] = band[:, :, :, :, None]
    return out.reshape(blocks_h * blocks_w * m * m, channels * t * p * p)


def _rescale_and_normalize(pixels: np.ndarray, spec: ImageProcessorSpec) -> np.ndarray:
    """transformers' numpy ``rescale`` then ``normalize``, same dtypes in the same order."""
    values = pixels
    if spec.do_rescale:
        # rescale upcasts to float64, multiplies, then rounds to float32 once.
        values = (values.astype(np.float64) * spec.rescale_factor).astype(np.float32)
    if spec.do_normalize:
        if not np.issubdtype(values.dtype, np.floating):
            values = values.astype(np.float32)
        channels = values.shape[-1]
        mean = np.array(_per_channel(spec.image_mean, channels), dtype=values.dtype)
        std = np.array(_per_channel(spec.image_std, channels), dtype=values.dtype)
        values = (values - mean) / std
    return values


def _per_channel(stats: float | tuple[float, ...], channels: int) -> tuple[float, ...]:
    return stats if isinstance(stats, tuple) else (stats,) * channels
