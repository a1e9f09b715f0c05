"""The decoder's engine keeps nothing per step: its step graphs' static buffers carry no autograd history, so the
tensors alive after many requests are those alive after a few. (A model whose parameters required grad made every
mixed step's input embeddings, copied into the static buffer, one more link of an autograd graph that kept every
step's token ids alive: on the H200 the decoder's host memory grew ~7 KB a request, without end.)"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from common.protocol import PreparedRequest, SamplingParams
from workers.decoder.config import EngineConfig
from workers.decoder.engine import Engine
from workers.models.language import LanguageModel
from workers.models.spec import ModelSpec
from workers.models.synth import generate_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_checkpoint(tmp_path_factory.mktemp("engine-memory") / "tiny", "tiny", seed=5)


def serve(engine: Engine, first: int, count: int) -> None:
    """``count`` requests of different prompt and output lengths, at most 8 at a time, to the end."""
    made = first
    while made < first + count or engine.has_work():
        while made < first + count and len(engine.scheduler.running) + len(engine.scheduler.waiting) < 8:
            ids = [(13 * i + made) % 3000 + 10 for i in range(20 + 7 * (made % 11))]
            params = SamplingParams(max_tokens=1 + made % 9, temperature=0.0, ignore_eos=True)
            engine.add(engine.prepare(PreparedRequest(f"r{made}", ids, [], params)))
            made += 1
        engine.step()


def live_tensors() -> int:
    gc.collect()
    return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())


def test_loaded_models_require_no_grad(checkpoint: Path) -> None:
    model = LanguageModel.from_checkpoint(checkpoint, dtype=torch.float32)
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("overlap", [True, False])
def test_steps_through_the_static_graphs_leave_nothing_behind(checkpoint: Path, overlap: bool) -> None:
    model = LanguageModel.from_checkpoint(checkpoint, dtype=torch.float32)
    model.requires_grad_(True)  # (as a model built by hand would be: the runner must not depend on its loader)
    config = EngineConfig(
        max_model_len=512, max_running=8, prefill_budget=64, num_blocks=400, block_size=4, fuse=True,
        graphs="static", graph_tokens=64, overlap=overlap,
    )  # fmt: skip
    engine = Engine(model, ModelSpec.from_dir(checkpoint), config)
    serve(engine, 0, 10)
    before = live_tensors()
    serve(engine, 10, 40)
    assert engine.runner.graphs is not None and engine.runner.graphs.embeds.grad_fn is None
    assert live_tensors() <= before + 4  # (the leak kept one or more a step: hundreds here)
