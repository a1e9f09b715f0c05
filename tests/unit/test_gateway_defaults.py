"""``gateway/defaults.py``: the checkpoint's sampling defaults, read and applied to unset options."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.defaults import sampling_defaults, with_defaults
from gateway.schema import parse_chat_request, parse_completion_request

QWEN2_VL_INSTRUCT = {  # generation_config.json as Qwen2-VL-7B-Instruct ships it
    "bos_token_id": 151643,
    "pad_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "repetition_penalty": 1.05,
    "temperature": 0.01,
    "top_p": 0.001,
    "top_k": 1,
    "transformers_version": "4.41.2",
}


def checkpoint(tmp_path: Path, generation: object) -> Path:
    text = generation if isinstance(generation, str) else json.dumps(generation)
    (tmp_path / "generation_config.json").write_text(text)
    return tmp_path


def test_the_sampling_keys_are_read(tmp_path: Path) -> None:
    defaults = sampling_defaults(checkpoint(tmp_path, {**QWEN2_VL_INSTRUCT, "max_new_tokens": 512}))
    assert defaults == {"repetition_penalty": 1.05, "temperature": 0.01, "top_p": 0.001, "top_k": 1, "max_tokens": 512}


def test_values_no_request_could_send_are_left_out(tmp_path: Path) -> None:
    bad = {"temperature": 7.0, "top_p": 1.5, "top_k": -1, "repetition_penalty": 1.1, "max_new_tokens": 0}
    assert sampling_defaults(checkpoint(tmp_path, bad)) == {"repetition_penalty": 1.1}


def test_no_file_or_a_broken_one_gives_no_defaults(tmp_path: Path) -> None:
    assert sampling_defaults(tmp_path) == {}
    assert sampling_defaults(checkpoint(tmp_path, "{not json")) == {}


def test_a_request_keeps_what_it_sets_and_takes_the_rest() -> None:
    defaults = {"temperature": 0.01, "top_k": 1, "repetition_penalty": 1.05, "max_tokens": 512}
    request = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0})
    applied = with_defaults(request, defaults)
    assert (applied.temperature, applied.top_k, applied.repetition_penalty) == (1.0, 1, 1.05)
    assert applied.token_limit == 512
    newer = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7})
    assert with_defaults(newer, defaults).token_limit == 7  # max_completion_tokens is the request's limit
    assert with_defaults(request, {}) is request


def test_the_token_limit_is_the_requests_then_the_checkpoints() -> None:
    """/v1/completions without max_tokens: OpenAI's 16, whatever the checkpoint says; null: the checkpoint's.
    Chat with max_tokens null: the checkpoint's."""
    defaults = {"max_tokens": 512}
    assert with_defaults(parse_completion_request({"prompt": "hi"}), defaults).token_limit == 16
    assert with_defaults(parse_completion_request({"prompt": "hi"}), {}).token_limit == 16
    assert with_defaults(parse_completion_request({"prompt": "hi", "max_tokens": None}), defaults).token_limit == 512
    assert with_defaults(parse_completion_request({"prompt": "hi", "max_tokens": None}), {}).token_limit is None
    chat = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "max_tokens": None})
    assert with_defaults(chat, defaults).token_limit == 512
