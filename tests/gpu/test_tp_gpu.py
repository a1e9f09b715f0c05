"""Tensor parallelism on two GPUs: NCCL, fused Triton layers, captured CUDA graphs (decode and mixed, their
collectives inside) and overlapped decode steps — greedy tokens equal to one GPU's in fp32. Needs two CUDA
GPUs and triton; skipped otherwise (it has not run yet: no two-GPU machine was lent when it was written)."""

from __future__ import annotations

import faulthandler
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.gpu.test_kernels_gpu import _SKIP_REASON
from tests.unit.test_tensor_parallel import ENGINE, GRAPH_TOKENS, follower, generate
from workers.decoder.config import EngineConfig
from workers.decoder.engine import Engine
from workers.decoder.tp import StepBroadcast, leave_group
from workers.kernels import paged_attention
from workers.models.language import LanguageModel
from workers.models.spec import ModelSpec
from workers.models.synth import generate_checkpoint
from workers.models.tensor_parallel import TensorParallel, load_shard

RANK_TIMEOUT_S = 75
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or ""),
    pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA GPUs"),
]


def gpu_rank(rank: int, world: int, path: str, store: str, out: str) -> None:
    # A rank that hangs shows where, before the parent's timeout kills the test without the ranks' stacks.
    faulthandler.dump_traceback_later(RANK_TIMEOUT_S, exit=True)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    # As workers.decoder.tp.init_group: the communicator made now, on this rank's device.
    dist.init_process_group("nccl", store=dist.FileStore(store, world), rank=rank, world_size=world, device_id=device)
    spec = ModelSpec.from_dir(path)
    tp = TensorParallel(rank, world, spec.vocab_size)
    model = load_shard(Path(path), spec, tp, device, torch.float32)
    steps = StepBroadcast(tp, spec.hidden_size, model.dtype, device)
    if rank == 0:
        options = {"fuse": True, "graphs": "cuda", "graph_tokens": GRAPH_TOKENS, "overlap": True}
        config = EngineConfig(**ENGINE, **options, attention=paged_attention)  # type: ignore[arg-type]
        engine = Engine(model, spec, config, steps)
        tokens = generate(engine)
        steps.send_stop()
        Path(out).write_text(json.dumps({"tokens": tokens, "counters": engine.counters}))
        leave_group(engine.runner.graphs)  # as the decoder leaves: graphs first, then the communicator
    else:
        forward = follower(model, tp, paged_attention, capture=True)
        while (payload := steps.receive()) is not None:
            forward(payload)
        leave_group(forward.graphs)
    faulthandler.cancel_dump_traceback_later()


def test_two_gpus_with_captured_graphs_and_overlap_generate_what_one_gpu_does(tmp_path: Path) -> None:
    path = generate_checkpoint(tmp_path / "tiny", "tiny", seed=4)
    out = tmp_path / "tp.json"
    mp.start_processes(gpu_rank, args=(2, str(path), str(tmp_path / "store"), str(out)), nprocs=2, start_method="spawn")
    result = json.loads(out.read_text())
    assert result["counters"]["graph_steps"] > 0 and result["counters"]["overlapped_steps"] > 0
    model = LanguageModel.from_checkpoint(path, device=torch.device("cuda", 0), dtype=torch.float32)
    spec = ModelSpec.from_dir(path)
    options = {"fuse": True, "graphs": "cuda", "graph_tokens": GRAPH_TOKENS, "overlap": True}
    config = EngineConfig(**ENGINE, **options, attention=paged_attention)  # type: ignore[arg-type]
    alone = generate(Engine(model, spec, config))
    assert result["tokens"] == alone
