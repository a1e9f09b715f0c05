"""Sampling defaults from the checkpoint's generation_config.json, as vLLM applies them: a request that
leaves an option unset gets the checkpoint's value, one that sets it keeps its own. On a copy of the
demo checkpoint whose generation_config asks, as Qwen2-VL-Instruct's does, for top_k 1 and a
repetition penalty (3.0 here, so that it shows)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from openai import OpenAI

from benchmarks.hf_chat import HfChat
from common.config import load_config
from tests.integration.conftest import Stack, checkpoint_with_generation, hand_started_stack

MESSAGES = [{"role": "user", "content": "Write a few words about rivers and mountains."}]
SAMPLING = {"do_sample": True, "temperature": 0.01, "top_p": 0.001, "top_k": 1, "repetition_penalty": 3.0}


@pytest.fixture(scope="module")
def sampling_server(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("defaults-stack")
    model = checkpoint_with_generation(load_config(stack.config_path).model_path(), root / "model", SAMPLING)
    with hand_started_stack(root, model, "[cache]\npool_bytes = 16777216\n") as base_url:
        yield base_url


def ask(base_url: str, **options: Any) -> list[int]:
    client = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=MESSAGES,
        max_tokens=48,
        extra_body={"ignore_eos": True, "return_token_ids": True, **options.pop("extra_body", {})},
        **options,
    )
    return reply.choices[0].token_ids  # type: ignore[no-any-return]


def test_unset_options_take_the_checkpoints_defaults_as_transformers_does(sampling_server: str, hf: HfChat) -> None:
    inputs = hf.inputs(MESSAGES)
    with torch.inference_mode():  # transformers with the same settings (top_k 1: greedy, whatever the draw)
        out = hf.model.generate(**inputs, max_new_tokens=48, min_new_tokens=48, **SAMPLING)  # type: ignore[arg-type]
    expected = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert ask(sampling_server) == expected
    assert expected != ask(sampling_server, temperature=0, extra_body={"repetition_penalty": 1.0})  # it mattered


def test_options_a_request_sets_are_its_own(sampling_server: str) -> None:
    defaulted = ask(sampling_server)
    plain = ask(sampling_server, temperature=0, extra_body={"repetition_penalty": 1.0})
    assert plain != defaulted  # the penalty of 3.0 was the default's, and the request turned it off
    assert ask(sampling_server, extra_body={"repetition_penalty": 3.0}) == defaulted
