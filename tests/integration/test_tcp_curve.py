"""The whole stack with every hub on tcp:// (loopback) under CurveZMQ, keys from `vlm-serve keys`: the same greedy
answers as over ipc://, text and image, streamed and not. Its encoder, on a tcp:// endpoint, sends the embeddings
back by value (as one on another host must), and the cache daemon writes them: the same answers say the same rows."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth
from openai import OpenAI

from common.config import load_config
from common.protocol import StatsRequest, encode
from common.security import public_key_path
from tests.integration.conftest import CURVE_HUBS, MediaServer, Stack
from tests.media import make_image, png_bytes


def answer(stack: Stack, content: Any, stream: bool) -> str:
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    args: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 12}
    if not stream:
        return client.chat.completions.create(**args, temperature=0).choices[0].message.content or ""
    chunks = client.chat.completions.create(**args, temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tcp_and_curve_answer_as_ipc(curve_stack: Stack, stack: Stack, media_server: MediaServer, stream: bool) -> None:
    url = media_server.put("curve.png", png_bytes(make_image(140, 112, seed=31)))
    written = curve_stack.metrics().get("vlm_cache_writes_total", 0.0)
    for content in (
        "Say something about the sea.",
        [{"type": "text", "text": "What is in it?"}, {"type": "image_url", "image_url": {"url": url}}],
    ):
        assert answer(curve_stack, content, stream) == answer(stack, content, stream)
    if not stream:  # (the streamed run finds the image's embedding in the cache already)
        assert curve_stack.metrics()["vlm_cache_writes_total"] == written + 1
    assert stack.metrics()["vlm_cache_writes_total"] == 0  # over ipc:// the encoder writes into the slot itself
    assert listening(Path(stack.run_dir) / "cache.sock")  # (the probe sees the ipc:// stack's hub)
    bound_on_ipc = [hub for hub in CURVE_HUBS if listening(Path(curve_stack.run_dir) / f"{hub}.sock")]
    assert not bound_on_ipc, f"hubs bound on ipc:// after all: {bound_on_ipc}"


def listening(path: Path) -> bool:
    """Whether a process listens on the unix socket ``path`` (a run directory keeps the files of earlier stacks on
    its port)."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
        return True


def test_a_client_with_an_unknown_key_is_turned_away_and_counted(curve_stack: Stack) -> None:
    cfg = load_config(curve_stack.config_path)
    server_key, _ = zmq.auth.load_certificate(str(public_key_path(cfg.keys_path, "cache")))
    before = curve_stack.metrics().get("vlm_cache_security_denied_total", 0.0)
    ctx = zmq.Context()
    try:
        stranger = ctx.socket(zmq.DEALER)
        stranger.linger = 0
        stranger.curve_publickey, stranger.curve_secretkey = zmq.curve_keypair()
        stranger.curve_serverkey = server_key
        stranger.connect(cfg.endpoint("cache"))
        stranger.send(encode(StatsRequest("stranger")))
        assert not stranger.poll(1000)  # no answer: the frame never reached the daemon
    finally:
        ctx.destroy(linger=0)
    assert curve_stack.metrics()["vlm_cache_security_denied_total"] > before
