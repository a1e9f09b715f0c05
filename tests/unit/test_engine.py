"""The decoder engine: scheduling, paged KV, prefix cache, preemption — outputs never change."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from common.protocol import PreparedMedia, PreparedRequest, SamplingParams
from workers.decoder.engine import Engine, PromptError
from workers.decoder.graphs import graph_batch_sizes
from workers.models.language import LanguageModel
from workers.models.spec import ModelSpec
from workers.models.synth import generate_checkpoint


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> tuple[LanguageModel, ModelSpec]:
    path: Path = generate_checkpoint(tmp_path_factory.mktemp("engine") / "tiny", "tiny", seed=3)
    return LanguageModel.from_checkpoint(path, dtype=torch.float32), ModelSpec.from_dir(path)


def make_engine(parts: tuple[LanguageModel, ModelSpec], **overrides: int) -> Engine:
    model, spec = parts
    options = {"max_model_len": 4096, "max_running": 16, "prefill_budget": 4096, "num_blocks": 512, "block_size": 4}
    options.update(overrides)
    return Engine(model, spec, **options)  # type: ignore[arg-type]


def request(rid: str, length: int, max_tokens: int = 6, **sampling: object) -> PreparedRequest:
    ids = [(7 * i + len(rid)) % 5000 + 10 for i in range(length)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    params = dataclasses.replace(params, **sampling)  # type: ignore[arg-type]
    return PreparedRequest(rid, ids, [], params)


def image_request(
    rid: str, spec: ModelSpec, content_hash: str, prefix: list[int], suffix: list[int]
) -> PreparedRequest:
    media = PreparedMedia("image", content_hash, [1, 4, 4], 4)
    ids = [*prefix, spec.vision_start_token_id, spec.image_token_id, *suffix]
    return PreparedRequest(rid, ids, [media], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))


def image_rows(spec: ModelSpec, seed: int) -> torch.Tensor:
    return torch.randn(4, spec.hidden_size, generator=torch.Generator().manual_seed(seed))


def run_to_end(engine: Engine) -> tuple[dict[str, list[int]], list[set[str]]]:
    tokens: dict[str, list[int]] = {}
    steps = []
    while engine.has_work():
        deltas = engine.step()
        steps.append({d.request_id for d in deltas})
        for d in deltas:
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
        engine.blocks.check_integrity()
    return tokens, steps


def solo(parts: tuple[LanguageModel, ModelSpec], req: PreparedRequest, embeds: torch.Tensor | None = None) -> list[int]:
    engine = make_engine(parts, prefix_cache=False)
    seq = engine.prepare(req)
    seq.media_embeds = embeds
    engine.add(seq)
    return run_to_end(engine)[0][req.request_id]


def test_slots_and_prefill_budget(parts: tuple[LanguageModel, ModelSpec]) -> None:
    engine = make_engine(parts, max_running=2, prefill_budget=100)
    for rid, length in (("a", 60), ("b", 60), ("c", 10)):
        engine.add(engine.prepare(request(rid, length)))
    tokens, steps = run_to_end(engine)
    assert steps[0] == {"a"}  # b starts, but only its first 40-token chunk fits the budget
    assert steps[1] == {"a", "b"}
    assert "c" not in set().union(*steps[:5])  # no slot while a and b run
    assert all(len(t) == 6 for t in tokens.values())
    assert engine.blocks.num_free_blocks() == engine.blocks.num_blocks


def test_batched_and_chunked_tokens_equal_solo_tokens(parts: tuple[LanguageModel, ModelSpec]) -> None:
    requests = [request(f"r{i}", 5 + 9 * i, max_tokens=8) for i in range(6)]
    engine = make_engine(parts, max_running=4, prefill_budget=13)
    for r in requests:
        engine.add(engine.prepare(r))
    batched, _ = run_to_end(engine)
    for r in requests:
        assert batched[r.request_id] == solo(parts, r)


def test_preemption_under_a_tiny_kv_cache_keeps_outputs(parts: tuple[LanguageModel, ModelSpec]) -> None:
    requests = [request(f"p{i}", 10 + 3 * i, max_tokens=12) for i in range(5)]
    engine = make_engine(parts, num_blocks=16, block_size=4)  # 64 tokens for ~150 needed at once
    for r in requests:
        engine.add(engine.prepare(r))
    tokens, _ = run_to_end(engine)
    assert engine.counters["preemptions"] > 0
    for r in requests:
        assert tokens[r.request_id] == solo(parts, r)


def test_prefix_cache_reuses_a_shared_image_prefix(parts: tuple[LanguageModel, ModelSpec]) -> None:
    _, spec = parts
    system = [(11 * i) % 900 + 20 for i in range(16)]
    engine = make_engine(parts)
    first = image_request("first", spec, "hash-A", system, [31, 32, 33, 34, 35, 36, 37, 38])
    second = image_request("second", spec, "hash-A", system, [31, 32, 33, 34, 35, 36, 41, 42])
    other = image_request("other", spec, "hash-B", system, [31, 32, 33, 34, 35, 36, 41, 42])
    outputs = {}
    hits = []
    for req, rows in ((first, image_rows(spec, 1)), (second, image_rows(spec, 1)), (other, image_rows(spec, 2))):
        before = engine.blocks.counters["prefix_hit_tokens"]
        seq = engine.prepare(req)
        seq.media_embeds = rows
        engine.add(seq)
        outputs[req.request_id] = run_to_end(engine)[0][req.request_id]
        hits.append(engine.blocks.counters["prefix_hit_tokens"] - before)
        assert outputs[req.request_id] == solo(parts, req, rows)
    prompt = len(engine.prepare(second).prompt_ids)
    assert hits[0] == 0
    assert hits[1] == (prompt - 3) // 4 * 4  # every full block before the first differing token
    assert hits[2] == 16  # the system prompt only: a different image at the same place does not hit


def test_seeded_sampling_reproduces(parts: tuple[LanguageModel, ModelSpec]) -> None:
    def sampled(seed: int) -> list[int]:
        engine = make_engine(parts)
        engine.add(engine.prepare(request("s", 12, max_tokens=10, temperature=1.0, top_p=0.9, seed=seed)))
        return run_to_end(engine)[0]["s"]

    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)


def test_abort_frees_blocks(parts: tuple[LanguageModel, ModelSpec]) -> None:
    engine = make_engine(parts, max_running=1)
    engine.add(engine.prepare(request("x", 8)))
    engine.add(engine.prepare(request("y", 8)))
    engine.step()
    assert engine.abort("x") and engine.abort("y")
    assert not engine.has_work() and not engine.abort("x")
    engine.blocks.check_integrity()
    assert engine.blocks.num_free_blocks() == engine.blocks.num_blocks


def test_prompt_errors(parts: tuple[LanguageModel, ModelSpec]) -> None:
    _, spec = parts
    engine = make_engine(parts, max_model_len=16)
    with pytest.raises(PromptError, match="context is 16"):
        engine.prepare(request("long", 16))
    with pytest.raises(PromptError, match="empty"):
        engine.prepare(request("empty", 0))
    bad = PreparedRequest("bad", [spec.vocab_size + 5], [], SamplingParams(max_tokens=1))
    with pytest.raises(PromptError, match="token ids"):
        engine.prepare(bad)
    small = make_engine(parts, num_blocks=2, block_size=4)
    with pytest.raises(PromptError, match="KV blocks"):
        small.prepare(request("big", 6, max_tokens=8))


def test_choices_of_one_prompt_share_its_kv(parts: tuple[LanguageModel, ModelSpec]) -> None:
    engine = make_engine(parts, prefill_budget=16)  # a 40-token prompt takes 3 steps to prefill
    prompt = request("twin", 40, max_tokens=4)
    for i in range(3):
        engine.add(engine.prepare(dataclasses.replace(prompt, request_id=f"twin-{i}")))
    tokens, _ = run_to_end(engine)
    assert len({tuple(t) for t in tokens.values()}) == 1
    assert engine.blocks.counters["prefix_hit_tokens"] == 2 * (39 // 4 * 4)  # all but the last block, twice


@pytest.fixture(scope="module")
def fused_parts(tmp_path_factory: pytest.TempPathFactory) -> tuple[LanguageModel, ModelSpec]:
    """A model of its own: fusing re-points its projection weights (same values, one tensor per layer)."""
    path: Path = generate_checkpoint(tmp_path_factory.mktemp("engine-fused") / "tiny", "tiny", seed=3)
    return LanguageModel.from_checkpoint(path, dtype=torch.float32), ModelSpec.from_dir(path)


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_static_decode_path_and_fused_layers_keep_outputs(
    parts: tuple[LanguageModel, ModelSpec], fused_parts: tuple[LanguageModel, ModelSpec]
) -> None:
    """The decode runner that CUDA graphs replay, run without capture (padding to the graph sizes, the
    scratch block, packed static buffers), with the fused layers: the same greedy tokens as the plain
    engine, for text and image prompts, as sequences join and leave (batch sizes 1..5 pad to 1, 2, 4, 6)."""
    model, spec = fused_parts
    engine = Engine(
        model,
        spec,
        max_model_len=4096,
        max_running=6,
        prefill_budget=64,
        num_blocks=512,
        block_size=4,
        fuse=True,
        decode_graphs="static",
    )
    requests = [request(f"g{i}", 5 + 7 * i, max_tokens=4 + 3 * i) for i in range(5)]
    system = [(11 * i) % 900 + 20 for i in range(9)]
    pictures = [image_request(f"img{i}", spec, f"hash-{i}", system, [31, 32 + i]) for i in range(2)]
    rows = {p.request_id: image_rows(spec, i) for i, p in enumerate(pictures)}
    for req in [*requests, *pictures]:
        seq = engine.prepare(req)
        seq.media_embeds = rows.get(req.request_id)
        engine.add(seq)
    tokens, _ = run_to_end(engine)
    assert engine.graphs is not None
    runs = engine.graphs.runs
    assert engine.counters["graph_steps"] == sum(runs.values()) > 0
    assert engine.counters["graph_steps"] < engine.counters["steps"]  # prefill steps did not take it
    assert any(n < size for n, size in runs), runs  # some steps ran padded rows in the scratch block
    for req in requests:
        assert tokens[req.request_id] == solo(parts, req)
    for req in pictures:
        assert tokens[req.request_id] == solo(parts, req, rows[req.request_id])


def test_engine_rejects_an_unknown_graph_mode(parts: tuple[LanguageModel, ModelSpec]) -> None:
    with pytest.raises(ValueError, match="decode_graphs must be 'off', 'static' or 'cuda'"):
        make_engine(parts, decode_graphs="always")  # type: ignore[arg-type]
