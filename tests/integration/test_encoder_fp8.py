"""``[encoder] quantization = "fp8"`` through the whole stack: ``./ops/serve`` on a tiny (unquantized) Qwen2.5-VL
checkpoint with the vision tower's linear layers quantized to FP8 at load answers an image request through the
``openai`` client with transformers' greedy tokens on the same checkpoint whose tower weights are those FP8 weights
dequantized (on CPU an FP8 layer computes exactly that: `workers.models.fp8.fp8_linear`)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from openai import OpenAI
from safetensors.torch import load_file, save_file

from benchmarks.hf_chat import HfChat
from tests.integration.conftest import Stack, serve
from tests.integration.test_chat_parity import check_parity, image_part
from tests.media import data_url, make_image
from workers.models.registry import checkpoint_family
from workers.models.vision_fp8 import serve_linears
from workers.models.weights import VISION_PREFIX, canonical_key


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Callable[[str], Path]) -> Path:
    return tiny_checkpoint("qwen2_5_vl")


@pytest.fixture(scope="module")
def stack(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from serve(tmp_path_factory, "encoder-fp8", f'[model]\npath = "{model}"\n[encoder]\nquantization = "fp8"\n')


def fp8_tower_copy(path: Path, out: Path) -> Path:
    """The checkpoint with each vision linear weight replaced by its load-time FP8 weight dequantized (fp32)."""
    shutil.copytree(path, out)
    tower = serve_linears(checkpoint_family(path).vision_tower(path, dtype=torch.float32), "fp8", torch.float32)
    dequantized = {
        VISION_PREFIX + name + ".weight": layer.fp8_weight().dequantize(torch.float32)
        for name, layer in tower.named_modules()
        if hasattr(layer, "fp8_weight")
    }
    replaced = 0
    for file in out.glob("*.safetensors"):
        tensors = load_file(str(file))
        for raw in tensors:
            if canonical_key(raw) in dequantized:
                tensors[raw] = dequantized[canonical_key(raw)]
                replaced += 1
        save_file(tensors, str(file), metadata={"format": "pt"})
    assert replaced == len(dequantized) > 0
    return out


def test_an_fp8_tower_answers_as_transformers_on_its_dequantized_weights(
    stack: Stack, model: Path, tmp_path: Path
) -> None:
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    hf = HfChat(fp8_tower_copy(model, tmp_path / "fp8-tower"))
    content: list[dict[str, Any]] = [
        image_part(data_url(make_image(120, 90, seed=1))),
        {"type": "text", "text": "What is in this picture?"},
    ]
    check_parity(client, hf, [{"role": "user", "content": content}])
    encoder_log = next((stack.run_dir / "logs").glob("encoder*.log")).read_text()
    assert "linear layers in FP8 ([encoder] quantization = 'fp8')" in encoder_log
