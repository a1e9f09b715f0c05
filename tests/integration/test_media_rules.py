"""Media sources, limits and API keys on a strictly configured stack: every rule answers a clear 4xx."""

from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from common.config import load_config
from tests.integration.conftest import MediaServer, Stack, hand_started_stack
from tests.media import data_url, make_image, png_bytes

KEY = "sk-test-7f3a"


@pytest.fixture(scope="module")
def strict(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("strict")
    allowed = root / "media"
    allowed.mkdir()
    (allowed / "ok.png").write_bytes(png_bytes(make_image(60, 40, seed=3)))
    (root / "outside.png").write_bytes(png_bytes(make_image(60, 40, seed=4)))
    settings = (
        f'[fetcher]\nallowed_local_media_path = "{allowed}"\nmax_images_per_request = 2\n'
        "max_image_pixels = 50000000\nallow_private_addresses = false\n"
    )
    with hand_started_stack(root, load_config(stack.config_path).model_path(), settings, api_keys=[KEY]) as url:
        yield url, root


def post(base_url: str, body: dict[str, Any], key: str | None = KEY) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(base_url + "/v1/chat/completions", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def ask(*urls: str, **image_options: Any) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u, **image_options}} for u in urls]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What?"}]}], "max_tokens": 2}


def assert_error(reply: tuple[int, dict[str, Any]], status: int, needle: str) -> None:
    code, body = reply
    assert code == status, body
    assert needle.lower() in body["error"]["message"].lower(), body["error"]["message"]


def test_api_keys(strict: tuple[str, Path]) -> None:
    url, _ = strict
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert_error(post(url, body, key=None), 401, "API key")
    assert_error(post(url, body, key="sk-wrong"), 401, "API key")
    assert post(url, body)[0] == 200
    with urllib.request.urlopen(url + "/health", timeout=10) as r:  # probes need no key
        assert r.status == 200


def test_private_addresses_are_refused(strict: tuple[str, Path], media_server: MediaServer) -> None:
    url, _ = strict
    picture = media_server.put("private.png", png_bytes(make_image(30, 30, seed=1)))
    assert_error(post(url, ask(picture)), 400, "non-public address")


def test_local_files_only_under_the_allowed_directory(strict: tuple[str, Path]) -> None:
    url, root = strict
    assert post(url, ask(f"file://{root / 'media' / 'ok.png'}"))[0] == 200
    assert_error(post(url, ask(f"file://{root / 'outside.png'}")), 403, "allowed directory")
    assert_error(post(url, ask(f"file://{root / 'media' / '..' / 'outside.png'}")), 403, "allowed directory")
    assert_error(post(url, ask(f"file://{root / 'media' / 'missing.png'}")), 400, "cannot read")


def test_decompression_bomb_is_refused_before_decoding(strict: tuple[str, Path]) -> None:
    url, _ = strict
    buf = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buf, "PNG")  # a 400-megapixel image in a few KB
    assert_error(post(url, ask("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())), 413, "pixels")


def test_broken_and_wrong_files(strict: tuple[str, Path]) -> None:
    url, _ = strict
    jpeg = io.BytesIO()
    make_image(200, 150, seed=8).save(jpeg, "JPEG")
    truncated = jpeg.getvalue()[: len(jpeg.getvalue()) // 2]
    assert_error(post(url, ask("data:image/jpeg;base64," + base64.b64encode(truncated).decode())), 400, "image")
    text = base64.b64encode(b"just some text, not an image at all").decode()
    assert_error(post(url, ask("data:image/png;base64," + text)), 400, "image")


def test_too_many_images(strict: tuple[str, Path]) -> None:
    url, _ = strict
    picture = data_url(make_image(30, 30, seed=2))
    assert_error(post(url, ask(picture, picture, picture)), 400, "limit is 2")


def test_per_request_pixel_limits_change_the_image_tokens(stack: Stack) -> None:
    picture = data_url(make_image(560, 560, seed=12))
    big = post(stack.base_url, ask(picture), key=None)
    small = post(stack.base_url, ask(picture, max_pixels=112 * 112), key=None)
    assert big[0] == small[0] == 200
    assert big[1]["usage"]["prompt_tokens"] - small[1]["usage"]["prompt_tokens"] == 400 - 16
