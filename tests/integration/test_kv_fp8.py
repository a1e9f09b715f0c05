"""``[decoder] kv_cache_dtype = "fp8"`` through the whole stack (CPU: the dequantizing reference): the ``openai``
client gets answers, the same one twice (the second read from the prefix cache's FP8 blocks), and the decoder's
cache holds the blocks an FP8 block's bytes give: more than three times the CPU's fp32 blocks on the tiny model.

The answers are not compared with the plain cache's: FP8 moves the logits, and the tiny model's random weights
leave top tokens close enough for that to change a greedy pick (tests/unit/test_kv_fp8.py bounds the logits)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from openai import OpenAI

from tests.integration.conftest import Stack, serve

BLOCK = 16
PLAIN_BLOCK = 2 * 2 * BLOCK * 2 * 16 * 4  # k+v, layers, block, kv heads, head dim, fp32 (the tiny model)
FP8_BLOCK = 2 * 2 * BLOCK * 2 * (16 + 4)  # a byte an element, and a 4-byte scale per (token, kv head)
BUDGET = 64 * PLAIN_BLOCK


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = f'[decoder]\nkv_cache_dtype = "fp8"\nkv_cache_bytes = {BUDGET}\nblock_size = {BLOCK}\n'
    yield from serve(tmp_path_factory, "kv-fp8", settings)


def test_an_fp8_kv_cache_serves_with_its_larger_capacity(stack: Stack) -> None:
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    model = client.models.list().data[0].id
    answers = []
    for _ in range(2):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage is not None and reply.usage.completion_tokens > 0
        answers.append(reply.choices[0].message.content)
    assert answers[0] == answers[1]
    blocks = BUDGET // FP8_BLOCK
    assert blocks > 3 * (BUDGET // PLAIN_BLOCK)
    deadline = time.monotonic() + 10  # the decoder reports with its heartbeat
    while (metrics := stack.metrics()).get("vlm_decoder_kv_blocks_capacity") != blocks:
        assert time.monotonic() < deadline, {k: v for k, v in metrics.items() if "kv" in k}
        time.sleep(0.2)
    log = next((stack.run_dir / "logs").glob("decoder*.log")).read_text()
    assert f"KV cache: {blocks} blocks of {BLOCK} tokens" in log and "float8_e4m3fn" in log, log[-2000:]
