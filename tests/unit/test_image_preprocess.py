"""workers.fetcher.image against transformers' Qwen2-VL PIL image processor, bit for bit.

The reference is fed the same encoded bytes: ``Image.open`` for plain images (so its own ``convert_to_rgb``
is what gets compared) and ``load_image`` for EXIF-rotated ones (it applies the orientation).
"""

from __future__ import annotations

import base64
import copy
import functools
import io
import json
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile
from transformers.image_utils import load_image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from workers.fetcher.errors import MediaError
from workers.fetcher.image import (
    ImageProcessorSpec,
    decode_image,
    image_patches,
    normalization_of,
    num_image_tokens,
    preprocess_image,
    smart_resize,
)
from workers.models.pixels import normalize_patches

# What Qwen2-VL-*-Instruct checkpoints ship in preprocessor_config.json.
QWEN2_VL_CONFIG: dict[str, Any] = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}
SMALL_CONFIG: dict[str, Any] = {**QWEN2_VL_CONFIG, "max_pixels": 401408}
CONFIGS = {"qwen2vl": QWEN2_VL_CONFIG, "max401408": SMALL_CONFIG}
MAX_IMAGE_PIXELS = 64_000_000
# The processor's untouched class default; see reference_processor.
PRISTINE_SIZE = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}

# Pillow says this when converting such palettes to RGB, in transformers' convert_to_rgb and ours alike.
pytestmark = pytest.mark.filterwarnings("ignore:Palette images with Transparency expressed in bytes")


@pytest.fixture(params=sorted(CONFIGS))
def config(request: pytest.FixtureRequest) -> dict[str, Any]:
    return CONFIGS[request.param]


def reference_processor(config: dict[str, Any]) -> Qwen2VLImageProcessorPil:
    """Build the transformers processor without leaking state into other tests.

    Its ``__init__`` writes min/max_pixels into the *class-level* default ``size`` dict, so every later
    processor built without those keys inherits them; start from and restore the pristine default.
    """
    shared = Qwen2VLImageProcessorPil.size
    saved = dict(shared)
    shared.clear()
    shared.update(PRISTINE_SIZE)
    try:
        return Qwen2VLImageProcessorPil.from_dict(copy.deepcopy(config))
    finally:
        shared.clear()
        shared.update(saved)


def reference_outputs(
    processor: Qwen2VLImageProcessorPil, image: Image.Image, **kwargs: int
) -> tuple[np.ndarray, tuple[int, ...]]:
    out = processor(images=[image], return_tensors="np", **kwargs)
    return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])


def assert_identical(
    ours: tuple[np.ndarray, tuple[int, int, int]], expected: tuple[np.ndarray, tuple[int, ...]]
) -> None:
    values, grid = ours
    expected_values, expected_grid = expected
    assert grid == expected_grid
    assert values.dtype == expected_values.dtype == np.float32
    assert values.shape == expected_values.shape == (grid[0] * grid[1] * grid[2], 3 * 2 * 14 * 14)
    assert np.array_equal(values, expected_values), f"max abs diff {np.abs(values - expected_values).max()}"


# --------------------------------------------------------------------------- test images


def noise(height: int, width: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    shape = (height, width, channels) if channels > 1 else (height, width)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def smooth(height: int, width: int, seed: int = 0) -> np.ndarray:
    """Gradient plus mild noise: photo-like, so JPEG keeps detail without huge files."""
    rows = np.linspace(0, 200, height, dtype=np.float32)[:, None, None]
    cols = np.linspace(0, 50, width, dtype=np.float32)[None, :, None]
    jitter = np.random.default_rng(seed).integers(0, 6, (height, width, 3))
    return np.clip(rows + cols + jitter + np.array([0, 20, 40]), 0, 255).astype(np.uint8)


def encode(image: Image.Image, fmt: str, **params: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def png(array: np.ndarray) -> bytes:
    return encode(Image.fromarray(array), "PNG")


def rgba_partial_alpha() -> bytes:
    rgba = noise(37, 61, 4, seed=1)
    rgba[:, :20, 3] = 0  # fully transparent, but with colour underneath
    rgba[:, 20:40, 3] = 128
    rgba[:, 40:, 3] = 255
    return png(rgba)


def palette(transparency: int | bytes | None) -> bytes:
    image = Image.fromarray(noise(45, 70, seed=2)).quantize(16)
    params = {} if transparency is None else {"transparency": transparency}
    return encode(image, "PNG", **params)


def grey_alpha() -> bytes:
    return png(np.dstack([noise(50, 33, 1, seed=3), noise(50, 33, 1, seed=4)]))


def grey16() -> bytes:
    # Mostly above 255, some below: shows convert("RGB") clipping rather than scaling.
    values = np.random.default_rng(5).integers(0, 1024, (41, 29)).astype(np.uint16)
    image = Image.fromarray(values)
    assert image.mode == "I;16"
    return encode(image, "PNG")


def cmyk_jpeg() -> bytes:
    return encode(Image.fromarray(smooth(64, 90, seed=6)).convert("CMYK"), "JPEG", quality=95)


def animated_gif() -> bytes:
    first = Image.new("RGB", (40, 30), (200, 30, 30))
    second = Image.new("RGB", (40, 30), (30, 30, 200))
    return encode(first, "GIF", save_all=True, append_images=[second], duration=100, loop=0)


def exif_jpeg(orientation: int) -> bytes:
    """A 280x140 (w x h) photo whose EXIF says to rotate it; landscape in storage."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(Image.fromarray(smooth(140, 280, seed=7)), "JPEG", quality=90, exif=exif.tobytes())


# Sizes are (height, width). Each builder runs once per session.
CASES: dict[str, Callable[[], bytes]] = {
    "rgb_1x1_png": lambda: png(noise(1, 1)),
    "rgb_h3_w5_png": lambda: png(noise(3, 5)),
    "rgb_28x28_png": lambda: png(noise(28, 28)),
    "rgb_odd_333x517_jpeg": lambda: encode(Image.fromarray(noise(333, 517)), "JPEG"),
    "rgb_h3000_w4000_jpeg": lambda: encode(Image.fromarray(smooth(3000, 4000)), "JPEG", quality=85),
    "rgb_h30_w5000_png": lambda: png(noise(30, 5000)),
    "rgb_h5000_w30_png": lambda: png(noise(5000, 30)),
    "rgb_webp": lambda: encode(Image.fromarray(noise(50, 80)), "WEBP", lossless=True),
    "rgba_partial_alpha_png": rgba_partial_alpha,
    "palette_png": lambda: palette(None),
    "palette_index_transparency_png": lambda: palette(0),
    "palette_alpha_table_png": lambda: palette(bytes(range(0, 256, 16))),
    "grey_L_png": lambda: png(noise(50, 33, 1, seed=3)),
    "grey_LA_png": grey_alpha,
    "bilevel_1_png": lambda: png(noise(30, 30, 1, seed=8) > 127),
    "grey_16bit_png": grey16,
    "cmyk_jpeg": cmyk_jpeg,
    "animated_gif": animated_gif,
}


@functools.cache
def case_bytes(name: str) -> bytes:
    return CASES[name]()


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("name", list(CASES))
def test_pixel_values_match_transformers(name: str, config: dict[str, Any]) -> None:
    data = case_bytes(name)
    ours = preprocess_image(decode_image(data, MAX_IMAGE_PIXELS), ImageProcessorSpec.from_dict(config))
    expected = reference_outputs(reference_processor(config), Image.open(io.BytesIO(data)))
    assert_identical(ours, expected)


def test_huge_image_is_resized_down_to_max_pixels() -> None:
    values, (t, h, w) = preprocess_image(
        decode_image(case_bytes("rgb_h3000_w4000_jpeg"), MAX_IMAGE_PIXELS), ImageProcessorSpec.from_dict(SMALL_CONFIG)
    )
    assert (t, h, w) == (1, 38, 52)  # 532x728 pixels: under 401408, aspect kept
    assert h * w * 14 * 14 <= SMALL_CONFIG["max_pixels"]
    assert values.shape[0] == h * w


@pytest.mark.parametrize("orientation", [6, 3])
def test_exif_orientation_matches_load_image(orientation: int, config: dict[str, Any]) -> None:
    data = exif_jpeg(orientation)
    spec = ImageProcessorSpec.from_dict(config)
    decoded = decode_image(data, MAX_IMAGE_PIXELS)
    ours = preprocess_image(decoded, spec)
    expected = reference_outputs(reference_processor(config), load_image(base64.b64encode(data).decode()))
    assert_identical(ours, expected)

    stored = Image.open(io.BytesIO(data))
    unrotated_values, unrotated_grid = preprocess_image(stored, spec)
    if orientation == 6:  # 90 degrees: width and height swap, so does the grid
        assert decoded.size == (140, 280)
        assert ours[1] == (1, 20, 10) and unrotated_grid == (1, 10, 20)
    else:  # 180 degrees: same grid, different pixels
        assert decoded.size == (280, 140)
        assert ours[1] == unrotated_grid == (1, 10, 20)
        assert not np.array_equal(ours[0], unrotated_values)


def test_rgba_alpha_is_composited_over_white_like_transformers() -> None:
    """Fully transparent pixels become white whatever colour hides under them; opaque ones keep theirs."""
    rgba = np.asarray(Image.open(io.BytesIO(case_bytes("rgba_partial_alpha_png"))))
    decoded = np.asarray(decode_image(case_bytes("rgba_partial_alpha_png"), MAX_IMAGE_PIXELS))
    transparent, opaque = rgba[:, :, 3] == 0, rgba[:, :, 3] == 255
    assert transparent.any() and opaque.any()
    assert (decoded[transparent] == 255).all()
    assert np.array_equal(decoded[opaque], rgba[opaque][:, :3])


def test_16bit_grey_is_clipped_like_transformers() -> None:
    raw = np.asarray(Image.open(io.BytesIO(case_bytes("grey_16bit_png")))).astype(np.int64)
    decoded = np.asarray(decode_image(case_bytes("grey_16bit_png"), MAX_IMAGE_PIXELS))
    assert np.array_equal(decoded[:, :, 0], np.minimum(raw, 255))


def test_animated_image_uses_first_frame() -> None:
    decoded = decode_image(case_bytes("animated_gif"), MAX_IMAGE_PIXELS)
    assert decoded.getpixel((0, 0)) == (200, 30, 30)


def test_per_request_pixel_limits_match_transformers_call_kwargs() -> None:
    image = decode_image(case_bytes("rgb_odd_333x517_jpeg"), MAX_IMAGE_PIXELS)
    spec = ImageProcessorSpec.from_dict(QWEN2_VL_CONFIG).with_pixel_limits(20_000, 60_000)
    expected = reference_outputs(
        reference_processor(QWEN2_VL_CONFIG),
        Image.open(io.BytesIO(case_bytes("rgb_odd_333x517_jpeg"))),
        min_pixels=20_000,
        max_pixels=60_000,
    )
    assert (spec.min_pixels, spec.max_pixels) == (20_000, 60_000)
    assert_identical(preprocess_image(image, spec), expected)


@pytest.mark.parametrize(
    ("min_pixels", "max_pixels", "fragment"),
    [
        (0, 60_000, "min_pixels must be an integer from 1"),
        (3136, 10**9, "max_pixels must be an integer from 1 to 401408"),
        (100_000, 50_000, "must not exceed max_pixels"),
        (True, 50_000, "min_pixels must be an integer"),
    ],
)
def test_per_request_pixel_limits_are_validated(min_pixels: Any, max_pixels: Any, fragment: str) -> None:
    spec = ImageProcessorSpec.from_dict(SMALL_CONFIG)
    with pytest.raises(MediaError, match=fragment) as info:
        spec.with_pixel_limits(min_pixels, max_pixels)
    assert info.value.status == 400


def test_per_request_none_keeps_configured_limit() -> None:
    spec = ImageProcessorSpec.from_dict(SMALL_CONFIG)
    expected = ImageProcessorSpec.from_dict({**SMALL_CONFIG, "max_pixels": 100_000})
    assert spec.with_pixel_limits(None, 100_000) == expected


# --------------------------------------------------------------------------- aspect ratio and smart_resize


def test_aspect_ratio_over_200_is_refused_like_transformers() -> None:
    data = png(noise(700, 3))  # 233:1
    image = decode_image(data, MAX_IMAGE_PIXELS)
    with pytest.raises(MediaError, match=r"3x700.*233\.3:1.*200:1") as info:
        preprocess_image(image, ImageProcessorSpec.from_dict(QWEN2_VL_CONFIG))
    assert info.value.status == 400
    with pytest.raises(ValueError, match="aspect ratio"):
        reference_outputs(reference_processor(QWEN2_VL_CONFIG), Image.open(io.BytesIO(data)))


def smart_resize_cases() -> Iterator[tuple[int, int]]:
    yield from [(1, 1), (1, 200), (200, 1), (3, 5), (27, 29), (42, 42), (14, 42), (70, 70), (3000, 4000)]
    yield from [(30, 5000), (5000, 30), (4095, 2161), (12000, 60), (1, 199), (2, 400)]
    rng = np.random.default_rng(9)
    for _ in range(300):
        height, width = (int(v) for v in rng.integers(1, 9000, 2))
        if max(height, width) / min(height, width) <= 200:
            yield height, width


@pytest.mark.parametrize("limits", [(3136, 12845056), (3136, 401408), (100, 800), (50_000, 60_000)])
def test_smart_resize_matches_transformers(limits: tuple[int, int]) -> None:
    for height, width in smart_resize_cases():
        assert smart_resize(height, width, 28, *limits) == hf_smart_resize(height, width, 28, *limits), (height, width)


def test_smart_resize_refuses_what_transformers_refuses() -> None:
    assert smart_resize(1, 200, 28, 3136, 12845056) == hf_smart_resize(1, 200, 28, 3136, 12845056)
    with pytest.raises(ValueError):
        hf_smart_resize(1, 201, 28, 3136, 12845056)
    with pytest.raises(MediaError, match="201x1") as info:
        smart_resize(1, 201, 28, 3136, 12845056)
    assert info.value.status == 400


@pytest.mark.parametrize(("height", "width"), [(1, 1), (333, 517), (3000, 4000), (30, 5000)])
def test_num_image_tokens_matches_transformers(height: int, width: int, config: dict[str, Any]) -> None:
    processor = reference_processor(config)
    grid = (1, *(v // 14 for v in smart_resize(height, width, 28, config["min_pixels"], config["max_pixels"])))
    assert num_image_tokens(grid, 2) == processor.get_number_of_image_patches(height, width) // 4


# --------------------------------------------------------------------------- config parsing


def resolved_limits(processor: Qwen2VLImageProcessorPil) -> tuple[int, int]:
    return processor.size.shortest_edge, processor.size.longest_edge


@pytest.mark.parametrize(
    "config",
    [
        {"min_pixels": 1000, "max_pixels": 50000},
        {"size": {"shortest_edge": 2000, "longest_edge": 60000}},
        {"size": {"shortest_edge": 2000, "longest_edge": 60000}, "min_pixels": 1000, "max_pixels": 50000},
        {"size": {"shortest_edge": 2000, "longest_edge": 60000}, "max_pixels": 50000},
        # Saved by transformers 4.45-era processors: legacy size keys plus the top-level ones.
        {"size": {"min_pixels": 3136, "max_pixels": 12845056}, "min_pixels": 4000, "max_pixels": 100000},
        {"max_pixels": 70000, "min_pixels": None},
        {},
    ],
    ids=["top-level", "size", "both", "mixed", "legacy-size", "null-min", "empty"],
)
def test_pixel_limit_precedence_matches_transformers(config: dict[str, Any]) -> None:
    spec = ImageProcessorSpec.from_dict(config)
    assert (spec.min_pixels, spec.max_pixels) == resolved_limits(reference_processor(config))


def test_empty_config_is_not_polluted_by_earlier_configs() -> None:
    ImageProcessorSpec.from_dict({"max_pixels": 401408})
    assert (ImageProcessorSpec.from_dict({}).min_pixels, ImageProcessorSpec.from_dict({}).max_pixels) == (3136, 1003520)


@pytest.mark.parametrize(
    "config",
    [
        {"size": {"min_pixels": 3136, "max_pixels": 12845056}},
        {"size": {"min_pixels": 100, "max_pixels": 2000}, "min_pixels": 50},
        {"size": {"shortest_edge": 100}},
    ],
    ids=["legacy-size-only", "legacy-size-half-overridden", "no-longest-edge"],
)
def test_configs_transformers_cannot_run_are_refused_at_load(config: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="size"):
        ImageProcessorSpec.from_dict(config)
    with pytest.raises(ValueError):  # transformers fails at construction or at the first image
        reference_outputs(reference_processor(config), Image.fromarray(noise(56, 56)))


def test_from_dict_reads_every_processing_field() -> None:
    spec = ImageProcessorSpec.from_dict(
        {
            **QWEN2_VL_CONFIG,
            "patch_size": 16,
            "merge_size": 3,
            "temporal_patch_size": 1,
            "image_mean": 0.5,
            "image_std": [0.1, 0.2, 0.3],
            "rescale_factor": 1,
            "do_resize": False,
            "do_rescale": False,
            "do_normalize": False,
            "do_convert_rgb": False,
            "resample": 2,
            "unknown_key": 1,
        }
    )
    assert spec == ImageProcessorSpec(
        patch_size=16,
        temporal_patch_size=1,
        merge_size=3,
        min_pixels=3136,
        max_pixels=12845056,
        image_mean=0.5,
        image_std=(0.1, 0.2, 0.3),
        rescale_factor=1.0,
        do_resize=False,
        do_rescale=False,
        do_normalize=False,
        do_convert_rgb=False,
        resample=2,
    )
    hash(spec)


def test_non_default_processing_flags_match_transformers() -> None:
    config = {**SMALL_CONFIG, "image_mean": 0.5, "image_std": 0.25, "rescale_factor": 0.5, "resample": 2}
    for flags in ({"do_rescale": False}, {"do_normalize": False}, {"do_rescale": False, "do_normalize": False}, {}):
        data = case_bytes("rgb_odd_333x517_jpeg")
        ours = preprocess_image(decode_image(data, MAX_IMAGE_PIXELS), ImageProcessorSpec.from_dict({**config, **flags}))
        expected = reference_outputs(reference_processor({**config, **flags}), Image.open(io.BytesIO(data)))
        assert_identical(ours, expected)


@pytest.mark.parametrize("name", ["rgb_odd_333x517_jpeg", "grey_L_png", "palette_alpha_table_png", "cmyk_jpeg"])
def test_uint8_patches_normalized_later_equal_pixel_values_bit_for_bit(name: str) -> None:
    """What the fetcher ships (uint8 patches, a quarter of the bytes) and the encoder normalises on its
    device is exactly `preprocess_image`'s float32 output, for every combination of processing flags."""
    data = case_bytes(name)
    base = {**SMALL_CONFIG, "image_mean": [0.5, 0.4, 0.3], "rescale_factor": 1 / 255}
    for flags in ({}, {"do_rescale": False}, {"do_normalize": False}, {"do_rescale": False, "do_normalize": False}):
        spec = ImageProcessorSpec.from_dict({**base, **flags})
        expected, grid = preprocess_image(decode_image(data, MAX_IMAGE_PIXELS), spec)
        patches, patch_grid = image_patches(decode_image(data, MAX_IMAGE_PIXELS), spec)
        assert patches.dtype == np.uint8 and patch_grid == grid and patches.shape == expected.shape
        values = normalize_patches(torch.from_numpy(patches), normalization_of(spec, channels=3))
        assert values.dtype == torch.float32
        assert np.array_equal(values.numpy(), expected), (name, flags)


def test_without_resize_sides_must_be_multiples_of_28() -> None:
    config = {**QWEN2_VL_CONFIG, "do_resize": False}
    spec = ImageProcessorSpec.from_dict(config)
    image = Image.fromarray(noise(56, 84))
    assert_identical(preprocess_image(image, spec), reference_outputs(reference_processor(config), image))
    with pytest.raises(MediaError, match="multiples of 28") as info:
        preprocess_image(Image.fromarray(noise(56, 80)), spec)
    assert info.value.status == 400


@pytest.mark.parametrize(
    "bad",
    [
        {"patch_size": 0},
        {"merge_size": "2"},
        {"do_resize": "yes"},
        {"image_std": [0.2, 0, 0.2]},
        {"image_mean": ["a"]},
        {"resample": 99},
        {"size": 448},
    ],
)
def test_invalid_configs_raise_value_error(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ImageProcessorSpec.from_dict({**QWEN2_VL_CONFIG, **bad})


def test_from_dir_picks_the_file_transformers_picks(tmp_path: Path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN2_VL_CONFIG))
    assert ImageProcessorSpec.from_dir(tmp_path) == ImageProcessorSpec.from_dict(QWEN2_VL_CONFIG)
    hf = Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    assert resolved_limits(hf) == (3136, 12845056)

    # transformers 5 prefers an image_processor section nested in processor_config.json.
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": SMALL_CONFIG}))
    assert ImageProcessorSpec.from_dir(tmp_path) == ImageProcessorSpec.from_dict(SMALL_CONFIG)
    assert resolved_limits(Qwen2VLImageProcessorPil.from_pretrained(tmp_path)) == (3136, 401408)


def test_from_dir_without_config_says_which_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"preprocessor_config\.json"):
        ImageProcessorSpec.from_dir(tmp_path)


# --------------------------------------------------------------------------- refused input


def one_colour_png(width: int, height: int) -> bytes:
    """A valid 1-bit PNG of any size in a few KB: all-zero rows deflate to almost nothing."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    row = bytes(1 + (width + 7) // 8)  # filter byte + packed bits
    deflate = zlib.compressobj(9)
    rows_per_piece = 1000
    pieces = [deflate.compress(row * min(rows_per_piece, height - y)) for y in range(0, height, rows_per_piece)]
    idat = b"".join(pieces) + deflate.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def bomb_png() -> bytes:
    return one_colour_png(20000, 20000)


@pytest.fixture
def no_pixel_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)


def test_one_colour_png_helper_is_a_real_png() -> None:
    decoded = decode_image(one_colour_png(300, 200), MAX_IMAGE_PIXELS)
    assert decoded.size == (300, 200) and decoded.getextrema() == ((0, 0), (0, 0), (0, 0))


def test_huge_header_is_refused_before_decoding(
    bomb_png: bytes, monkeypatch: pytest.MonkeyPatch, no_pixel_decoding: None
) -> None:
    assert len(bomb_png) < 100_000
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # only our own budget applies
    with pytest.raises(MediaError) as info:
        decode_image(bomb_png, MAX_IMAGE_PIXELS)
    assert info.value.status == 413
    assert "20000x20000 = 400000000 pixels" in info.value.message
    assert "limit is 64000000" in info.value.message


def test_pillow_bomb_error_becomes_413(bomb_png: bytes, no_pixel_decoding: None) -> None:
    # 4e8 pixels is over twice Pillow's default limit: Pillow itself raises while reading the header.
    with pytest.raises(MediaError, match="decompression-bomb") as info:
        decode_image(bomb_png, 10**12)
    assert info.value.status == 413


def test_pillow_bomb_warning_becomes_413(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.warns(Image.DecompressionBombWarning), pytest.raises(MediaError, match="decompression-bomb") as info:
        decode_image(png(noise(40, 40)), 10**9)  # 1600 pixels: Pillow only warns
    assert info.value.status == 413


def test_pixel_budget_boundary() -> None:
    data = png(noise(10, 10))
    assert decode_image(data, 100).size == (10, 10)
    with pytest.raises(MediaError, match="10x10 = 100 pixels; the limit is 99") as info:
        decode_image(data, 99)
    assert info.value.status == 413


def truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"", "empty"),
        (np.random.default_rng(10).integers(0, 256, 5000, dtype=np.uint8).tobytes(), "not recognised"),
        (b"\x89PNG\r\n\x1a\n", "not recognised or its header is corrupt"),
        (truncated(encode(Image.fromarray(noise(200, 200)), "JPEG")), "truncated"),
        (truncated(png(noise(200, 200))), "truncated"),
        (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "not recognised"),
    ],
    ids=["empty", "random", "png-signature-only", "truncated-jpeg", "truncated-png", "eps"],
)
def test_bad_bytes_are_400(data: bytes, fragment: str) -> None:
    with pytest.raises(MediaError, match=fragment) as info:
        decode_image(data, MAX_IMAGE_PIXELS)
    assert info.value.status == 400
    assert str(info.value) == info.value.message


def test_media_error_survives_pickling() -> None:
    import pickle

    error = pickle.loads(pickle.dumps(MediaError(413, "too big")))
    assert (error.status, error.message) == (413, "too big")
