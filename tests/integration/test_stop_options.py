"""``ignore_eos`` and ``min_tokens`` through the server, on a stack started process by process.

The end-of-sequence ids come from the checkpoint's own files. A copy of the demo checkpoint
whose generation_config names, as EOS, the very token the model emits first for our prompt makes
EOS certain — so each option visibly changes where generation stops.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from openai import OpenAI

from common.config import load_config
from tests.integration.conftest import Stack, checkpoint_with_generation, hand_started_stack

PROMPT = [{"role": "user", "content": "Count to ten, please."}]
PROCESSES = [
    ["workers.cache"],
    ["workers.encoder", "--gpu", "0"],
    ["workers.fetcher"],
    ["workers.decoder"],
    ["gateway"],
]


def first_token(stack: Stack) -> int:
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=PROMPT,
        max_tokens=1,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    return reply.choices[0].token_ids[0]  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def eos_server(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    eos = first_token(stack)
    root = tmp_path_factory.mktemp("eos-stack")
    source = load_config(stack.config_path).model_path()
    model = checkpoint_with_generation(source, root / "model", {"eos_token_id": [eos]})
    with hand_started_stack(root, model, "[cache]\npool_bytes = 16777216\n") as base_url:
        yield base_url, eos


def ask(base_url: str, **extra: Any) -> Any:
    client = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True, **extra},
    )


def test_eos_from_the_checkpoint_stops_generation(eos_server: tuple[str, int]) -> None:
    base_url, eos = eos_server
    reply = ask(base_url)
    assert reply.choices[0].token_ids == [eos]
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == 1


def test_ignore_eos_runs_to_max_tokens(eos_server: tuple[str, int]) -> None:
    base_url, eos = eos_server
    reply = ask(base_url, ignore_eos=True)
    assert reply.choices[0].token_ids[0] == eos  # EOS was produced, and generation went on
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 12


def test_min_tokens_holds_eos_back(eos_server: tuple[str, int]) -> None:
    base_url, eos = eos_server
    reply = ask(base_url, min_tokens=5)
    ids = reply.choices[0].token_ids
    assert eos not in ids[:5] and len(ids) >= 5
    assert reply.choices[0].finish_reason == ("stop" if ids[-1] == eos else "length")


def test_stop_token_ids_end_generation(eos_server: tuple[str, int]) -> None:
    base_url, _ = eos_server
    free_run = ask(base_url, ignore_eos=True).choices[0].token_ids
    reply = ask(base_url, ignore_eos=True, stop_token_ids=[free_run[3]])
    assert reply.choices[0].token_ids == free_run[: free_run.index(free_run[3]) + 1]
    assert reply.choices[0].finish_reason == "stop"
