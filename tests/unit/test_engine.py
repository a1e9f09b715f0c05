"""The decoder engine: scheduling, paged KV, prefix cache, preemption — outputs never change."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.engine_mixed import per_span_embeddings, per_span_step_inputs
from common.protocol import PreparedMedia, PreparedRequest, SamplingParams
from workers.decoder.batch import Scheduled, media_rows, step_embeddings, step_inputs, tp_payload
from workers.decoder.config import EngineConfig
from workers.decoder.engine import Engine
from workers.decoder.graphs import graph_batch_sizes, graph_token_sizes
from workers.decoder.scheduler import PromptError
from workers.decoder.tp import EAGER
from workers.models.language import LanguageModel
from workers.models.spec import ModelSpec
from workers.models.synth import generate_checkpoint


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> tuple[LanguageModel, ModelSpec]:
    path: Path = generate_checkpoint(tmp_path_factory.mktemp("engine") / "tiny", "tiny", seed=3)
    return LanguageModel.from_checkpoint(path, dtype=torch.float32), ModelSpec.from_dir(path)


def make_engine(parts: tuple[LanguageModel, ModelSpec], **overrides: object) -> Engine:
    model, spec = parts
    options = {"max_model_len": 4096, "max_running": 16, "prefill_budget": 4096, "num_blocks": 512, "block_size": 4}
    options.update(overrides)
    return Engine(model, spec, EngineConfig(**options))  # type: ignore[arg-type]


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
        engine.scheduler.blocks.check_integrity()
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
    assert engine.scheduler.blocks.num_free_blocks() == engine.scheduler.blocks.num_blocks


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
        before = engine.scheduler.blocks.counters["prefix_hit_tokens"]
        seq = engine.prepare(req)
        seq.media_embeds = rows
        engine.add(seq)
        outputs[req.request_id] = run_to_end(engine)[0][req.request_id]
        hits.append(engine.scheduler.blocks.counters["prefix_hit_tokens"] - before)
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
    engine.scheduler.blocks.check_integrity()
    assert engine.scheduler.blocks.num_free_blocks() == engine.scheduler.blocks.num_blocks


def test_prompt_errors(parts: tuple[LanguageModel, ModelSpec]) -> None:
    _, spec = parts
    engine = make_engine(parts, max_model_len=16)
    with pytest.raises(
        PromptError, match=r"maximum context length is 16 tokens\. However, your messages resulted in 16"
    ) as exc:
        engine.prepare(request("long", 16))
    assert exc.value.code == "context_length_exceeded"
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
    assert engine.scheduler.blocks.counters["prefix_hit_tokens"] == 2 * (39 // 4 * 4)  # all but the last block, twice


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


def test_graph_token_sizes() -> None:
    assert graph_token_sizes(0) == []
    assert graph_token_sizes(40) == [32, 40]
    assert graph_token_sizes(2048) == [32, 64, *range(128, 1024, 128), 1024, 1280, 1536, 1792, 2048]
    assert graph_token_sizes(1000) == [32, 64, 128, 256, 384, 512, 640, 768, 896, 1000]


@pytest.mark.parametrize(("graph_tokens", "overlap"), [(0, False), (48, True)])
def test_static_graph_paths_and_fused_layers_keep_outputs(
    parts: tuple[LanguageModel, ModelSpec],
    fused_parts: tuple[LanguageModel, ModelSpec],
    graph_tokens: int,
    overlap: bool,
) -> None:
    """The runner that CUDA graphs replay, run without capture (padding to the graph sizes with empty
    sequences and tokens of none, the scratch block, packed static buffers), with the fused layers: the
    same greedy tokens as the plain engine, for text and image prompts, as sequences join and leave (decode
    batches 1..5 pad to 1, 2, 4, 6). With ``graph_tokens`` every other step (prefill chunks of up to 40
    tokens beside decodes) takes a mixed graph, padded to 32 or 46 tokens (the budget of 40 plus one token
    for each of 6 sequences); with ``overlap`` steps run one ahead of the host."""
    model, spec = fused_parts
    engine = Engine(
        model,
        spec,
        EngineConfig(
            max_model_len=4096,
            max_running=6,
            prefill_budget=40,
            num_blocks=512,
            block_size=4,
            fuse=True,
            graphs="static",
            graph_tokens=graph_tokens,
            overlap=overlap,
        ),
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
    assert engine.runner.graphs is not None
    runs, mixed = engine.runner.graphs.runs, engine.runner.graphs.mixed_runs
    assert engine.counters["graph_steps"] == sum(runs.values()) + sum(mixed.values())
    assert engine.counters["decode_graph_steps"] == sum(runs.values())  # (the host's launch time, by kind)
    assert engine.counters["decode_launch_s"] > 0 and engine.counters["other_launch_s"] > 0
    assert any(n < size for n, size in runs), runs  # some steps ran padded rows in the scratch block
    if graph_tokens:
        assert engine.runner.graphs.token_sizes == [32, 46]
        assert any(t < size for t, size in mixed) and any(t > 32 for t, _ in mixed), mixed
        assert engine.counters["graph_steps"] == engine.counters["steps"]
    else:
        assert not mixed and engine.counters["graph_steps"] < engine.counters["steps"]
    assert (engine.counters["overlapped_steps"] > 5) == overlap
    assert engine.scheduler.blocks.num_free_blocks() == engine.scheduler.blocks.num_blocks
    for req in requests:
        assert tokens[req.request_id] == solo(parts, req)
    for req in pictures:
        assert tokens[req.request_id] == solo(parts, req, rows[req.request_id])


def test_overlapped_steps_emit_exactly_what_synchronous_steps_do(
    fused_parts: tuple[LanguageModel, ModelSpec],
) -> None:
    """Running decode step N+1 before reading step N's tokens changes no delta: seeded sampling, the
    penalties that read the token just sampled, logprobs, stop tokens (a finish the host learns one step
    late), min_tokens, length limits, and an abort while a step is pending."""
    model, spec = fused_parts

    def deltas(overlap: bool) -> dict[str, list[tuple[object, ...]]]:
        engine = Engine(
            model,
            spec,
            EngineConfig(
                max_model_len=64,
                max_running=4,
                prefill_budget=64,
                num_blocks=128,
                block_size=4,
                fuse=True,
                graphs="static",
                overlap=overlap,
            ),
        )
        sampled = {"temperature": 0.8, "top_p": 0.9, "seed": 7, "ignore_eos": False}
        stops = {"temperature": 1.0, "seed": 3, "stop_token_ids": list(range(10, 400))}
        reqs = [
            request("seeded", 9, max_tokens=30, **sampled, frequency_penalty=0.5, top_logprobs=2),
            request("rep", 11, max_tokens=30, repetition_penalty=1.3, presence_penalty=0.4, seed=1, temperature=1.0),
            request("stops", 7, max_tokens=30, **stops),
            request("min", 8, max_tokens=30, **stops, min_tokens=5),
            request("long", 30, max_tokens=40, temperature=0.0),  # reaches max_model_len
            request("aborted", 6, max_tokens=30, temperature=0.0),
        ]
        for req in reqs:
            engine.add(engine.prepare(req))
        out: dict[str, list[tuple[object, ...]]] = {}
        while engine.has_work():
            for d in engine.step():
                out.setdefault(d.request_id, []).append((d.token_ids, d.finish_reason, d.logprobs, d.top_logprobs))
            if len(out.get("aborted", [])) == 4 and engine.holds("aborted"):
                assert engine.abort("aborted")
            engine.scheduler.blocks.check_integrity()
        assert engine.scheduler.blocks.num_free_blocks() == engine.scheduler.blocks.num_blocks
        if overlap:
            assert engine.counters["overlapped_steps"] > 10
        return out

    synchronous, overlapped = deltas(False), deltas(True)
    # Tokens and finishes exactly; logprobs to 1e-5, because a row dropped one step late (a finished
    # sequence's) changes the batch's graph size, and fp32 GEMMs of another height round differently.
    assert overlapped.keys() == synchronous.keys()
    for rid, steps in synchronous.items():
        assert [(t, f) for t, f, _, _ in overlapped[rid]] == [(t, f) for t, f, _, _ in steps], rid
        for (_, _, lp, top), (_, _, lp2, top2) in zip(steps, overlapped[rid], strict=True):
            assert (lp is None) == (lp2 is None) and (top is None) == (top2 is None)
            if lp is not None:
                assert lp2 == pytest.approx(lp, abs=1e-5)
                assert [t for t, _ in top2[0]] == [t for t, _ in top[0]]
                assert [v for _, v in top2[0]] == pytest.approx([v for _, v in top[0]], abs=1e-5)
    finishes = {rid: steps[-1][1] for rid, steps in synchronous.items()}
    assert finishes["stops"] == "stop" and len(synchronous["stops"]) < 30
    assert len(synchronous["min"]) >= 5
    assert finishes["long"] == "length" and finishes["seeded"] in ("length", "stop")
    assert len(synchronous["aborted"]) >= 4 and finishes["aborted"] is None


def test_engine_rejects_an_unknown_graph_mode(parts: tuple[LanguageModel, ModelSpec]) -> None:
    with pytest.raises(ValueError, match="graphs must be 'off', 'static' or 'cuda'"):
        make_engine(parts, graphs="always")  # type: ignore[arg-type]


def test_a_smaller_budget_while_sequences_decode(parts: tuple[LanguageModel, ModelSpec]) -> None:
    """Alone, a prompt prefills at the full budget; once a sequence decodes, each step carries at most the
    decoding budget (its decode included), so a late long prompt cannot stretch the decoder's gaps."""
    engine = make_engine(parts, prefill_budget=64, decoding_budget=16)
    engine.add(engine.prepare(request("first", 60, max_tokens=30)))
    scheduled = engine.scheduler.schedule()
    assert [(s.seq.request_id, s.num_new) for s in scheduled] == [("first", 60)]  # nothing decodes yet
    engine = make_engine(parts, prefill_budget=64, decoding_budget=16)
    first, late = request("first", 8, max_tokens=30), request("late", 60)
    engine.add(engine.prepare(first))
    tokens: dict[str, list[int]] = {}
    widths = []
    schedule = engine.scheduler.schedule

    def measured_schedule(reserved: int = 0, preempt: bool = True) -> list[Scheduled]:
        batch = schedule(reserved, preempt)
        widths.append(sum(s.num_new for s in batch))
        return batch

    engine.scheduler.schedule = measured_schedule  # type: ignore[method-assign]
    while engine.has_work():
        if len(tokens.get("first", [])) == 2 and "late" not in tokens and not engine.holds("late"):
            engine.add(engine.prepare(late))  # arrives while "first" decodes
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
    assert widths[0] == 8 and max(widths[1:]) == 16  # 60 prompt tokens in chunks of 15 beside the decode
    assert sum(w == 16 for w in widths) == 4
    assert tokens["late"] == solo(parts, late) and tokens["first"] == solo(parts, first)


@pytest.mark.parametrize(("graphs", "graph_tokens"), [("off", 0), ("static", 48)])
def test_steps_staged_ahead_of_prefills_and_arrivals_emit_what_synchronous_steps_do(
    fused_parts: tuple[LanguageModel, ModelSpec], graphs: str, graph_tokens: int
) -> None:
    """``overlap``: every step is launched before the previous one's tokens are read, also those that
    carry prefill chunks (of text and image prompts) or admit arrivals, with the decoding rows' input ids
    taken from the device. Against the synchronous engine: the same tokens and finishes for greedy and
    seeded sampling with penalties, stop tokens learnt a step late, min_tokens, length limits, an abort
    while a step is pending, and a cache small enough that blocks run short and sequences are preempted."""
    spec = fused_parts[1]
    system = [(13 * i) % 700 + 30 for i in range(12)]

    def deltas(overlap: bool) -> tuple[dict[str, list[tuple[object, ...]]], Engine]:
        engine = make_engine(
            fused_parts,
            max_model_len=96,
            max_running=5,
            prefill_budget=16,
            num_blocks=40,
            fuse=True,
            graphs=graphs,
            graph_tokens=graph_tokens,
            overlap=overlap,
        )
        stops = {"temperature": 1.0, "seed": 3, "stop_token_ids": list(range(10, 400))}
        arrivals = [
            request("seeded", 9, max_tokens=25, temperature=0.8, top_p=0.9, seed=7, frequency_penalty=0.5),
            request("greedy", 21, max_tokens=30, top_logprobs=2),
            image_request("img0", spec, "hash-0", system, [31, 32]),
            request("rep", 11, max_tokens=30, repetition_penalty=1.3, presence_penalty=0.4, seed=1, temperature=1.0),
            request("stops", 7, max_tokens=30, **stops),
            image_request("img1", spec, "hash-1", system, [33]),
            request("min", 8, max_tokens=30, **stops, min_tokens=5),
            request("long", 40, max_tokens=80),  # reaches max_model_len
            request("aborted", 6, max_tokens=30),
        ]
        out: dict[str, list[tuple[object, ...]]] = {}
        step = 0
        while arrivals or engine.has_work():
            if arrivals and step % 3 == 0:  # one arrival every third step, while others prefill and decode
                req = arrivals.pop(0)
                seq = engine.prepare(req)
                seq.media_embeds = (
                    image_rows(spec, int(req.request_id[-1])) if req.request_id.startswith("img") else None
                )
                engine.add(seq)
            for d in engine.step():
                out.setdefault(d.request_id, []).append((d.token_ids, d.finish_reason, d.logprobs, d.top_logprobs))
            if len(out.get("aborted", [])) == 3 and engine.holds("aborted"):
                assert engine.abort("aborted")
            engine.scheduler.blocks.check_integrity()
            step += 1
        assert engine.scheduler.blocks.num_free_blocks() == engine.scheduler.blocks.num_blocks
        return out, engine

    synchronous, _ = deltas(False)
    staged, engine = deltas(True)
    assert engine.counters["overlapped_mixed_steps"] > 10  # steps with prefill or arrivals were staged ahead
    assert engine.counters["preemptions"] > 0  # blocks ran short
    assert staged.keys() == synchronous.keys()
    for rid, steps in synchronous.items():
        assert [(t, f) for t, f, _, _ in staged[rid]] == [(t, f) for t, f, _, _ in steps], rid
    greedy = [(lp, [t for t, _ in top[0]]) for _, _, lp, top in synchronous["greedy"]]
    for (lp, top), (_, _, lp2, top2) in zip(greedy, staged["greedy"], strict=True):
        assert lp2 == pytest.approx(lp, abs=1e-5) and [t for t, _ in top2[0]] == top
    finishes = {rid: steps[-1][1] for rid, steps in synchronous.items()}
    assert finishes["stops"] == "stop" and len(synchronous["min"]) >= 5
    assert finishes["long"] == "length" and finishes["aborted"] is None and len(synchronous["aborted"]) >= 3


def test_step_embeddings_and_inputs_equal_those_built_span_by_span(parts: tuple[LanguageModel, ModelSpec]) -> None:
    """A step's embeddings (one lookup, one index copy) and staged positions and slots (plain ints for
    one-token spans) are those of each span built alone, concatenated (as the engine built them before,
    kept in benchmarks.engine_mixed for its A/B), and so are a tensor-parallel step's: chunks that start
    and end inside an image's placeholders, decodes of text and image sequences, prompts beside them."""
    model, spec = parts
    engine = make_engine(parts, prefill_budget=7, max_running=5)
    pictures = [image_request(f"img{i}", spec, f"hash-{i}", [40 + i, 41, 42, 43, 44], [31, 32 + i]) for i in range(2)]
    for req in [request("t0", 9), *pictures, request("t1", 4, max_tokens=9)]:
        seq = engine.prepare(req)
        seq.media_embeds = image_rows(spec, 7) if req.media else None
        engine.add(seq)
    run, checked = engine.runner.run, []

    def checking_run(batch: list[Scheduled], ahead_ids: torch.Tensor | None = None) -> torch.Tensor:
        spans = [(b.seq, b.seq.num_computed, b.seq.num_computed + b.num_new) for b in batch]
        assert torch.equal(step_embeddings(model, spans), per_span_embeddings(model, spans))
        staged = step_inputs(batch, [], engine.scheduler.blocks.block_size)
        expected = per_span_step_inputs(batch, [], engine.scheduler.blocks.block_size)
        assert np.array_equal(staged.positions, expected.positions)
        assert np.array_equal(staged.slots, expected.slots)
        payload = tp_payload(batch, [], EAGER, engine.scheduler.blocks.block_size, torch.float32, spec.hidden_size)
        media = [media_rows(*span) for span in spans]
        assert payload.ids.tolist() == [i for seq, a, b in spans for i in seq.token_ids(a, b)]
        masks = [
            torch.zeros(b - a, dtype=torch.bool) if found is None else found[0]
            for found, (_, a, b) in zip(media, spans, strict=True)
        ]
        assert torch.equal(payload.media_mask, torch.cat(masks))
        parts = [found[1] for found in media if found is not None]
        assert torch.equal(payload.media_rows, torch.cat(parts) if parts else torch.empty(0, spec.hidden_size))
        assert np.array_equal(payload.positions.numpy(), expected.positions)
        assert np.array_equal(payload.slots.numpy(), expected.slots)
        checked.append(sum(b.num_new > 1 for b in batch) and sum(b.num_new == 1 for b in batch))
        return run(batch, ahead_ids)

    engine.runner.run = checking_run  # type: ignore[method-assign]
    run_to_end(engine)
    assert len(checked) > 5 and any(checked)  # some steps held prompt chunks and decodes together
    assert step_embeddings(model, []).shape == (0, spec.hidden_size)  # a step whose rows all came ahead
