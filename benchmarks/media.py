"""Deterministic synthetic media: photos, text-like documents and short videos, with no downloads.

Pixels are random enough that two seeds never share a content hash (so an embedding cache cannot
serve a "new" image) and structured enough that JPEG/PNG sizes look like real photos and scans.
"""

from __future__ import annotations

import base64
import io
import struct

import numpy as np
from PIL import Image, ImageDraw

# The smallest side Qwen2-VL accepts without upscaling into nonsense: two merged 14-px patches.
MIN_SIDE = 28


def scaled(size: tuple[int, int], scale: float) -> tuple[int, int]:
    """``size`` shrunk by ``scale`` for fast CPU runs, never below what the model can take."""
    return max(MIN_SIDE, round(size[0] * scale)), max(MIN_SIDE, round(size[1] * scale))


def photo(width: int, height: int, seed: int) -> Image.Image:
    """A photo-like picture: a smooth colour field, some soft shapes, sensor-like noise."""
    rng = np.random.default_rng([seed, 1])
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :, None]
    corners = rng.uniform(20, 235, size=(4, 3)).astype(np.float32)
    field = (corners[0] * (1 - x) + corners[1] * x) * (1 - y) + (corners[2] * (1 - x) + corners[3] * x) * y
    image = Image.fromarray(field.astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(4, 12))):
        x0, y0 = rng.uniform(-0.2, 1.0) * width, rng.uniform(-0.2, 1.0) * height
        w, h = rng.uniform(0.05, 0.5) * width, rng.uniform(0.05, 0.5) * height
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape((x0, y0, x0 + w, y0 + h), fill=colour)
    # Mild noise keeps JPEG sizes realistic; full-range noise would make every photo ~1 MB.
    noise = rng.integers(-6, 7, size=(height, width, 3), dtype=np.int16)
    pixels = np.clip(np.asarray(image, dtype=np.int16) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def document(width: int, height: int, seed: int) -> Image.Image:
    """A scanned-page look: white paper, a title bar, paragraphs of dark word-shaped stripes."""
    rng = np.random.default_rng([seed, 2])
    image = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    margin = max(2, width // 12)
    line = max(3, height // 70)  # ~70 lines a page, as a 10-12 pt text page has
    ink = (20, 20, 30)
    y = margin
    draw.rectangle((margin, y, margin + int((width - 2 * margin) * rng.uniform(0.3, 0.7)), y + 2 * line), fill=ink)
    y += 4 * line
    while y + line < height - margin:
        for _ in range(int(rng.integers(3, 9))):  # lines in this paragraph
            if y + line >= height - margin:
                break
            x = margin
            end = width - margin - (int(rng.integers(0, (width - 2 * margin) // 2)) if rng.random() < 0.2 else 0)
            while True:
                word = int(rng.integers(2, 9)) * max(1, line // 2)
                if x + word > end:
                    break
                draw.rectangle((x, y, x + word, y + max(1, line * 2 // 3)), fill=ink)
                x += word + max(1, line // 2)
            y += int(line * 1.6)
        y += line  # paragraph gap
    return image


def video_frames(width: int, height: int, count: int, seed: int) -> list[Image.Image]:
    """A panning photo with an object moving across it, so consecutive frames differ."""
    background = np.asarray(photo(width, height, seed))
    rng = np.random.default_rng([seed, 3])
    colour = rng.integers(0, 256, 3).astype(np.uint8)
    side = max(4, min(width, height) // 5)
    frames = []
    for k in range(count):
        pixels = np.roll(background, shift=k * max(1, width // 40), axis=1).copy()
        x = int((k / max(1, count - 1)) * (width - side))
        y = int((0.5 + 0.3 * np.sin(k)) * (height - side))
        pixels[y : y + side, x : x + side] = colour
        frames.append(Image.fromarray(pixels, "RGB"))
    return frames


def jpeg_bytes(image: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _chunk(fourcc: bytes, data: bytes) -> bytes:
    return fourcc + struct.pack("<I", len(data)) + data + (b"\0" if len(data) % 2 else b"")


def _list(kind: bytes, body: bytes) -> bytes:
    return b"LIST" + struct.pack("<I", len(body) + 4) + kind + body


def mjpeg_avi(jpegs: list[bytes], width: int, height: int, fps: int) -> bytes:
    """Motion-JPEG frames in an AVI container, written by hand.

    Nothing installed here encodes MP4 (no PyAV, OpenCV or ffmpeg binary), but every decoder a
    server uses (decord, OpenCV, PyAV, ffmpeg) reads MJPEG AVI, and Pillow writes the JPEGs.
    """
    count, biggest = len(jpegs), max(len(j) for j in jpegs)
    avih = struct.pack(
        "<14I", round(1e6 / fps), biggest * fps, 0, 0x10, count, 0, 1, biggest, width, height, 0, 0, 0, 0
    )
    strh = b"vidsMJPG" + struct.pack(
        "<IHHIIIIIIII4h", 0, 0, 0, 0, 1, fps, 0, count, biggest, 0xFFFFFFFF, 0, 0, 0, width, height
    )
    strf = struct.pack("<IiiHH4sIiiII", 40, width, height, 1, 24, b"MJPG", width * height * 3, 0, 0, 0, 0)
    header = _list(b"hdrl", _chunk(b"avih", avih) + _list(b"strl", _chunk(b"strh", strh) + _chunk(b"strf", strf)))
    movi, index = bytearray(), bytearray()
    for jpeg in jpegs:
        # idx1 offsets count from the 'movi' fourcc; 0x10 marks every frame a key frame.
        index += b"00dc" + struct.pack("<III", 0x10, 4 + len(movi), len(jpeg))
        movi += _chunk(b"00dc", jpeg)
    body = b"AVI " + header + _list(b"movi", bytes(movi)) + _chunk(b"idx1", bytes(index))
    return b"RIFF" + struct.pack("<I", len(body)) + body
