"""An FP8 checkpoint through the whole stack: ``./ops/serve`` on a tiny Qwen2.5-VL checkpoint in Qwen's block-wise
FP8 format (vision blocks quantized too) answers the ``openai`` client with transformers' greedy tokens on the same
weights dequantized; a checkpoint of another quantization format stops the launcher before supervisord, by name."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from benchmarks.gateway_load import free_port
from benchmarks.hf_chat import HfChat
from tests.integration.conftest import REPO, Stack, serve, stack_config
from tests.integration.test_chat_parity import check_parity, image_part
from tests.media import data_url, make_image
from workers.models.synth import generate_checkpoint


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fp8") / "qwen2_5_vl-fp8-block"
    return generate_checkpoint(root, "tiny", 0, family="qwen2_5_vl", quantization="fp8-block")


@pytest.fixture(scope="module")
def stack(fp8_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from serve(tmp_path_factory, "fp8", f'[model]\npath = "{fp8_model}"\nquantization = "auto"\n')


@pytest.fixture(scope="module")
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf(fp8_model: Path) -> HfChat:
    reference = HfChat(fp8_model)  # (transformers' own FP8 loader, dequantizing on the CPU)
    assert reference.fp8_dequantized
    return reference


def test_fp8_checkpoint_answers_as_transformers_on_the_same_checkpoint(client: OpenAI, hf: HfChat) -> None:
    check_parity(client, hf, [{"role": "user", "content": "Write a haiku about the sea."}])
    content: list[dict[str, Any]] = [
        image_part(data_url(make_image(120, 90, seed=1))),
        {"type": "text", "text": "What is in this picture?"},
    ]
    check_parity(client, hf, [{"role": "user", "content": content}])


def test_serve_refuses_an_unsupported_quantization_before_supervisord(tmp_path: Path) -> None:
    model = generate_checkpoint(tmp_path / "awq", "tiny", 0, family="qwen2_5_vl")
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (model / "config.json").write_text(json.dumps(config))
    settings = stack_config(tmp_path, free_port())
    settings.write_text(f'run_dir = "{tmp_path / "run"}"\n' + settings.read_text())
    command = [sys.executable, "-m", "ops.cli", "serve", str(model), "--config", str(settings)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "quantization_config quant_method 'awq' is not supported" in done.stderr, done.stderr
    assert "compressed-tensors FP8 W8A8" in done.stderr, done.stderr
    assert not (tmp_path / "run" / "supervisord.conf").exists()  # stopped before supervisord was started
