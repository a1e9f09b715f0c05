"""The decoder engine's scheduling: slots, the prefill budget, arrival order, and unchanged outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.protocol import PreparedRequest, SamplingParams
from workers.decoder.engine import Engine, PromptError
from workers.models.language import LanguageModel
from workers.models.spec import ModelSpec
from workers.models.synth import generate_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_checkpoint(tmp_path_factory.mktemp("engine") / "tiny", "tiny", seed=3)


@pytest.fixture(scope="module")
def parts(model_dir: Path) -> tuple[LanguageModel, ModelSpec]:
    return LanguageModel.from_checkpoint(model_dir, dtype=torch.float32), ModelSpec.from_dir(model_dir)


def request(rid: str, length: int, max_tokens: int = 6) -> PreparedRequest:
    ids = [(7 * i + len(rid)) % 5000 + 10 for i in range(length)]
    return PreparedRequest(rid, ids, [], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def run_to_end(engine: Engine) -> tuple[dict[str, list[int]], list[set[str]]]:
    tokens: dict[str, list[int]] = {}
    steps = []
    while engine.has_work():
        deltas = engine.step()
        steps.append({d.request_id for d in deltas})
        for d in deltas:
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
    return tokens, steps


def test_slots_and_prefill_budget(parts: tuple[LanguageModel, ModelSpec]) -> None:
    model, spec = parts
    engine = Engine(model, spec, max_model_len=4096, max_running=2, prefill_budget=100)
    for rid, length in (("a", 60), ("b", 60), ("c", 10)):
        engine.add(engine.prepare(request(rid, length)))
    tokens, steps = run_to_end(engine)
    assert steps[0] == {"a"}  # b would exceed the prefill budget this step
    assert steps[1] == {"a", "b"}  # and c has no slot while a and b run
    assert "c" not in set().union(*steps[:6])
    assert all(len(t) == 6 for t in tokens.values())


def test_batched_tokens_equal_solo_tokens(parts: tuple[LanguageModel, ModelSpec]) -> None:
    model, spec = parts
    requests = [request(f"r{i}", 5 + 9 * i, max_tokens=8) for i in range(5)]
    together = Engine(model, spec, 4096, max_running=3, prefill_budget=64)
    for r in requests:
        together.add(together.prepare(r))
    batched, _ = run_to_end(together)
    for r in requests:
        alone = Engine(model, spec, 4096, max_running=1, prefill_budget=4096)
        alone.add(alone.prepare(r))
        assert run_to_end(alone)[0][r.request_id] == batched[r.request_id]


def test_abort_removes_queued_and_running(parts: tuple[LanguageModel, ModelSpec]) -> None:
    model, spec = parts
    engine = Engine(model, spec, 4096, max_running=1, prefill_budget=4096)
    engine.add(engine.prepare(request("x", 8)))
    engine.add(engine.prepare(request("y", 8)))
    engine.step()
    assert engine.abort("x") and engine.abort("y")
    assert not engine.has_work() and not engine.abort("x")


def test_prompt_errors(parts: tuple[LanguageModel, ModelSpec]) -> None:
    model, spec = parts
    engine = Engine(model, spec, max_model_len=16, max_running=1, prefill_budget=64)
    with pytest.raises(PromptError, match="context is 16"):
        engine.prepare(request("long", 16))
    with pytest.raises(PromptError, match="empty"):
        engine.prepare(request("empty", 0))
    bad = PreparedRequest("bad", [spec.vocab_size + 5], [], SamplingParams(max_tokens=1))
    with pytest.raises(PromptError, match="token ids"):
        engine.prepare(bad)
