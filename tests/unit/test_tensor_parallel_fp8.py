"""Tensor parallelism of FP8 language models, two gloo ranks on this CPU: a block-wise FP8 checkpoint (the tiny-128
shape, whose 2-rank shards are whole 128 x 128 blocks: the tiny shape's would cut them and is refused), a per-channel
one and an unquantized one quantized at load (``[model] quantization = "fp8"``) each give one rank's logits and greedy
tokens, and each rank's FP8 weights and scales are exactly the slice of the whole model's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.quantization import FP8_BLOCK, FP8_CHANNEL
from tests.unit.test_tensor_parallel import ENGINE, GRAPH_TOKENS, exit_spawned_rank, follower, generate, steps
from workers.decoder.config import EngineConfig
from workers.decoder.engine import Engine
from workers.decoder.tp import RankForward, StepBroadcast, leave_group
from workers.models.fp8 import FP8, Fp8Linear
from workers.models.language import LanguageModel
from workers.models.paged import BatchLayout, PagedKVCache, paged_attention_reference, paged_forward
from workers.models.registry import checkpoint_family, read_spec
from workers.models.synth import generate_checkpoint
from workers.models.tensor_parallel import TensorParallel, check_tensor_parallel, load_shard, shard_index, shard_state

WORLD = 2
# id -> (synthetic shape, the checkpoint's FP8 format (None: unquantized), [model] quantization)
CASES = {
    "block": ("tiny-128", FP8_BLOCK, "auto"),
    "channel": ("tiny", FP8_CHANNEL, "auto"),
    "at-load": ("tiny", None, "fp8"),
}


def checkpoint(tmp_path: Path, case: str) -> tuple[Path, str]:
    size, stored, quantization = CASES[case]
    return generate_checkpoint(tmp_path / case, size, seed=4, quantization=stored), quantization


def whole_model(path: Path, quantization: str) -> LanguageModel:
    spec = read_spec(path, quantization)
    model: LanguageModel = checkpoint_family(path).language_model(path, dtype=torch.float32, spec=spec)
    return model


def fp8_rank(rank: int, world: int, path: str, quantization: str, store: str, out: str) -> None:
    """This rank's logits of `steps` (plain layers) at ``{out}-{rank}.npy``; then rank 0 runs the engine (fused
    layers, static graph steps, overlap) with the others following, its tokens at ``{out}.json``."""
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    spec = read_spec(path, quantization)
    tp = TensorParallel(rank, world, spec.vocab_size)
    cpu = torch.device("cpu")
    model = load_shard(Path(path), spec, tp, cpu, torch.float32)
    forward = RankForward(model, PagedKVCache.for_model(model, 4, 4), paged_attention_reference, tp)
    np.save(f"{out}-{rank}.npy", torch.cat([forward(payload) for payload in steps()]).numpy())
    broadcast = StepBroadcast(tp, spec.hidden_size, model.dtype, cpu)
    if rank == 0:
        options = {"fuse": True, "graphs": "static", "graph_tokens": GRAPH_TOKENS, "overlap": True}
        engine = Engine(model, spec, EngineConfig(**ENGINE, **options), broadcast)  # type: ignore[arg-type]
        tokens = generate(engine)
        broadcast.send_stop()
        Path(f"{out}.json").write_text(json.dumps(tokens))
    else:
        following = follower(model, tp, paged_attention_reference, capture=False)
        while (payload := broadcast.receive()) is not None:
            following(payload)
    leave_group(None)
    exit_spawned_rank()


def alone(path: Path, quantization: str) -> tuple[torch.Tensor, dict[str, list[int]]]:
    """One rank's logits of `steps` and its engine's greedy tokens."""
    model, spec = whole_model(path, quantization), read_spec(path, quantization)
    kv = PagedKVCache.for_model(model, 4, 4)
    logits = []
    for payload in steps():
        layout = BatchLayout.build(payload.query_lens, payload.context_lens, payload.block_tables, 4)
        logits.append(paged_forward(model, model.embed(payload.ids), payload.positions, layout, kv, payload.rows))
    options = {"fuse": True, "graphs": "static", "graph_tokens": GRAPH_TOKENS}
    engine = Engine(whole_model(path, quantization), spec, EngineConfig(**ENGINE, **options))  # type: ignore[arg-type]
    return torch.cat(logits), generate(engine)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_on_fp8_weights_give_one_ranks_logits_and_tokens(tmp_path: Path, case: str) -> None:
    """FP8 shards (scales cut with their weights; fused q/k/v and gate/up of the rank's parts) all-reduced: the
    unsharded model's logits up to the sum order (fp32), and
    its greedy tokens through the engine's fused, graph-step, overlapped path."""
    path, quantization = checkpoint(tmp_path, case)
    out = tmp_path / "out"
    args = (WORLD, str(path), quantization, str(tmp_path / "store"), str(out))
    mp.start_processes(fp8_rank, args=args, nprocs=WORLD, start_method="spawn")
    expected_logits, expected_tokens = alone(path, quantization)
    for rank in range(WORLD):
        got = torch.from_numpy(np.load(f"{out}-{rank}.npy"))
        assert got.shape == expected_logits.shape
        # fp32: only the sum order differs; tiny-128's 4x wider sums and larger logits take the 1e-5 of
        # tests/unit/test_tensor_parallel.py past 4e-5 on some runs (the ranks' all-reduce order is not fixed), so
        # twice the 1e-4 its engine test allows (a wrong scale or slice is off by orders of magnitude more)
        torch.testing.assert_close(got, expected_logits, rtol=1e-5, atol=2e-4)
    assert json.loads(Path(f"{out}.json").read_text()) == expected_tokens


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == FP8 or b.dtype == FP8:
        return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@pytest.mark.parametrize("case", list(CASES))
def test_an_fp8_shard_is_the_slice_of_the_whole_quantized_model(tmp_path: Path, case: str) -> None:
    """Each rank's FP8 weights and scales, read from the files (and, at load, quantized by the rank: the whole rows'
    scales for a row-parallel weight), equal slicing the whole model's (`shard_state`): quantizing then sharding is
    sharding then quantizing. And each FP8 layer's dequantized weight is the slice of the whole dequantized weight."""
    path, quantization = checkpoint(tmp_path, case)
    spec = read_spec(path, quantization)
    whole = whole_model(path, quantization)
    layers = {name: m for name, m in whole.named_modules() if isinstance(m, Fp8Linear)}
    assert len(layers) == 7 * spec.num_layers  # every decoder projection is FP8
    full_state = whole.state_dict()
    for rank in range(WORLD):
        tp = TensorParallel(rank, WORLD, spec.vocab_size)
        shard = load_shard(path, spec, tp, torch.device("cpu"), torch.float32)
        expected, got = shard_state(full_state, spec, tp), shard.state_dict()
        assert got.keys() == expected.keys()
        for name, tensor in expected.items():
            assert same(got[name], tensor), name
        for name, layer in shard.named_modules():
            if isinstance(layer, Fp8Linear):
                index = shard_index(f"{name}.weight", spec, tp)
                assert index is not None, name
                whole_weight = layers[name].fp8_weight().dequantize(torch.float32)
                assert torch.equal(layer.fp8_weight().dequantize(torch.float32), whole_weight[index]), name


def test_a_block_fp8_split_that_cuts_a_block_is_refused_naming_the_layers(tmp_path: Path) -> None:
    """The tiny shape's 2-rank shards (32 q rows, 16 k/v rows, 64 MLP columns) would cut the 128 x 128 blocks: each
    projection named with its numbers, at start-up (`check_tensor_parallel`, which the launcher's preflight runs) and
    in `load_shard`."""
    path = generate_checkpoint(tmp_path / "tiny", "tiny", seed=4, quantization=FP8_BLOCK)
    spec = read_spec(path)
    check_tensor_parallel(spec, 1)
    message = (
        r"^\[decoder\] tensor_parallel = 2: the fp8-block checkpoint's weights are scaled per 128 x 128 block and a "
        r"rank's shard must hold whole blocks, but these shards are not multiples of 128: "
        r"q_proj: 32 rows \(2 of 4 heads x head_dim 16\); k_proj / v_proj: 16 rows \(1 of 2 kv heads x head_dim 16\); "
        r"o_proj: 32 columns \(2 of 4 heads x head_dim 16\); gate_proj / up_proj: 64 rows \(of the MLP's 128\); "
        r"down_proj: 64 columns \(of the MLP's 128\); choose a tensor_parallel whose shards are, or set "
        r"tensor_parallel = 1$"
    )
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(spec, 2)
    with pytest.raises(ValueError, match=message):
        load_shard(path, spec, TensorParallel(0, 2, spec.vocab_size), torch.device("cpu"), torch.float32)
