"""Tensor parallel size 2 with gloo on this CPU, through the whole stack: rank 0 (the decoder worker)
and rank 1 (``decoder-rank-1``) each hold half of the heads, the MLP and the vocabulary, and the answers
are transformers' own — the same greedy tokens as size 1 gives (tests/integration/test_chat_parity.py), on the
Qwen2-VL demo checkpoint and on the tiny Qwen2.5-VL and Qwen3-VL ones."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from benchmarks.hf_chat import HfChat
from common.config import load_config
from tests.integration.conftest import Stack, serve
from tests.integration.test_chat_parity import check_parity, image_part
from tests.integration.test_faults import ANSWER_BOUND_S, one_request, requests_through_a_kill, wait_restarted
from tests.media import data_url, make_image

TP2 = "[decoder]\ntensor_parallel = 2\ntp_timeout_s = 30.0\n"


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from serve(tmp_path_factory, "tp2", TP2)


# (function-scoped: up and down before the module's Qwen2-VL stack starts, one stack at a time)
@pytest.fixture(params=["qwen2_5_vl", "qwen3_vl"])
def tp2_family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Callable[[str], Path]
) -> Iterator[Stack]:
    family: str = request.param
    yield from serve(tmp_path_factory, f"tp2-{family}", f'[model]\npath = "{tiny_checkpoint(family)}"\n{TP2}')


def test_tensor_parallel_2_answers_like_transformers_on_each_family(
    tp2_family: Stack, request: pytest.FixtureRequest
) -> None:
    """Each rank's shard is the family's language model: Qwen2.5-VL's (its windowed tower runs on the encoder),
    Qwen3-VL's (q/k norm per head; each image's DeepStack sets broadcast to rank 1 beside its rows)."""
    answers_like_transformers(tp2_family, request.node.callspec.params["tp2_family"])


def test_tensor_parallel_2_answers_like_transformers(tp2: Stack) -> None:
    answers_like_transformers(tp2, "qwen2_vl")


def answers_like_transformers(stack: Stack, model_type: str) -> None:
    """A text prompt, then two images of different sizes: greedy tokens equal transformers' generate."""
    assert stack.pid("decoder-rank-1") > 0
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    hf = HfChat(load_config(stack.config_path).model_path())
    assert hf.model.config.model_type == model_type
    check_parity(client, hf, [{"role": "user", "content": "Write a haiku about the sea."}])
    pictures = [
        image_part(data_url(make_image(200, 60, seed=22))),
        {"type": "text", "text": "Compare this one"},
        image_part(data_url(make_image(64, 256, seed=23))),
        {"type": "text", "text": "with that one."},
    ]
    system = {"role": "system", "content": "You compare pictures."}
    check_parity(client, hf, [system, {"role": "user", "content": pictures}])


def test_losing_a_rank_fails_requests_cleanly_and_the_group_forms_again(tp2: Stack) -> None:
    """kill -9 of rank 1: rank 0's next collective fails, its requests end with an explained 5xx, it
    exits, supervisord restarts both, they meet in a new group and serve again."""
    client = OpenAI(base_url=tp2.base_url + "/v1", api_key="unused", max_retries=0, timeout=150)
    model = client.models.list().data[0].id
    victim = tp2.pid("decoder-rank-1")
    outcomes, _ = requests_through_a_kill(client, model, victim, [300 + i for i in range(6)])
    assert all(elapsed < ANSWER_BOUND_S for _, elapsed, _ in outcomes), outcomes
    wait_restarted(tp2, "decoder-rank-1", victim, timeout_s=120)
    deadline = time.monotonic() + 120
    while True:  # rank 0 restarts too; until the new group is up, requests get an explained 503
        outcome, _, _ = one_request(client, model, seed=999)
        if outcome.startswith("ok:") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert outcome.startswith("ok:"), outcome
