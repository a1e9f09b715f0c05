"""An item asked for again while the fetcher loads it is downloaded and preprocessed once: the n choices of
one request, and clients sending one URL at the same moment. (Sharing is per fetcher process: the test
stack has one.) The media server answers /slow/ paths late, so that the requests surely overlap."""

from __future__ import annotations

import threading
from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.integration.conftest import MediaServer
from tests.media import make_image, png_bytes


def ask(client: OpenAI, url: str, **options: Any) -> Any:
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}],
            }
        ],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
        **options,
    )


def test_n_choices_download_their_image_once(client: OpenAI, media_server: MediaServer) -> None:
    media_server.put("shared-by-choices.png", png_bytes(make_image(64, 48, seed=31)))
    reply = ask(client, media_server.slow_url("shared-by-choices.png"), n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in reply.choices}) == 1  # greedy: the same image gives the same answer
    assert media_server.hits["/slow/shared-by-choices.png"] == 1


def test_clients_at_once_share_one_download(client: OpenAI, media_server: MediaServer) -> None:
    media_server.put("shared-by-clients.png", png_bytes(make_image(56, 64, seed=32)))
    url = media_server.slow_url("shared-by-clients.png")
    model = client.models.list().data[0].id  # (asked once here, not by each thread)
    start = threading.Barrier(4)
    answers: list[tuple[int, ...]] = []

    def one_client() -> None:
        start.wait()
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        answers.append(tuple(reply.choices[0].token_ids))

    threads = [threading.Thread(target=one_client) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(answers) == 4 and len(set(answers)) == 1
    assert media_server.hits["/slow/shared-by-clients.png"] == 1


def test_a_failed_shared_download_fails_every_choice_once(client: OpenAI, media_server: MediaServer) -> None:
    with pytest.raises(openai.BadRequestError, match="HTTP 404"):
        ask(client, media_server.slow_url("never-put.png"), n=2)
    assert media_server.hits["/slow/never-put.png"] == 1
