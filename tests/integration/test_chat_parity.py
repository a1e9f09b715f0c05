"""The server's answers through the real stack, checked against transformers on the same checkpoint."""

from __future__ import annotations

from typing import Any

from openai import OpenAI

from benchmarks.hf_chat import HfChat
from tests.integration.conftest import MediaServer, Stack
from tests.media import data_url, make_image, png_bytes

NEW_TOKENS = 32


def ask(client: OpenAI, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"min_tokens": NEW_TOKENS, "return_token_ids": True, **extra},
    )


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def two_images_of_different_sizes(seed: int) -> list[dict[str, Any]]:
    """A wide and a tall image in one user turn, text around them."""
    content = [
        image_part(data_url(make_image(200, 60, seed=seed))),
        {"type": "text", "text": "Compare this one"},
        image_part(data_url(make_image(64, 256, seed=seed + 1))),
        {"type": "text", "text": "with that one."},
    ]
    return [{"role": "user", "content": content}]


def check_parity(client: OpenAI, hf: HfChat, messages: list[dict[str, Any]]) -> Any:
    response = ask(client, messages)
    expected, prompt_len = hf.generate(messages, NEW_TOKENS)
    choice = response.choices[0]
    assert choice.token_ids == expected
    assert response.usage.prompt_tokens == prompt_len  # image tokens included, as transformers counts them
    assert response.usage.completion_tokens == NEW_TOKENS
    assert choice.finish_reason == "length"
    assert choice.message.content == hf.tokenizer.decode(expected, skip_special_tokens=True)
    return response


def test_text_only(client: OpenAI, hf: HfChat) -> None:
    check_parity(client, hf, [{"role": "user", "content": "Write a haiku about the sea."}])


def test_system_prompt_and_one_image(client: OpenAI, hf: HfChat) -> None:
    messages = [
        {"role": "system", "content": "You describe pictures."},
        {
            "role": "user",
            "content": [
                image_part(data_url(make_image(120, 90, seed=1))),
                {"type": "text", "text": "What is in this picture?"},
            ],
        },
    ]
    response = check_parity(client, hf, messages)
    assert response.usage.prompt_tokens > 30  # the image's tokens are counted, not one placeholder


def test_two_images_of_different_sizes(client: OpenAI, hf: HfChat) -> None:
    check_parity(client, hf, two_images_of_different_sizes(seed=2))


def test_image_by_http_url(client: OpenAI, hf: HfChat, media_server: MediaServer) -> None:
    url = media_server.put("photo.png", png_bytes(make_image(160, 120, seed=4)))
    check_parity(client, hf, [{"role": "user", "content": [image_part(url), {"type": "text", "text": "Describe."}]}])


def test_three_turns_run_the_vit_once(client: OpenAI, hf: HfChat, stack: Stack) -> None:
    before = stack.metrics()
    image = data_url(make_image(96, 128, seed=5))
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [image_part(image), {"type": "text", "text": "What do you see?"}]}
    ]
    for follow_up in ("Tell me more.", "And the colours?", None):
        response = check_parity(client, hf, messages)
        if follow_up is None:
            break
        messages += [
            {"role": "assistant", "content": response.choices[0].message.content},
            {"role": "user", "content": follow_up},
        ]
    # A separate request about the same image is served from the cache too.
    check_parity(client, hf, [{"role": "user", "content": [image_part(image), {"type": "text", "text": "Again?"}]}])
    after = stack.metrics()
    assert (
        after["vlm_cache_commits_total"] - before["vlm_cache_commits_total"] == 1
    )  # one ViT run for one distinct image
    assert after["vlm_cache_hits_total"] - before["vlm_cache_hits_total"] >= 3
    # Every one of the four requests went through both media stages, and says how long each took.
    for stage in ("vlm_media_prepare_seconds", "vlm_media_wait_seconds"):
        assert after[f"{stage}_count"] - before.get(f"{stage}_count", 0.0) == 4, stage
        assert after[f"{stage}_sum"] > before.get(f"{stage}_sum", 0.0), stage


def test_streaming_chunks_usage_and_done(client: OpenAI, hf: HfChat) -> None:
    messages = [
        {
            "role": "user",
            "content": [image_part(data_url(make_image(80, 80, seed=6))), {"type": "text", "text": "Stream it."}],
        }
    ]
    expected, prompt_len = hf.generate(messages, NEW_TOKENS)
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,
        max_tokens=NEW_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"min_tokens": NEW_TOKENS},
    )
    chunks = list(stream)  # the client stops at [DONE]; a missing [DONE] would hang and time out
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == hf.tokenizer.decode(expected, skip_special_tokens=True)
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_len, NEW_TOKENS)


def test_models_and_health(stack: Stack) -> None:
    status, body = stack.get_json("/v1/models")
    assert status == 200 and body["data"][0]["object"] == "model"
    status, body = stack.get_json("/health")
    assert status == 200 and body["decoder"] and body["fetchers"] >= 1 and body["encoders"] >= 1
