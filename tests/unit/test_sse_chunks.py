"""The gateway's SSE chunks: the per-token fast path splices a text delta into a pre-rendered head, and must
give exactly the bytes of ``json.dumps`` of the chunk's body, for both flavours and any text."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

from gateway.app import CHAT, TEXT, Flavor, SseWriter

TEXTS = ["", "Hello", " world", 'quote " and \\ backslash', "line\nbreak\ttab", "é 日本語 🙂", "\u2028", "\x00\x1f"]


def expected(writer: SseWriter, choice: dict[str, Any], usage_null: bool = False) -> bytes:
    """OpenAI's chunk, written out by hand: the id, object, created, model and fingerprint, the one choice, and
    with include_usage a null usage."""
    header = {"id": writer.completion_id, "object": writer.flavor.chunk_object, "created": writer.created}
    body = {**header, "model": writer.model, "system_fingerprint": None, "choices": [choice]}
    return f"data: {json.dumps(body | ({'usage': None} if usage_null else {}))}\n\n".encode()


@pytest.mark.parametrize("flavor", [CHAT, TEXT], ids=["chat", "text"])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish", [None, "stop", "length"])
@pytest.mark.parametrize("index", [0, 3])
@pytest.mark.parametrize("usage_null", [False, True])
def test_text_chunks_are_the_bytes_of_json_dumps(
    flavor: Flavor, text: str, finish: str | None, index: int, usage_null: bool
) -> None:
    writer = SseWriter(web.StreamResponse(), 'chatcmpl-"odd"-id', 'model/with "quotes" é', flavor, usage_null)
    fast = writer.encode_chunk(index, text, finish, {})
    delta = ({"delta": {"content": text} if text else {}}) if flavor is CHAT else {"text": text}
    choice = {"index": index, **delta, "finish_reason": finish, "logprobs": None}
    assert fast == expected(writer, choice, usage_null)
    assert writer.encode_chunk(index, text, finish, {"token_ids": [1]}) == expected(
        writer, {**choice, "token_ids": [1]}, usage_null
    )
    body = json.loads(fast.decode().removeprefix("data: "))
    assert body["choices"][0]["finish_reason"] == finish
    assert (body["choices"][0]["delta"].get("content", "") if flavor is CHAT else body["choices"][0]["text"]) == text


def test_role_deltas_and_extra_fields_take_the_general_path() -> None:
    writer = SseWriter(web.StreamResponse(), "chatcmpl-1", "m", CHAT)
    role = {"role": "assistant", "content": ""}
    first = {"index": 0, "delta": role, "finish_reason": None, "logprobs": None}
    assert writer.encode_chunk(0, role, None, {}) == expected(writer, first)
    extra = {"token_ids": [1, 2], "logprobs": {"content": []}}
    last = {"index": 1, "delta": {"content": "hi"}, "finish_reason": "stop", "logprobs": {"content": []}}
    last["token_ids"] = [1, 2]
    assert writer.encode_chunk(1, "hi", "stop", extra) == expected(writer, last)
