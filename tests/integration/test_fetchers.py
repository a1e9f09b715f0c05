"""Two fetcher processes (``[fetcher] count = 2``): both take requests, and an image sent again goes to the
fetcher that decoded it the first time while that one has a free credit, which remembers it (no decode, no
resize)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from openai import OpenAI

from tests.integration.conftest import Stack, serve
from tests.media import data_url, make_image

IMAGES = 16
# Requests in flight at once: fewer than a fetcher's credits ([fetcher] credits, 8), so that even if every one
# ranks the same fetcher first it has room for them all. (With more, the freer fetcher takes the overflow and
# decodes those images itself, as it should: that would be load balance, not a lost memo.)
IN_FLIGHT = 6
FETCHERS = "count = 2\n"  # (extra lines of the [fetcher] section that stack_config writes)


@pytest.fixture(scope="module")
def two_fetchers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from serve(tmp_path_factory, "two-fetchers", FETCHERS)


def ask(client: OpenAI, model: str, image: Any) -> list[int]:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}}]}],
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return reply.choices[0].token_ids  # type: ignore[attr-defined]


def per_fetcher(stack: Stack, name: str) -> list[float]:
    metrics = stack.metrics()
    return [metrics.get(f'vlm_fetcher_{name}_total{{fetcher="{i}"}}', 0.0) for i in range(2)]


def decoded(stack: Stack) -> list[float]:
    """Items each fetcher decoded and resized (those it loaded without remembering them)."""
    loaded, remembered = per_fetcher(stack, "items_loaded"), per_fetcher(stack, "items_remembered")
    return [a - b for a, b in zip(loaded, remembered, strict=True)]


def test_both_fetchers_work_and_a_resent_image_finds_the_one_that_remembers_it(two_fetchers: Stack) -> None:
    with urllib.request.urlopen(two_fetchers.base_url + "/health", timeout=10) as r:
        assert json.loads(r.read())["fetchers"] == 2
    client = OpenAI(base_url=two_fetchers.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    images = [make_image(112 + 28 * (i % 3), 112, seed=7000 + i) for i in range(IMAGES)]
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        first = list(pool.map(lambda image: ask(client, model, image), images))
    first_decoded = decoded(two_fetchers)
    assert sum(first_decoded) == IMAGES and min(first_decoded) > 0  # the images spread over both fetchers
    with ThreadPoolExecutor(IN_FLIGHT) as pool:  # again, in the other order
        again = list(pool.map(lambda image: ask(client, model, image), images[::-1]))
    assert again[::-1] == first
    assert decoded(two_fetchers) == first_decoded  # none decoded a second time
    assert sum(per_fetcher(two_fetchers, "items_remembered")) == IMAGES
