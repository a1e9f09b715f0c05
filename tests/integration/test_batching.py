"""The decoder under load, through the real stack: batching, prefix cache and preemption never change
greedy outputs; the prefix cache's savings show in /metrics."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from benchmarks.hf_chat import HfChat
from common.config import load_config
from tests.integration.conftest import Stack, hand_started_stack
from tests.media import data_url, make_image


def client_for(base_url: str) -> OpenAI:
    return OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def greedy_ids(client: OpenAI, messages: list[dict[str, Any]], tokens: int = 24) -> list[int]:
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,
        max_tokens=tokens,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return reply.choices[0].token_ids  # type: ignore[attr-defined]


def mixed_prompts(count: int) -> list[list[dict[str, Any]]]:
    """Half text of different lengths, half with one or two images of different sizes."""
    prompts = []
    for i in range(count):
        text = "Please describe " + "the scene in detail " * (1 + 3 * i)
        if i % 2:
            images = [make_image(48 + 16 * i, 64 + 8 * (i % 3), seed=100 + i)] * (1 + i % 3 // 2)
            parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
            prompts.append([{"role": "user", "content": [*parts, {"type": "text", "text": text}]}])
        else:
            prompts.append([{"role": "user", "content": text}])
    return prompts


def test_sixteen_concurrent_requests_equal_each_alone(stack: Stack) -> None:
    client = client_for(stack.base_url)
    prompts = mixed_prompts(16)
    alone = [greedy_ids(client, p) for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: greedy_ids(client, p), prompts))
    assert together == alone


def decoder_counter(stack: Stack, name: str, after: float | None = None, timeout_s: float = 5.0) -> float:
    """The decoder's counter from /metrics; with ``after``, wait until the next report has arrived."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = stack.metrics().get(f"vlm_decoder_{name}_total", 0.0)
        if after is None or value != after or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def test_prefix_cache_reuses_a_shared_system_prompt_and_image(stack: Stack, hf: HfChat) -> None:
    client = client_for(stack.base_url)
    block = load_config(stack.config_path).decoder.block_size
    image = {"type": "image_url", "image_url": {"url": data_url(make_image(140, 112, seed=501))}}
    other = {"type": "image_url", "image_url": {"url": data_url(make_image(140, 112, seed=502))}}
    system, pads = system_prompt_ending_a_block_among_the_image(hf, image, block)

    def ask(picture: dict[str, Any], question: str) -> tuple[list[int], float]:
        before = decoder_counter(stack, "prefix_hit_tokens")
        messages = [system, {"role": "user", "content": [picture, {"type": "text", "text": question}]}]
        ids = greedy_ids(client, messages)
        hf_ids, _ = hf.generate(messages, 24)
        assert ids == hf_ids  # reused KV gives the model's own answer
        return ids, decoder_counter(stack, "prefix_hit_tokens", after=before) - before

    ask(image, "What is this?")
    _, second_hit = ask(image, "Which colours dominate?")
    _, other_hit = ask(other, "Which colours dominate?")
    assert second_hit >= (pads[-1] + 1) // block * block  # the system prompt and the image, in whole blocks
    assert other_hit <= pads[0] // block * block  # the system prompt only: another image there never hits


def system_prompt_ending_a_block_among_the_image(
    hf: HfChat, image: dict[str, Any], block: int
) -> tuple[dict[str, str], list[int]]:
    """A system prompt after which a KV block of ``block`` tokens ends among the image's tokens (so reusing
    whole blocks up to the image's end takes some of its KV, which a block of the prompt alone would not);
    and the positions of the image's tokens."""
    pad = hf.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for extra in range(2 * block):
        system = {
            "role": "system",
            "content": "You are a careful assistant who studies pictures. " * 6 + "Look. " * extra,
        }
        ids = hf.inputs([system, {"role": "user", "content": [image, {"type": "text", "text": "?"}]}])["input_ids"]
        pads = [i for i, token in enumerate(ids[0].tolist()) if token == pad]
        if (pads[-1] + 1) // block * block > pads[0]:
            return system, pads
    raise AssertionError(f"no system prompt puts a block's end among the image's {len(pads)} tokens")


def answers_together(
    stack: Stack, root: Path, settings: str, prompts: list[list[dict[str, Any]]], tokens: int = 24
) -> tuple[list[list[int]], dict[str, float]]:
    """All ``prompts`` at once through a stack of the same model with ``settings``; their greedy ids, and the
    stack's /metrics once the decoder has reported every request finished."""
    model = load_config(stack.config_path).model_path()
    with hand_started_stack(root, model, settings) as base_url:
        client = client_for(base_url)
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: greedy_ids(client, p, tokens=tokens), prompts))
        hand = Stack(base_url, root / "vlm.toml", None)  # type: ignore[arg-type]
        deadline = time.monotonic() + 10  # the decoder reports with its heartbeat
        while (metrics := hand.metrics()).get("vlm_decoder_requests_finished_total", 0) < len(prompts):
            assert time.monotonic() < deadline, "the decoder's report never caught up"
            time.sleep(0.2)
    return answers, metrics


def test_preemption_under_a_tiny_kv_cache_keeps_every_answer(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    prompts = mixed_prompts(8)
    reference = [greedy_ids(client_for(stack.base_url), p, tokens=40) for p in prompts]
    # 32 blocks x 16 tokens: the 8 requests need about twice that at once.
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # k+v, layers, block, kv heads, head dim, fp32 (tiny model)
    settings = f"[decoder]\nkv_cache_bytes = {32 * per_block}\nblock_size = 16\n"
    answers, metrics = answers_together(stack, tmp_path_factory.mktemp("tiny-kv"), settings, prompts, tokens=40)
    assert answers == reference
    assert metrics.get("vlm_decoder_preemptions_total", 0) > 0, {k: v for k, v in metrics.items() if "decoder" in k}
    assert metrics["vlm_decoder_kv_blocks_capacity"] == 32


def test_steps_staged_ahead_keep_every_answer(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> None:
    """[decoder] overlap through the whole stack: steps with prefill chunks (a budget of 32 tokens) and
    arrivals staged before the previous step's tokens are read; 12 concurrent text and image requests give
    the answers each gives alone on the default stack."""
    prompts = mixed_prompts(12)
    reference = [greedy_ids(client_for(stack.base_url), p) for p in prompts]
    settings = "[decoder]\noverlap = true\nprefill_tokens_per_step = 32\n"
    answers, metrics = answers_together(stack, tmp_path_factory.mktemp("staged"), settings, prompts)
    assert answers == reference
    assert metrics.get("vlm_decoder_overlapped_mixed_steps_total", 0) > 0, metrics
