"""Grammar-constrained decoding in the decoder: the sampler's bitmask on mixed rows, the per-sequence matcher
through the engine (overlap, preemption, n, seeds, min_tokens, ignore_eos), and its errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from common.protocol import PreparedRequest, SamplingParams
from common.transport import EventLoop
from gateway.structured import json_schema_grammar
from workers.decoder.config import EngineConfig
from workers.decoder.engine import Engine
from workers.decoder.grammar import GrammarCompiles, Grammars, allows_only
from workers.decoder.sampling import Sampled, SamplingRow, TokenMask, sample_batch
from workers.decoder.scheduler import PromptError
from workers.models.language import LanguageModel
from workers.models.spec import ModelSpec
from workers.models.synth import generate_checkpoint

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
        "home": {"$ref": "#/$defs/place"},
    },
    "required": ["name", "age", "home"],
    "additionalProperties": False,
    "$defs": {
        "place": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "zip": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["city"],
            "additionalProperties": False,
        }
    },
}


# --------------------------------------------------------------------------- the sampler's mask


def bitmask_allowing(allowed: list[list[int]], words: int) -> torch.Tensor:
    mask = torch.zeros(len(allowed), words * 32, dtype=torch.bool)
    for i, tokens in enumerate(allowed):
        mask[i, tokens] = True
    bits = mask.view(len(allowed), words, 32).to(torch.int64) << torch.arange(32)
    return bits.sum(-1).to(torch.int64).to(torch.int32)  # (wraps bit 31 into the sign, as llguidance's does)


def test_the_mask_changes_only_its_rows_and_forbids_what_it_leaves_out() -> None:
    torch.manual_seed(0)
    vocab = 100  # wider than the mask's 64 tokens: the tail is forbidden too
    logits = torch.randn(4, vocab)
    logits[1, 70] = logits[3, 99] = 50.0  # the best tokens of the constrained rows, outside the mask
    rows = [SamplingRow(temperature=0.0, top_logprobs=2) for _ in range(4)]
    mask = TokenMask([1, 3], bitmask_allowing([[5, 31, 63], [0, 40]], words=2))
    plain = sample_batch(logits, rows)
    masked = sample_batch(logits, rows, mask)
    for i in (0, 2):  # unconstrained rows: token and logprobs exactly as without any mask
        assert masked.token_ids[i] == plain.token_ids[i]
        assert masked.logprobs[i] == plain.logprobs[i]
        assert masked.top_logprobs[i] == plain.top_logprobs[i]
    assert masked.token_ids[1] == max((5, 31, 63), key=lambda t: logits[1, t].item())
    assert masked.token_ids[3] == max((0, 40), key=lambda t: logits[3, t].item())
    # logprobs of a constrained row: the distribution over what its grammar allows (as vLLM's)
    allowed = torch.tensor([0, 40])
    expected = torch.log_softmax(logits[3, allowed], dim=0).max().item()
    assert masked.logprobs[3] == pytest.approx(expected, abs=1e-5)
    assert {t for t, _ in masked.top_logprobs[3]} == {0, 40}


def test_the_mask_holds_at_temperature_with_penalties_and_bias() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 64)
    row = SamplingRow(temperature=1.5, top_p=0.9, seed=7, repetition_penalty=1.3, frequency_penalty=0.5,
                      logit_bias=((9, 100.0),), output_ids=[3, 3, 4], prompt_ids=[1, 2])  # fmt: skip
    allowed = [3, 4, 17, 33]  # token 9, pushed by its bias, is not allowed
    for step in range(30):
        rows = [dataclasses.replace(row, step=step)] * 3
        out = sample_batch(logits, rows, TokenMask([0, 2], bitmask_allowing([allowed, allowed], 2)))
        assert out.token_ids[0] in allowed and out.token_ids[2] in allowed
        assert out.token_ids[1] == 9


def test_allows_only() -> None:
    mask = bitmask_allowing([[31, 32], [31]], 2)
    assert not allows_only(mask[0], [31])
    assert allows_only(mask[0], [31, 32])
    assert allows_only(mask[1], [31, 5])


# --------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_checkpoint(tmp_path_factory.mktemp("grammar") / "tiny", "tiny", seed=3)


@pytest.fixture(scope="module")
def parts(checkpoint: Path) -> tuple[LanguageModel, ModelSpec, Grammars, PreTrainedTokenizerBase]:
    spec = ModelSpec.from_dir(checkpoint)
    grammars = Grammars.for_checkpoint(checkpoint, spec.vocab_size, spec.eos_token_ids)
    assert grammars is not None
    model = LanguageModel.from_checkpoint(checkpoint, dtype=torch.float32)
    return model, spec, grammars, AutoTokenizer.from_pretrained(checkpoint)


Parts = tuple[LanguageModel, ModelSpec, Grammars, PreTrainedTokenizerBase]


def make_engine(parts: Parts, **overrides: object) -> Engine:
    model, spec, grammars, _ = parts
    options = {"max_model_len": 4096, "max_running": 16, "prefill_budget": 4096, "num_blocks": 512, "block_size": 4}
    options.update(overrides)
    return Engine(model, spec, EngineConfig(**options), grammars=grammars)  # type: ignore[arg-type]


def request(rid: str, length: int = 12, max_tokens: int = 200, **sampling: object) -> PreparedRequest:
    ids = [(7 * i + len(rid)) % 5000 + 10 for i in range(length)]
    params = dataclasses.replace(SamplingParams(max_tokens=max_tokens, temperature=0.0), **sampling)  # type: ignore[arg-type]
    return PreparedRequest(rid, ids, [], params)


def run(engine: Engine, *requests: PreparedRequest) -> dict[str, tuple[list[int], str | None]]:
    for req in requests:
        engine.add(engine.prepare(req))
    out: dict[str, tuple[list[int], str | None]] = {}
    while engine.has_work():
        for d in engine.step():
            tokens, _ = out.get(d.request_id, ([], None))
            out[d.request_id] = (tokens + d.token_ids, d.finish_reason)
        assert not engine.take_failed()
    return out


def answer(parts: Parts, tokens: list[int]) -> str:
    return parts[3].decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("overlap", [False, True])
def test_constrained_answers_validate_and_leave_the_others_alone(parts: Parts, overlap: bool) -> None:
    grammar = json_schema_grammar(PERSON)
    free = request("free", max_tokens=8, ignore_eos=True)
    alone = run(make_engine(parts, overlap=overlap), free)["free"]
    constrained = [
        request("greedy", grammar=grammar),
        request("hot", grammar=grammar, temperature=1.0, seed=5, top_logprobs=1),
        request("penalised", grammar=grammar, temperature=1.0, repetition_penalty=1.5, frequency_penalty=1.0),
    ]
    engine = make_engine(parts, overlap=overlap)
    out = run(engine, *constrained, free)
    assert out["free"] == alone
    # a bitmask row filled for each token a constrained row sampled, and none for the free one's
    assert engine.counters["grammar_rows"] == sum(len(out[r.request_id][0]) for r in constrained)
    assert engine.counters["grammar_fill_s"] > 0 and engine.counters["token_wait_s"] > 0
    for req in constrained:
        tokens, finish = out[req.request_id]
        assert finish == "stop", (req.request_id, answer(parts, tokens))
        jsonschema.validate(json.loads(answer(parts, tokens)), PERSON)


def test_n_choices_have_their_own_matchers_and_seeds_repeat(parts: Parts) -> None:
    grammar = json_schema_grammar(PERSON)
    choices = [request(f"c{i}", grammar=grammar, temperature=1.0, seed=i) for i in range(4)]
    first = run(make_engine(parts), *choices)
    again = run(make_engine(parts), *reversed(choices))
    assert first == again
    for tokens, finish in first.values():
        assert finish == "stop"
        jsonschema.validate(json.loads(answer(parts, tokens)), PERSON)


def test_preemption_keeps_the_matchers_state(parts: Parts) -> None:
    grammar = json_schema_grammar(PERSON)
    reqs = [request(f"p{i}", length=20, max_tokens=100, grammar=grammar, temperature=1.0, seed=i) for i in range(4)]
    roomy = run(make_engine(parts), *reqs)
    engine = make_engine(parts, num_blocks=30, block_size=4)
    tight = run(engine, *reqs)
    assert engine.counters["preemptions"] > 0
    assert tight == roomy
    for tokens, finish in tight.values():
        assert finish == "stop"
        jsonschema.validate(json.loads(answer(parts, tokens)), PERSON)


def test_a_complete_grammar_ends_the_answer_whatever_min_tokens_and_ignore_eos_say(parts: Parts) -> None:
    grammar = json_schema_grammar({"enum": ["yes", "no"]})
    out = run(make_engine(parts), request("m", grammar=grammar, min_tokens=50, ignore_eos=True))
    tokens, finish = out["m"]
    assert finish == "stop" and json.loads(answer(parts, tokens)) in ("yes", "no")
    assert len(tokens) < 50


def test_a_token_the_grammar_refuses_ends_the_request_with_an_error(parts: Parts) -> None:
    engine = make_engine(parts)
    seq = engine.prepare(request("bad", grammar=json_schema_grammar({"type": "object"})))
    engine.add(seq)
    engine.scheduler.schedule()
    not_json = parts[3].encode("x")[0]
    deltas = engine.scheduler.postprocess([seq], Sampled([not_json], [None], [[]]))
    assert deltas == []
    (failed,) = engine.take_failed()
    assert failed[0] == "bad" and "grammar" in failed[1]
    assert not engine.holds("bad")


def test_a_grammar_that_does_not_compile_is_refused_at_prepare(parts: Parts) -> None:
    with pytest.raises(PromptError, match="grammar"):
        make_engine(parts).prepare(request("x", grammar='{"grammars": [{"json_schema": {"type": "foo"}}]}'))


def test_grammars_compile_off_the_loop_once_each_and_hand_their_requests_back(checkpoint: Path) -> None:
    spec = ModelSpec.from_dir(checkpoint)
    grammars = Grammars.for_checkpoint(checkpoint, spec.vocab_size, spec.eos_token_ids)  # (nothing compiled yet)
    assert grammars is not None
    loop = EventLoop()
    ready: list[tuple[str, str]] = []
    compiles = GrammarCompiles(grammars, loop, lambda req, error: ready.append((req.request_id, error)))
    person, bad = json_schema_grammar(PERSON), '{"grammars": [{"json_schema": {"type": "foo"}}]}'
    first, twin, gone, broken = (
        request(rid, grammar=g) for rid, g in [("a", person), ("b", person), ("c", person), ("x", bad)]
    )
    assert compiles.needs_compile(first) and not compiles.needs_compile(request("free"))
    for req in (first, twin, gone, broken):
        compiles.wait(req)  # (the loop's thread never compiles: nothing is ready before the loop runs)
    assert len(compiles) == 4 and compiles.holds("b") and ready == []
    compiles.abort("c")  # (aborted while its grammar compiled: never handed back)
    while len(ready) < 3:
        loop.run_once(5.0)
    assert sorted(r for r, error in ready if not error) == ["a", "b"]
    assert [r for r, error in ready if error] == ["x"] and "does not compile" in dict(ready)["x"]
    assert grammars.is_compiled(person) and not grammars.is_compiled(bad) and len(compiles) == 0
    assert not compiles.needs_compile(request("again", grammar=person))  # (compiled once, kept)
