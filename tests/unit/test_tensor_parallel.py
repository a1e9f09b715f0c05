"""Tensor parallelism's math, two gloo ranks on this CPU: every rank's sharded forward (prefill, then a
decode step over its half of the KV cache) gives the unsharded model's logits, for each family whose language
model it shards (`Family.tensor_parallel`: all three); a family that did not set it would be refused. Qwen3-VL's
ranks (q/k norm per head, DeepStack sets broadcast beside the image rows) give transformers' own logits."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.protocol import PreparedRequest, SamplingParams
from workers.decoder.config import EngineConfig
from workers.decoder.engine import Engine
from workers.decoder.graphs import engine_graphs
from workers.decoder.tp import EAGER, RankForward, StepBroadcast, StepPayload, leave_group
from workers.models import tensor_parallel
from workers.models.language import LanguageModel
from workers.models.paged import (
    BatchLayout,
    PagedAttention,
    PagedKVCache,
    fuse_layers,
    paged_attention_reference,
    paged_forward,
)
from workers.models.registry import Family, checkpoint_family, read_spec
from workers.models.spec import ModelSpec
from workers.models.synth import generate_checkpoint
from workers.models.tensor_parallel import TensorParallel, check_shardable, load_shard

PROMPT = [(13 * i) % 700 + 5 for i in range(11)]
NEXT = 42


def steps() -> list[StepPayload]:
    t = len(PROMPT)
    prefill = StepPayload(
        mode=EAGER,
        slots=torch.arange(t),
        ids=torch.tensor(PROMPT),
        media_mask=torch.zeros(t, dtype=torch.bool),
        media_rows=torch.empty(0, 0),
        positions=torch.arange(t).expand(3, -1),
        query_lens=[t],
        context_lens=[t],
        block_tables=[[0, 1, 2]],
        rows=list(range(t)),
    )
    decode = StepPayload(
        mode=EAGER,
        slots=torch.tensor([t]),
        ids=torch.tensor([NEXT]),
        media_mask=torch.zeros(1, dtype=torch.bool),
        media_rows=torch.empty(0, 0),
        positions=torch.full((3, 1), t),
        query_lens=[1],
        context_lens=[t + 1],
        block_tables=[[0, 1, 2]],
        rows=[0],
    )
    return [prefill, decode]


def run_rank(rank: int, world: int, path: str, store: str, out: str, fuses: list[bool]) -> None:
    """The steps' logits of this rank's shard in each of ``fuses`` (a fresh cache for each), at
    ``{out}-{fuse}-{rank}.npy``."""
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    spec = read_spec(path)
    tp = TensorParallel(rank, world, spec.vocab_size)
    model = load_shard(Path(path), spec, tp, torch.device("cpu"), torch.float32)
    for fuse in fuses:
        kv = PagedKVCache.for_model(model, 4, 4)
        forward = RankForward(model, kv, paged_attention_reference, tp, fuse_layers(model) if fuse else None)
        logits = [forward(payload) for payload in steps()]
        np.save(f"{out}-{fuse}-{rank}.npy", torch.cat(logits).numpy())
    dist.barrier()  # every rank done with its collectives before any tears its connections down
    dist.destroy_process_group()
    exit_spawned_rank()


def exit_spawned_rank() -> None:
    """Out of a spawned test rank that has left its group, without the interpreter's finalisation. About
    once in ten CI runs a gloo rank died after its work was done and saved ("terminate called without an
    active exception", SIGABRT: a C++ thread object destroyed while still joinable, as at finalisation);
    gloo's teardown is not what these tests are about, and a rank that fails before this still fails."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def unsharded(path: Path) -> torch.Tensor:
    model = checkpoint_family(path).language_model(path, dtype=torch.float32)
    kv = PagedKVCache.for_model(model, 4, 4)
    out = []
    for payload in steps():
        layout = BatchLayout.build(payload.query_lens, payload.context_lens, payload.block_tables, 4)
        embeds = model.embed(payload.ids)
        out.append(paged_forward(model, embeds, payload.positions, layout, kv, payload.rows))
    return torch.cat(out)


# (ranks, synthetic shape): the tiny shape's 2 kv heads allow 2 ranks; tiny-4kv gives each of 4 ranks one,
# as the 7b shape on four GPUs.
SHAPES = {2: "tiny", 4: "tiny-4kv"}


def tiny(tmp_path: Path, family: str, world: int = 2) -> Path:
    """The family's synthetic checkpoint shaped for ``world`` ranks (Qwen2-VL's alone has tiny-4kv)."""
    return generate_checkpoint(tmp_path / f"{family}-{SHAPES[world]}", SHAPES[world], seed=4, family=family)


RANK_CASES = [
    ("qwen2_vl", 2, False),
    ("qwen2_vl", 2, True),
    ("qwen2_vl", 4, True),
    ("qwen2_5_vl", 2, False),
    ("qwen2_5_vl", 2, True),
    ("qwen3_vl", 2, False),  # its text model runs unfused (the fused layers have no q/k norm)
]


@pytest.fixture(scope="module")
def rank_logits(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(family, world) -> (the unsharded logits, each fuse's logits of each rank). One spawn of the ranks per
    (family, world) computes every fuse case of it (the processes' start-up, not the forward, is what costs)."""
    runs: dict[tuple[str, int], tuple[torch.Tensor, dict[bool, list[torch.Tensor]]]] = {}

    def get(family: str, world: int) -> tuple[torch.Tensor, dict[bool, list[torch.Tensor]]]:
        if (family, world) not in runs:
            tmp_path = tmp_path_factory.mktemp(f"ranks-{family}-{world}")
            fuses = [fuse for f, w, fuse in RANK_CASES if (f, w) == (family, world)]
            path = tiny(tmp_path, family, world)
            args = (world, str(path), str(tmp_path / "store"), str(tmp_path / "logits"), fuses)
            mp.start_processes(run_rank, args=args, nprocs=world, start_method="spawn")
            logits = {
                fuse: [torch.from_numpy(np.load(tmp_path / f"logits-{fuse}-{rank}.npy")) for rank in range(world)]
                for fuse in fuses
            }
            runs[family, world] = unsharded(path), logits
        return runs[family, world]

    return get


@pytest.mark.parametrize(
    ("family", "world", "fuse"),
    RANK_CASES,
    ids=["two-plain", "two-fused", "four-fused", "qwen2_5_vl-two-plain", "qwen2_5_vl-two-fused", "qwen3_vl-two-plain"],
)
def test_ranks_give_the_unsharded_logits(rank_logits: Any, family: str, world: int, fuse: bool) -> None:
    """Plain layers, and the fused ones (concatenated projections of the rank's shard, the fused norm and
    activation paths) with the all-reduces between them; each rank's shard is its family's language model,
    loaded through the registry."""
    expected, logits = rank_logits(family, world)
    assert len(logits[fuse]) == world
    for got in logits[fuse]:
        assert got.shape == expected.shape  # the full vocabulary on every rank
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # fp32: only the sum order differs


# Qwen3-VL with images: two of different sizes, the prompt prefilled in two chunks split inside the second one
# (each chunk carries its own image rows and their DeepStack sets), then a decode step.
QWEN3_GRIDS = [(1, 4, 10), (1, 8, 6)]


def qwen3_prompt(spec: ModelSpec) -> list[int]:
    merge = spec.vision.spatial_merge_size
    ids = [151644, 872, 198]  # <|im_start|>user\n
    for t, h, w in QWEN3_GRIDS:
        ids += [spec.vision_start_token_id, *[spec.image_token_id] * (t * h * w // merge**2), spec.vision_end_token_id]
        ids += [(29 * len(ids)) % 900 + 11 for _ in range(3)]
    return [*ids, 151645, 198, 151644, 77091, 198]  # <|im_end|>\n<|im_start|>assistant\n


def qwen3_steps(path: Path) -> tuple[list[StepPayload], dict[str, torch.Tensor]]:
    """The steps with the tower's rows (merged, and the DeepStack sets as the cache entry carries them), and the
    inputs that give transformers the same sequence (the prompt, then NEXT)."""
    spec = read_spec(path)
    found = checkpoint_family(path)
    ids = qwen3_prompt(spec)
    grids = torch.tensor(QWEN3_GRIDS)
    rows = int(grids.prod(dim=1).sum())
    pixels = torch.randn(rows, spec.vision.patch_dim, generator=torch.Generator().manual_seed(3))
    stacked = found.vision_tower(path, dtype=torch.float32)(pixels, grids)  # [1 + K, rows, hidden]
    assert stacked.shape[0] == 3  # two DeepStack sets
    positions, delta = found.rope_positions(ids, QWEN3_GRIDS, [], spec)
    mask = torch.tensor(ids) == spec.image_token_id
    t, split = len(ids), int(mask.nonzero()[-1]) - 5  # inside the second image
    payloads = []
    for start, end in ((0, split), (split, t)):
        part = mask[start:end]
        first, count = int(mask[:start].sum()), int(part.sum())
        payloads.append(
            StepPayload(
                mode=EAGER,
                slots=torch.arange(start, end),
                ids=torch.tensor(ids[start:end]),
                media_mask=part,
                media_rows=stacked[0, first : first + count],
                positions=positions[:, start:end],
                query_lens=[end - start],
                context_lens=[end],
                block_tables=[list(range(QWEN3_BLOCKS))],
                rows=list(range(end - start)),
                deepstack=stacked[1:, first : first + count],
            )
        )
    decode = StepPayload(
        mode=EAGER,
        slots=torch.tensor([t]),
        ids=torch.tensor([NEXT]),
        media_mask=torch.zeros(1, dtype=torch.bool),
        media_rows=torch.empty(0, spec.hidden_size),
        positions=torch.full((3, 1), t + delta),
        query_lens=[1],
        context_lens=[t + 1],
        block_tables=[list(range(QWEN3_BLOCKS))],
        rows=[0],
    )
    full = torch.tensor([[*ids, NEXT]])
    hf_inputs = {
        "input_ids": full,
        "pixel_values": pixels,
        "image_grid_thw": grids,
        "mm_token_type_ids": (full == spec.image_token_id).to(torch.int32),
    }
    return [*payloads, decode], hf_inputs


QWEN3_BLOCKS = 32  # of 4 slots: the prompt and its decode fit


def qwen3_rank(rank: int, world: int, path: str, store: str, out: str) -> None:
    """Rank 0 broadcasts each step (`StepBroadcast`: the DeepStack sets cross the wire), every rank runs it."""
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    spec = read_spec(path)
    tp = TensorParallel(rank, world, spec.vocab_size)
    model = load_shard(Path(path), spec, tp, torch.device("cpu"), torch.float32)
    forward = RankForward(model, PagedKVCache.for_model(model, QWEN3_BLOCKS, 4), paged_attention_reference, tp)
    wire = StepBroadcast(tp, spec.hidden_size, model.dtype, torch.device("cpu"))
    logits = []
    if rank == 0:
        for payload in torch.load(f"{out}-steps.pt", weights_only=False):
            wire.send(payload)
            logits.append(forward(payload))
        wire.send_stop()
    else:
        while (payload := wire.receive()) is not None:
            assert payload.deepstack is None or payload.deepstack.shape[0] == 2
            logits.append(forward(payload))
    np.save(f"{out}-{rank}.npy", torch.cat(logits).numpy())
    dist.barrier()
    dist.destroy_process_group()
    exit_spawned_rank()


def test_qwen3_vl_ranks_with_image_rows_and_deepstack_give_transformers_logits(tmp_path: Path) -> None:
    """Two ranks, each with half of Qwen3's heads (q/k norm weights shared), the DeepStack sets added to the full
    hidden after each layer's all-reduce: every prompt row's logits and the decode step's equal transformers'
    ``Qwen3VLForConditionalGeneration`` on the same pixels (fp32; tolerance as tests/unit/test_qwen3_vl.py)."""
    from transformers import Qwen3VLForConditionalGeneration

    path = tiny(tmp_path, "qwen3_vl")
    payloads, hf_inputs = qwen3_steps(path)
    assert all(p.deepstack is not None and p.media_rows.shape[0] for p in payloads[:2])  # both chunks carry some
    torch.save(payloads, tmp_path / "logits-steps.pt")
    args = (2, str(path), str(tmp_path / "store"), str(tmp_path / "logits"))
    mp.start_processes(qwen3_rank, args=args, nprocs=2, start_method="spawn")
    reference = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(**hf_inputs, use_cache=False).logits[0]
    for rank in range(2):
        got = torch.from_numpy(np.load(tmp_path / f"logits-{rank}.npy"))
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


def test_unshardable_models_are_refused(tmp_path: Path) -> None:
    spec = ModelSpec.from_dir(generate_checkpoint(tmp_path / "tiny", "tiny", seed=4))
    with pytest.raises(ValueError, match="does not divide the model's"):
        check_shardable(spec, 3)


def refusing(monkeypatch: pytest.MonkeyPatch, model_type: str) -> None:
    """The registry answering as though tensor parallelism did not shard ``model_type``'s language model (every
    family served now shards; a new one leaves `Family.tensor_parallel` off until its text model's parts do)."""
    registered = tensor_parallel.family

    def family(name: str) -> Family:
        found = registered(name)
        return dataclasses.replace(found, tensor_parallel=False) if name == model_type else found

    monkeypatch.setattr(tensor_parallel, "family", family)


def test_a_family_whose_language_model_is_not_sharded_is_refused_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By the launcher's preflight and by every rank's load, naming the types that can be sharded; one rank
    needs no sharding."""
    from common.config import Config
    from ops.deploy import preflight

    path = tiny(tmp_path, "qwen2_5_vl")
    spec = read_spec(path)
    refusing(monkeypatch, "qwen2_5_vl")
    message = (
        r"^\[decoder\] tensor_parallel = 2: tensor parallelism does not shard the qwen2_5_vl language model yet; "
        r"set tensor_parallel = 1, or serve a model of a type it shards: qwen2_vl, qwen3_vl$"
    )
    for rank in range(2):
        with pytest.raises(ValueError, match=message):
            load_shard(path, spec, TensorParallel(rank, 2, spec.vocab_size), torch.device("cpu"), torch.float32)
    cfg = Config()
    cfg.model.path = str(path)
    cfg.decoder.tensor_parallel = 2
    with pytest.raises(ValueError, match=message):
        preflight(cfg)
    tensor_parallel.check_tensor_parallel(spec, 1)


def test_tensor_parallelism_shards_every_family() -> None:
    """A family is sharded once its text model's every part is (`Family.tensor_parallel`, off unless set): Qwen2's
    layers, and Qwen3's with q/k norm and DeepStack."""
    assert tensor_parallel.sharded_model_types() == ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


def test_a_qwen3_vl_world_that_does_not_divide_its_heads_is_refused(tmp_path: Path) -> None:
    """The tiny Qwen3-VL has 4 heads and 2 kv heads: 4 ranks would leave two without a kv head."""
    path = tiny(tmp_path, "qwen3_vl")
    spec = read_spec(path)
    with pytest.raises(ValueError, match=r"tensor_parallel = 4 does not divide the model's 2 kv heads \(qwen3_vl\)"):
        load_shard(path, spec, TensorParallel(0, 4, spec.vocab_size), torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        check_shardable(spec, 3)


ENGINE = {"max_model_len": 256, "max_running": 4, "prefill_budget": 24, "num_blocks": 64, "block_size": 4}
GRAPH_TOKENS = 32


def requests() -> list[PreparedRequest]:
    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    return [PreparedRequest(f"r{i}", [(11 * j + i) % 600 + 7 for j in range(5 + 9 * i)], [], params) for i in range(5)]


def generate(engine: Engine) -> dict[str, list[int]]:
    for request in requests():
        engine.add(engine.prepare(request))
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
    return tokens


def follower(
    model: LanguageModel, tp: TensorParallel, attention: PagedAttention, capture: bool, kv_cache_dtype: str = "auto"
) -> RankForward:
    """A rank K >= 1 shaped like rank 0's `ENGINE` (cache, fused layers, graphs), as `DecoderRank` builds it."""
    cache_dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else model.dtype
    kv = PagedKVCache.for_model(model, ENGINE["num_blocks"] + 1, ENGINE["block_size"], cache_dtype)
    fused = fuse_layers(model)
    mode = "cuda" if capture else "static"
    config = EngineConfig(**ENGINE, attention=attention, fuse=True, graphs=mode, graph_tokens=GRAPH_TOKENS)
    graphs = engine_graphs(model, kv, config, fused, tp)
    return RankForward(model, kv, attention, tp, fused, graphs)


def engine_rank(
    rank: int, world: int, path: str, store: str, out: str, overlaps: list[bool], kv_cache_dtype: str = "auto"
) -> None:
    """Rank 0 runs the engine (static graphs: the padded, staged path CUDA graphs replay, uncaptured) once per
    entry of ``overlaps``, each run's tokens at ``{out}-{overlap}.json``; the other ranks run rank 0's steps through
    their own graphs, as `DecoderRank` does. Each run starts afresh on every rank: engine or follower, cache, graphs
    and broadcast."""
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    spec = read_spec(path)
    tp = TensorParallel(rank, world, spec.vocab_size)
    model = load_shard(Path(path), spec, tp, torch.device("cpu"), torch.float32)
    for overlap in overlaps:
        steps = StepBroadcast(tp, spec.hidden_size, model.dtype, torch.device("cpu"))
        if rank == 0:
            options = {"fuse": True, "graphs": "static", "graph_tokens": GRAPH_TOKENS, "overlap": overlap}
            options["kv_cache_dtype"] = kv_cache_dtype
            engine = Engine(model, spec, EngineConfig(**ENGINE, **options), steps)  # type: ignore[arg-type]
            tokens = generate(engine)
            steps.send_stop()
            assert (engine.counters["overlapped_steps"] > 0) == overlap
            assert (engine.counters["overlapped_mixed_steps"] > 0) == overlap  # prefill chunks beside decodes
            assert engine.counters["graph_steps"] > 0
            Path(f"{out}-{overlap}.json").write_text(json.dumps(tokens))
        else:
            forward = follower(model, tp, paged_attention_reference, capture=False, kv_cache_dtype=kv_cache_dtype)
            while (payload := steps.receive()) is not None:
                forward(payload)
    leave_group(None)  # as the decoder ranks leave (no CUDA graphs here)
    exit_spawned_rank()


ENGINE_CASES = [("qwen2_vl", 2, False), ("qwen2_vl", 2, True), ("qwen2_vl", 4, True), ("qwen2_5_vl", 2, True)]


@pytest.fixture(scope="module")
def engine_tokens(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(family, world) -> (one rank's tokens, each overlap's tokens over the ranks). One spawn of the ranks per
    (family, world) runs every overlap case of it."""
    runs: dict[tuple[str, int], tuple[Any, dict[bool, Any]]] = {}

    def get(family: str, world: int) -> tuple[Any, dict[bool, Any]]:
        if (family, world) not in runs:
            tmp_path = tmp_path_factory.mktemp(f"engine-{family}-{world}")
            overlaps = [overlap for f, w, overlap in ENGINE_CASES if (f, w) == (family, world)]
            path = tiny(tmp_path, family, world)
            out = tmp_path / "tokens"
            args = (world, str(path), str(tmp_path / "store"), str(out), overlaps)
            mp.start_processes(engine_rank, args=args, nprocs=world, start_method="spawn")
            model, spec = checkpoint_family(path).language_model(path, dtype=torch.float32), read_spec(path)
            options = {"fuse": True, "graphs": "static", "graph_tokens": GRAPH_TOKENS}
            alone = generate(Engine(model, spec, EngineConfig(**ENGINE, **options)))  # type: ignore[arg-type]
            over_ranks = {overlap: json.loads(Path(f"{out}-{overlap}.json").read_text()) for overlap in overlaps}
            runs[family, world] = alone, over_ranks
        return runs[family, world]

    return get


@pytest.mark.parametrize(
    ("family", "world", "overlap"),
    ENGINE_CASES,
    ids=["two-synchronous", "two-overlapped", "four-overlapped", "qwen2_5_vl-two-overlapped"],
)
def test_an_engine_over_ranks_with_graph_steps_generates_what_one_rank_does(
    engine_tokens: Any, family: str, world: int, overlap: bool
) -> None:
    """Decode and mixed graph steps (static mode), fused layers, broadcast to the other ranks — with
    overlap, steps whose decodes' input ids follow as a tensor (decode graphs, and mixed steps with prefill
    chunks beside them): the same greedy tokens as one rank."""
    alone, over_ranks = engine_tokens(family, world)
    assert over_ranks[overlap] == alone


def test_an_engine_over_ranks_with_an_fp8_kv_cache_generates_what_one_rank_does(tmp_path: Path) -> None:
    """``kv_cache_dtype = "fp8"``: each rank quantizes its own kv heads, and a scale is per (token, kv head), so the
    ranks' caches hold exactly the one rank's values: the same greedy tokens."""
    path = tiny(tmp_path, "qwen2_vl", 2)
    out = tmp_path / "tokens"
    args = (2, str(path), str(tmp_path / "store"), str(out), [True], "fp8")
    mp.start_processes(engine_rank, args=args, nprocs=2, start_method="spawn")
    model, spec = checkpoint_family(path).language_model(path, dtype=torch.float32), read_spec(path)
    options = {"fuse": True, "graphs": "static", "graph_tokens": GRAPH_TOKENS, "kv_cache_dtype": "fp8"}
    engine = Engine(model, spec, EngineConfig(**ENGINE, **options))  # type: ignore[arg-type]
    alone = generate(engine)
    assert engine.runner.kv.fp8
    assert json.loads(Path(f"{out}-True.json").read_text()) == alone


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_a_shard_read_from_the_files_is_the_slice_of_the_whole_model(tmp_path: Path, family: str) -> None:
    """`load_shard` reads only its slices (safetensors slices) and gets exactly what slicing the fully
    loaded weights gives, the last vocabulary shard zero-padded to the others' size."""
    from workers.models.tensor_parallel import shard_state
    from workers.models.weights import load_language_state

    path = tiny(tmp_path, family)
    spec = read_spec(path)
    full = load_language_state(path, spec.tie_word_embeddings, "cpu", torch.float32)
    world, rows_seen = 2, 0  # the tiny model's 2 kv heads allow 2
    for rank in range(world):
        tp = TensorParallel(rank, world, spec.vocab_size)
        model = load_shard(path, spec, tp, torch.device("cpu"), torch.float32)
        expected = shard_state(full, spec, tp)
        got = model.state_dict()
        assert got.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), name
        first, rows = tp.vocab_shard()
        rows_seen += min(rows, spec.vocab_size - first)
    assert rows_seen == spec.vocab_size


def test_an_uneven_vocabulary_is_padded_on_the_last_rank(tmp_path: Path) -> None:
    from workers.models.tensor_parallel import shard_state
    from workers.models.weights import load_language_state

    path = generate_checkpoint(tmp_path / "tiny", "tiny", seed=4)
    spec = ModelSpec.from_dir(path)
    full = load_language_state(path, spec.tie_word_embeddings, "cpu", torch.float32)
    odd = dataclasses.replace(spec, vocab_size=spec.vocab_size - 1)
    state = {
        **full,
        "embed_tokens.weight": full["embed_tokens.weight"][:-1],
        "lm_head.weight": full["lm_head.weight"][:-1],
    }
    last = shard_state(state, odd, TensorParallel(1, 2, odd.vocab_size))
    rows = -(-odd.vocab_size // 2)
    assert last["embed_tokens.weight"].shape[0] == rows == last["lm_head.weight"].shape[0]
    assert torch.equal(last["lm_head.weight"][:-1], state["lm_head.weight"][rows:])
    assert not last["lm_head.weight"][-1].any()  # the padding row: zero logits, cut off after the gather


def test_a_replicas_leader_clears_only_its_own_stale_groups(tmp_path: Path) -> None:
    """Rank 0 of replica 0 (restarted) removes its earlier incarnations' rendezvous files, never those of
    replica 1's live group, and names its own after its replica."""
    from common.config import Config, DecoderConfig
    from workers.decoder.tp import leader_rendezvous

    cfg = Config(decoder=DecoderConfig(replicas=2, tensor_parallel=1), run_dir=str(tmp_path))
    mine, theirs = tmp_path / "tp-decoder.11-1.store", tmp_path / "tp-decoder-1.22-2.store"
    mine.touch()
    theirs.touch()
    leader_rendezvous(cfg, 0, "33-3", num_blocks=8, device=torch.device("cpu"))  # a group of one: no waiting
    try:
        assert not mine.exists() and theirs.exists()
        assert (tmp_path / "tp-decoder.33-3.store").exists()
    finally:
        dist.destroy_process_group()
