"""Grammar-constrained rows on the GPU engine: CUDA graphs (decode and mixed) and overlapped steps on, some rows
of a batch constrained to JSON schemas and the others free. The constrained answers parse and validate (random
weights: only the grammar can make them valid); the free rows' greedy tokens equal those of the same engine
with no constrained row beside them; preemption resumes each matcher where it was, and seeded choices of one
grammar (what ``n`` fans out to) give the same tokens. Needs a CUDA GPU and triton (skipped otherwise)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from benchmarks.schemas import CASES, SchemaCase
from common.protocol import PreparedRequest, SamplingParams
from gateway.structured import json_schema_grammar
from tests.gpu.test_kernels_gpu import _SKIP_REASON
from workers.decoder.config import EngineConfig
from workers.decoder.engine import Engine
from workers.decoder.grammar import Grammars
from workers.kernels import paged_attention
from workers.models.language import LanguageModel
from workers.models.spec import ModelSpec
from workers.models.synth import generate_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")]

CUDA = torch.device("cuda")
# Graphs for decode and mixed steps, prefill chunks (budget 96) staged beside decodes, fused Triton layers.
FAST = {"attention": paged_attention, "fuse": True, "graphs": "cuda", "graph_tokens": 128, "overlap": True}
Outputs = dict[str, tuple[list[int], str | None]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_checkpoint(tmp_path_factory.mktemp("grammar-gpu") / "tiny", "tiny", seed=5)


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> LanguageModel:
    # fp32: the constrained rows change the batches' heights, and bf16 may round a near-tie the other way
    # at another height (the free rows' parity is about the mask, not about rounding).
    return LanguageModel.from_checkpoint(checkpoint, device=CUDA, dtype=torch.float32)


def engine(checkpoint: Path, model: LanguageModel, **overrides: object) -> Engine:
    spec = ModelSpec.from_dir(checkpoint)
    grammars = Grammars.for_checkpoint(checkpoint, spec.vocab_size, spec.eos_token_ids)
    assert grammars is not None
    options = {"max_model_len": 2048, "max_running": 16, "prefill_budget": 96, "num_blocks": 256, "block_size": 16}
    options.update(FAST)
    options.update(overrides)
    return Engine(model, spec, EngineConfig(**options), grammars=grammars)  # type: ignore[arg-type]


def prompt(i: int, length: int) -> list[int]:
    return [(13 * j + 7 * i) % 4000 + 10 for j in range(length)]


def free_requests() -> list[PreparedRequest]:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [PreparedRequest(f"free{i}", prompt(i, 7 + 29 * i), [], params) for i in range(6)]


def constrained(rid: str, case: SchemaCase, i: int, length: int = 40, **sampling: object) -> PreparedRequest:
    base = SamplingParams(max_tokens=400, temperature=0.0, grammar=json_schema_grammar(case.schema))
    return PreparedRequest(rid, prompt(100 + i, length), [], dataclasses.replace(base, **sampling))  # type: ignore[arg-type]


def run(engine: Engine, requests: list[PreparedRequest]) -> Outputs:
    for request in requests:
        engine.add(engine.prepare(request))
    out: Outputs = {}
    while engine.has_work():
        for delta in engine.step():
            tokens, _ = out.get(delta.request_id, ([], None))
            out[delta.request_id] = (tokens + delta.token_ids, delta.finish_reason)
        assert not engine.take_failed()
    return out


def check_answers(checkpoint: Path, out: Outputs, cases: dict[str, SchemaCase]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    for rid, case in cases.items():
        tokens, finish = out[rid]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        assert finish == "stop", (rid, text)
        jsonschema.validate(json.loads(text), case.schema)


def test_constrained_rows_validate_and_free_rows_keep_their_greedy_tokens(
    checkpoint: Path, model: LanguageModel
) -> None:
    cases = {f"json{i}": case for i, case in enumerate(CASES)}
    requests = [
        constrained(rid, case, i, **({"temperature": 1.0, "seed": i} if i % 2 else {}))
        for i, (rid, case) in enumerate(cases.items())
    ]
    mixed_engine = engine(checkpoint, model)
    mixed = run(mixed_engine, [*requests, *free_requests()])
    alone = run(engine(checkpoint, model), free_requests())
    assert mixed_engine.counters["graph_steps"] >= 10 and mixed_engine.counters["overlapped_steps"] >= 10
    for request in free_requests():
        assert mixed[request.request_id] == alone[request.request_id], request.request_id
        assert len(mixed[request.request_id][0]) == 24
    check_answers(checkpoint, mixed, cases)


def test_preemption_resumes_the_matchers(checkpoint: Path, model: LanguageModel) -> None:
    """Four seeded choices of one schema at temperature 1 (as ``n`` fans out) and two free rows, first with
    room, then in a KV cache so small that sequences are preempted and prefilled again: the same tokens, all
    valid. (Prompts of their own: a shared prompt's blocks would be shared, and nothing preempted.)"""
    case = CASES[0]
    choices = [constrained(f"n{i}", case, i, length=150, temperature=1.0, seed=i) for i in range(4)]
    requests = [*choices, *free_requests()[:2]]
    roomy = run(engine(checkpoint, model), requests)
    tight_engine = engine(checkpoint, model, num_blocks=40)  # one whole sequence (150 + 400 tokens) still fits
    tight = run(tight_engine, requests)
    assert tight_engine.counters["preemptions"] > 0
    assert tight == roomy
    check_answers(checkpoint, tight, {request.request_id: case for request in choices})
