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
CONTEXT = 96  # short, for a request without a limit to reach its end in moments (the prompt and 48 tokens fit)
SAMPLING = {"do_sample": True, "temperature": 0.01, "top_p": 0.001, "top_k": 1, "repetition_penalty": 3.0}


@pytest.fixture(scope="module")
def sampling_server(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("defaults-stack")
    model = checkpoint_with_generation(load_config(stack.config_path).model_path(), root / "model", SAMPLING)
    settings = f"[cache]\npool_bytes = 16777216\n[decoder]\nmax_model_len = {CONTEXT}\n"
    with hand_started_stack(root, model, settings) as base_url:
        yield base_url


def ask(base_url: str, **options: Any) -> list[int]:
    return reply(base_url, **options).choices[0].token_ids  # type: ignore[no-any-return]


def reply(base_url: str, **options: Any) -> Any:
    client = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=MESSAGES,
        max_tokens=options.pop("max_tokens", 48),
        extra_body={"ignore_eos": True, "return_token_ids": True, **options.pop("extra_body", {})},
        **options,
    )


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


def test_options_sent_as_null_are_unset(sampling_server: str) -> None:
    # The official client sends None as null; OpenAI's options are nullable, and null means "not set"
    nulls = {"temperature": None, "top_p": None, "n": None, "presence_penalty": None, "frequency_penalty": None}
    assert ask(sampling_server, **nulls, extra_body={"top_k": None, "repetition_penalty": None}) == ask(sampling_server)


def test_a_chat_request_without_a_limit_runs_to_the_contexts_end(sampling_server: str) -> None:
    unlimited = reply(sampling_server, max_tokens=None)
    assert unlimited.choices[0].finish_reason == "length"
    assert unlimited.usage.prompt_tokens + unlimited.usage.completion_tokens == CONTEXT
