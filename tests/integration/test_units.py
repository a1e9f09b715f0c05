"""A deployment split in two units on one host, as on two (`./ops/serve --role`): an encoder unit runs two vision
encoders alone, bound on tcp:// under CurveZMQ; a pd unit (gateway, fetcher, cache daemon, decoder) dials them
there, and gets the embeddings back by value. The answers are the all-in-one stack's (text, image, streamed, three
turns), and a video cut in parts over both remote encoders answers as transformers does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from openai import OpenAI

from benchmarks.gateway_load import free_port
from tests.integration.conftest import REPO, STOPPING, MediaServer, Stack, serve, stack_config, wait_listening
from tests.media import make_image, png_bytes

# Small encoder batches: the video's four temporal patches go as two parts, one to each remote encoder.
ENCODERS = "count = 2\nmax_batch_patches = 192\n"


@pytest.fixture(scope="module")
def units(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The pd unit (its gateway is where clients go), with the encoder unit running beside it."""
    keys = tmp_path_factory.mktemp("unit-keys")
    subprocess.run([sys.executable, "-m", "ops.cli", "keys", "--dir", str(keys)], check=True, capture_output=True)
    ports = [free_port(), free_port()]
    shared = f'[security]\nkeys_dir = "{keys}"\n[encoder]\n{ENCODERS}[endpoints]\n' + "".join(
        f'"encoder.{k}" = "tcp://127.0.0.1:{port}"\n' for k, port in enumerate(ports)
    )
    STOPPING.reap("unit-encoder")
    run_port = STOPPING.free_port()  # (no gateway listens on it: it names the unit's run directory)
    config = stack_config(tmp_path_factory.mktemp("unit-encoder"), run_port, shared, 'role = "encoder"\n')
    (REPO / "run").mkdir(exist_ok=True)
    with open(REPO / "run" / "serve-unit-encoder.log", "wb") as log:
        encoder_unit = subprocess.Popen(
            [str(REPO / "ops/serve")], env={**os.environ, "VLM_CONFIG": str(config)}, stdout=log, stderr=log
        )
    try:
        for port in ports:
            wait_listening("127.0.0.1", port, encoder_unit)
        assert programs(Stack("", config, encoder_unit)) == {"encoder-0", "encoder-1"}
        for pd_unit in serve(tmp_path_factory, "unit-pd", shared, 'role = "pd"\n'):
            assert programs(pd_unit) == {"gateway", "fetcher-0", "cache", "decoder"}
            yield pd_unit
    finally:
        encoder_unit.send_signal(signal.SIGTERM)
        STOPPING.add("unit-encoder", run_port, encoder_unit)


def programs(unit: Stack) -> set[str]:
    """What the unit's supervisord runs (supervisorctl's names, without their group)."""
    return {line.split()[0].split(":")[-1] for line in unit.ctl("status").splitlines() if "RUNNING" in line}


def answer(stack: Stack, messages: list[dict[str, Any]], stream: bool = False) -> str:
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    args: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0}
    if not stream:
        return client.chat.completions.create(**args).choices[0].message.content or ""
    chunks = client.chat.completions.create(**args, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_pd_unit_with_remote_encoders_answers_as_the_whole_stack(
    units: Stack, stack: Stack, media_server: MediaServer
) -> None:
    url = media_server.put("unit.png", png_bytes(make_image(150, 120, seed=41)))
    image = {"type": "image_url", "image_url": {"url": url}}
    first = [{"role": "user", "content": [image, {"type": "text", "text": "What is in it?"}]}]
    assert answer(units, first) == answer(stack, first)
    assert units.metrics()["vlm_cache_writes_total"] >= 1  # (the embedding came back by value)
    assert answer(units, [{"role": "user", "content": "Say something about the sea."}], stream=True) == answer(
        stack, [{"role": "user", "content": "Say something about the sea."}], stream=True
    )
    turns = [*first, {"role": "assistant", "content": answer(stack, first)}]
    turns.append({"role": "user", "content": [image, {"type": "text", "text": "And now?"}]})
    turns += [{"role": "assistant", "content": answer(stack, turns)}, {"role": "user", "content": "Once more."}]
    assert answer(units, turns, stream=True) == answer(stack, turns, stream=True)


def test_a_video_cut_over_the_remote_encoders_answers_as_transformers(units: Stack) -> None:
    from benchmarks.hf_chat import HfChat
    from benchmarks.media import data_url, jpeg_bytes, mjpeg_avi, video_frames
    from common.config import load_config
    from tests.integration.test_encoders import images_encoded
    from tests.integration.test_video import check_parity, video_part
    from workers.fetcher.video import VideoProcessorSpec

    before = [images_encoded(units, k) for k in (0, 1)]
    client = OpenAI(base_url=units.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model_path = load_config(units.config_path).model_path()
    clip = mjpeg_avi([jpeg_bytes(f) for f in video_frames(160, 112, 16, seed=43)], 160, 112, 8)
    messages = [
        {"role": "user", "content": [video_part(data_url(clip, "video/x-msvideo"), 4), {"type": "text", "text": "?"}]}
    ]
    check_parity(client, HfChat(model_path), VideoProcessorSpec.from_dir(model_path), messages)
    assert [images_encoded(units, k) - b for k, b in zip((0, 1), before, strict=True)] == [1, 1]  # a part each
