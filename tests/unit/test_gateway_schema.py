"""The request schema's leniency where OpenAI's clients and vLLM are lenient: null options, short content parts;
and the paths its errors name."""

from __future__ import annotations

import pytest

from gateway.app import TO_THE_CONTEXTS_END, sampling_params
from gateway.errors import ApiError
from gateway.schema import ImagePart, TextPart, parse_chat_request, parse_completion_request

USER = {"role": "user", "content": "hi"}


def test_null_options_are_unset_and_null_max_tokens_keeps_its_meaning() -> None:
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None, "logprobs": None, "seed": None}
    chat = parse_chat_request({"messages": [USER], **nulls})
    assert (chat.temperature, chat.top_p, chat.n, chat.stream, chat.logprobs) == (1.0, 1.0, 1, False, False)
    assert chat.model_fields_set == {"messages", "seed"}  # (unset: the checkpoint's defaults may apply)
    assert parse_completion_request({"prompt": "hi"}).max_tokens == 16  # left out: OpenAI's default here
    assert parse_completion_request({"prompt": "hi", "max_tokens": None}).max_tokens is None  # null: no limit
    with pytest.raises(ApiError, match="messages"):
        parse_chat_request({"messages": None})


def test_without_a_limit_a_chat_request_runs_to_the_contexts_end() -> None:
    assert sampling_params(parse_chat_request({"messages": [USER]})).max_tokens == TO_THE_CONTEXTS_END
    assert sampling_params(parse_chat_request({"messages": [USER], "max_completion_tokens": 7})).max_tokens == 7


def test_short_content_parts_are_read_as_vllm_reads_them() -> None:
    parts = [{"image_url": "http://h/a.png"}, {"type": "image_url", "image_url": "http://h/b.png"}, {"text": "hi"}]
    content = parse_chat_request({"messages": [{"role": "user", "content": parts}]}).messages[0].content
    assert isinstance(content, list)
    assert [type(p) for p in content] == [ImagePart, ImagePart, TextPart]
    assert [p.image_url.url for p in content if isinstance(p, ImagePart)] == ["http://h/a.png", "http://h/b.png"]


@pytest.mark.parametrize(
    ("part", "param", "needle"),
    [
        ({"type": "image_url", "image_url": {"uri": "x"}}, "messages.0.content.0.image_url.url", "Field required"),
        ({"type": "text"}, "messages.0.content.0.text", "Field required"),
        ({"type": "video_url", "video_url": {"url": "x", "fps": -1}}, "messages.0.content.0.video_url.fps", "greater"),
        ({"kind": "image"}, "messages.0.content.0", "needs a type: 'text', 'image_url' or 'video_url'"),
        ({"type": "input_audio", "input_audio": {}}, "messages.0.content.0", "input_audio"),
    ],
)
def test_errors_name_the_field_as_the_client_wrote_it(part: dict, param: str, needle: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_chat_request({"messages": [{"role": "user", "content": [part]}]})
    assert caught.value.status == 400 and caught.value.param == param
    assert needle in caught.value.message
