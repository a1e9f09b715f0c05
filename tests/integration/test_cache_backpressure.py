"""A full embedding cache is backpressure: with a pool of four images' embeddings, 32 clients sending distinct
images at once all get their answers (the reservations that find no room wait for the others' leases to end);
only a request whose embeddings could never fit in the pool is refused, at once, with a 413 that says why."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.integration.conftest import Stack, serve
from tests.media import data_url, make_image

# The test checkpoint's embeddings: 64 float32 values a token; a 112x112 image is 16 tokens, 4 KiB.
IMAGE_BYTES = 16 * 64 * 4
POOL = f"[cache]\npool_bytes = {4 * IMAGE_BYTES}\nreserve_wait_s = 60.0\n"


@pytest.fixture(scope="module")
def small_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from serve(tmp_path_factory, "small-pool", POOL)


def ask(client: OpenAI, model: str, *images: Any) -> Any:
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}} for image in images]
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [*content, {"type": "text", "text": "What is it?"}]}],
        max_tokens=4,
        extra_body={"ignore_eos": True},
    )


def test_32_clients_with_distinct_images_all_complete_on_a_pool_of_four(small_pool: Stack) -> None:
    client = OpenAI(base_url=small_pool.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    images = [make_image(112, 112, seed=1000 + i) for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        replies = list(pool.map(lambda image: ask(client, model, image), images))
    assert [r.choices[0].finish_reason for r in replies] == ["length"] * 32
    metrics = small_pool.metrics()
    assert metrics["vlm_cache_full_total"] == 0
    assert metrics["vlm_cache_waited_total"] > 0  # the pool really was too small for them all at once
    assert metrics["vlm_cache_reservations_waiting"] == 0


def test_a_request_whose_embeddings_exceed_the_pool_gets_a_413(small_pool: Stack) -> None:
    client = OpenAI(base_url=small_pool.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    with pytest.raises(openai.APIStatusError) as raised:
        ask(client, model, make_image(448, 448, seed=7))  # 256 tokens: four times the pool
    error = raised.value
    assert error.status_code == 413
    assert error.code == "embeddings_too_large"
    assert f"need {16 * IMAGE_BYTES} B" in error.message and f"holds {4 * IMAGE_BYTES} B" in error.message
    assert "[cache] pool_bytes" in error.message and "max_pixels" in error.message
    assert ask(client, model, make_image(112, 112, seed=8)).choices[0].finish_reason == "length"  # still serving


def test_an_image_remembered_by_the_fetcher_but_evicted_from_the_pool_is_encoded_again(small_pool: Stack) -> None:
    """Turn 1's image, then enough other images to evict its embedding from the pool of four, then turn 1 again:
    the fetcher knows the image by its bytes (no decode, no resize) but the cache no longer holds its embedding,
    so it decodes it again for the encoder. The answer is the first one, token for token."""
    client = OpenAI(base_url=small_pool.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    image = make_image(112, 112, seed=4242)

    def greedy(picture: Any) -> list[int]:
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(picture)}}]}],
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return reply.choices[0].token_ids  # type: ignore[attr-defined]

    first = greedy(image)
    before = small_pool.metrics()
    for seed in range(5000, 5008):  # twice the pool's worth of other images
        greedy(make_image(112, 112, seed=seed))
    assert greedy(image) == first
    after = small_pool.metrics()
    counted = {
        name: after.get(f'vlm_fetcher_{name}_total{{fetcher="0"}}', 0.0)
        - before.get(f'vlm_fetcher_{name}_total{{fetcher="0"}}', 0.0)
        for name in ("items_remembered", "items_decoded_again")
    }
    assert counted == {"items_remembered": 1.0, "items_decoded_again": 1.0}
