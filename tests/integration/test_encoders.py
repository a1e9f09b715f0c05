"""Encoder deployments other than the default: two encoders behind one fetcher (``[encoder] count = 2``,
both on this CPU) — the images of requests are spread over both, and killing one mid-flight hands its
jobs to the other; and the onnxruntime backend, whose answers must still equal transformers' (on the Qwen2-VL demo
checkpoint and on the tiny Qwen3-VL one, whose export carries the DeepStack sets)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from openai import OpenAI

from common.config import load_config
from tests.integration.conftest import Stack, serve
from tests.integration.test_faults import cache_gauges_settle
from tests.media import data_url, make_image


# Each stack serves one test: function-scoped, so that it stops before the next one starts, not at the module's end.
@pytest.fixture
def two_encoders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Few credits: a request's three images need both encoders.
    yield from serve(tmp_path_factory, "two-encoders", "[encoder]\ncount = 2\ncredits = 2\n")


@pytest.fixture
def small_batches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # 192 patches: the test video's 4 temporal patches of 12x8 go as 2 jobs of 2 (two encoders).
    yield from serve(tmp_path_factory, "small-batches", "[encoder]\ncount = 2\nmax_batch_patches = 192\n")


@pytest.fixture
def onnx_encoder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from serve(tmp_path_factory, "onnx-encoder", '[encoder]\nbackend = "onnxruntime"\n')


@pytest.fixture
def onnx_encoder_qwen3_vl(
    tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Callable[[str], Path]
) -> Iterator[Stack]:
    model = tiny_checkpoint("qwen3_vl")
    yield from serve(
        tmp_path_factory, "onnx-qwen3_vl", f'[model]\npath = "{model}"\n[encoder]\nbackend = "onnxruntime"\n'
    )


def images_encoded(stack: Stack, index: int) -> float:
    """Encoder ``index``'s count, from the gateway's /metrics (which asks each encoder)."""
    return stack.metrics()[f'vlm_encoder_images_encoded_total{{encoder="{index}"}}']


def ask(client: OpenAI, seed: int) -> str:
    content = [
        {"type": "image_url", "image_url": {"url": data_url(make_image(200, 160, seed=seed + k))}} for k in range(3)
    ]
    response = client.chat.completions.create(
        model=client.models.list().data[0].id,
        max_tokens=4,
        temperature=0,
        messages=[{"role": "user", "content": [*content, {"type": "text", "text": "Compare them."}]}],
    )
    return response.choices[0].finish_reason or ""


def test_images_spread_over_both_encoders_and_survive_losing_one(two_encoders: Stack) -> None:
    client = OpenAI(base_url=two_encoders.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    with ThreadPoolExecutor(6) as pool:
        assert all(list(pool.map(lambda i: ask(client, 100 * i), range(6))))
    first, second = images_encoded(two_encoders, 0), images_encoded(two_encoders, 1)
    assert first > 0 and second > 0 and first + second == 18, (first, second)

    victim = two_encoders.pid("encoder-1")
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(ask, client, 1000 + 100 * i) for i in range(6)]
        time.sleep(0.3)
        os.kill(victim, signal.SIGKILL)
        assert all(f.result(timeout=150) for f in futures)  # answered, not failed: re-issued jobs ran
    settled = cache_gauges_settle(two_encoders)
    assert settled["vlm_cache_leased_requests"] == 0 and settled["vlm_cache_pending_entries"] == 0, settled


def test_onnxruntime_backend_answers_like_transformers(onnx_encoder: Stack) -> None:
    answers_like_transformers_through_onnx(onnx_encoder, "qwen2_vl")


def test_onnxruntime_backend_answers_like_transformers_on_qwen3_vl(onnx_encoder_qwen3_vl: Stack) -> None:
    """The exported Qwen3-VL tower's one output holds the merged rows and the DeepStack sets, one cache entry."""
    answers_like_transformers_through_onnx(onnx_encoder_qwen3_vl, "qwen3_vl")


def answers_like_transformers_through_onnx(stack: Stack, model_type: str) -> None:
    from benchmarks.hf_chat import HfChat
    from tests.integration.test_chat_parity import check_parity, two_images_of_different_sizes

    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    hf = HfChat(load_config(stack.config_path).model_path())
    assert hf.model.config.model_type == model_type
    check_parity(client, hf, two_images_of_different_sizes(seed=12))
    exports = list((load_config(stack.config_path).run_path / "engines").glob("vision-*/model.onnx"))
    assert len(exports) == 1, exports  # the encoder ran the exported graph, not the torch tower


def test_a_long_video_encoded_in_chunks_answers_like_transformers(small_batches: Stack) -> None:
    from benchmarks.hf_chat import HfChat
    from benchmarks.media import data_url as media_url
    from benchmarks.media import jpeg_bytes, mjpeg_avi, video_frames
    from tests.integration.test_video import check_parity, video_part
    from workers.fetcher.video import VideoProcessorSpec

    client = OpenAI(base_url=small_batches.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model_path = load_config(small_batches.config_path).model_path()
    clip = mjpeg_avi([jpeg_bytes(f) for f in video_frames(160, 112, 16, seed=7)], 160, 112, 8)
    video = video_part(media_url(clip, "video/x-msvideo"), 4)
    messages = [{"role": "user", "content": [video, {"type": "text", "text": "?"}]}]
    check_parity(client, HfChat(model_path), VideoProcessorSpec.from_dir(model_path), messages)
    assert images_encoded(small_batches, 0) + images_encoded(small_batches, 1) == 2  # two parts, one video
