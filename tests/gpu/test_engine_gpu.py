"""The engine's GPU paths: CUDA-graph decode replay, fused layers with Triton kernels, and the 2b-shaped
checkpoint's logits through them against transformers. Needs a CUDA GPU and triton (skipped otherwise)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from common.protocol import PreparedRequest, SamplingParams
from tests.gpu.test_kernels_gpu import _SKIP_REASON
from workers.decoder.config import EngineConfig
from workers.decoder.engine import Engine
from workers.kernels import paged_attention
from workers.models.language import LanguageModel
from workers.models.paged import (
    BatchLayout,
    FusedLayer,
    PagedAttention,
    PagedKVCache,
    fuse_layers,
    paged_attention_reference,
    paged_forward,
)
from workers.models.spec import ModelSpec
from workers.models.synth import generate_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")]

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_checkpoint(tmp_path_factory.mktemp("engine-gpu") / "tiny", "tiny", seed=5)


def requests() -> list[PreparedRequest]:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [
        PreparedRequest(f"r{i}", [(13 * j + i) % 4000 + 10 for j in range(7 + 29 * i)], [], params) for i in range(7)
    ]


def generate(
    path: Path,
    dtype: torch.dtype,
    watch: Callable[[Engine], None] | None = None,
    block_size: int = 16,
    **runner: object,
) -> tuple[dict[str, list[int]], Engine]:
    model = LanguageModel.from_checkpoint(path, device=CUDA, dtype=dtype)
    spec = ModelSpec.from_dir(path)
    config = EngineConfig(
        max_model_len=2048,
        max_running=8,
        prefill_budget=96,
        num_blocks=4096 // block_size,
        block_size=block_size,
        **runner,  # type: ignore[arg-type]
    )
    engine = Engine(model, spec, config)
    if watch is not None:
        watch(engine)
    for req in requests():
        engine.add(engine.prepare(req))
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
    return tokens, engine


def test_graph_replay_equals_the_static_path_bit_for_bit(tiny_checkpoint: Path) -> None:
    """The same kernels with the same inputs: replaying the captured graphs changes nothing."""
    fast = {"attention": paged_attention, "fuse": True}
    replayed, engine = generate(tiny_checkpoint, torch.bfloat16, graphs="cuda", graph_tokens=128, **fast)
    static, _ = generate(tiny_checkpoint, torch.bfloat16, graphs="static", graph_tokens=128, **fast)
    graphs = engine.runner.graphs
    assert graphs is not None and set(graphs.graphs) == set(graphs.keys())
    assert engine.counters["graph_steps"] >= 20  # 7 requests of 24 tokens, mostly decoding together
    assert graphs.mixed_runs  # prefill chunks (budget 96) beside decodes replayed mixed graphs
    assert replayed == static


def test_overlapped_graph_steps_keep_the_outputs(tiny_checkpoint: Path) -> None:
    """Staging step N+1 while the GPU runs step N (ids fed on the device, async token copies): bf16
    greedy outputs equal the synchronous graph engine's."""
    fast = {"attention": paged_attention, "fuse": True, "graphs": "cuda", "graph_tokens": 128}
    overlapped, engine = generate(tiny_checkpoint, torch.bfloat16, overlap=True, **fast)
    synchronous, _ = generate(tiny_checkpoint, torch.bfloat16, overlap=False, **fast)
    assert engine.counters["overlapped_steps"] >= 10
    assert overlapped == synchronous


def never_waiting(engine: Engine) -> None:
    """Makes building and launching a step staged ahead raise if it synchronizes with the GPU (torch's sync
    debug mode: blocking copies, .item(), nonzero...), which would make it wait for the step before it."""
    run = engine.runner.run

    def checked(batch, ahead_ids=None):  # type: ignore[no-untyped-def]
        if ahead_ids is None:
            return run(batch, ahead_ids)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return run(batch, ahead_ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    engine.runner.run = checked  # type: ignore[method-assign]


def test_steps_staged_ahead_of_prefills_keep_the_outputs_and_never_wait(tiny_checkpoint: Path) -> None:
    """``overlap``: steps with prefill chunks are staged while the previous step runs too. Greedy outputs
    equal the synchronous engine's, and staging such a step never synchronizes the GPU. In fp32: the staged
    engine's batches differ from the synchronous one's (a finished sequence's row goes a step late), and in
    bf16 other batch heights may round a near-tie the other way."""
    fast = {"attention": paged_attention, "fuse": True, "graphs": "cuda", "graph_tokens": 128}
    staged, engine = generate(tiny_checkpoint, torch.float32, never_waiting, overlap=True, **fast)
    synchronous, _ = generate(tiny_checkpoint, torch.float32, overlap=False, **fast)
    assert engine.counters["overlapped_mixed_steps"] >= 3  # prefill chunks (budget 96) staged beside decodes
    assert staged == synchronous


@pytest.mark.parametrize("block_size", [16, 64])
def test_graphs_and_fused_kernels_keep_fp32_greedy_outputs(tiny_checkpoint: Path, block_size: int) -> None:
    """fp32: graphs (decode and mixed) + overlap + fused projections + Triton kernels against the
    plain-torch engine, with KV blocks of 16 tokens and of 64 (the default: one block per attention tile)."""
    graphs = {"graphs": "cuda", "graph_tokens": 128, "overlap": True, "block_size": block_size}
    fast, _ = generate(tiny_checkpoint, torch.float32, attention=paged_attention, fuse=True, **graphs)
    plain, _ = generate(tiny_checkpoint, torch.float32, attention=paged_attention_reference, block_size=block_size)
    assert fast == plain


def test_2b_logits_through_the_fused_paged_path_match_transformers(tmp_path: Path) -> None:
    """The 2b-shaped checkpoint: a 300-token prefill and 8 single-token decode steps through our bf16 paths
    (plain torch, Triton attention, fused layers, both), measured against transformers in fp32 — the
    truth bf16 approximates — beside transformers' own bf16. "Within bf16 tolerance" means: no further
    from fp32 than transformers' bf16 is (worst |diff| / row max at most 1.5x its, argmax agreement with
    fp32 at most 3 points below its). KV blocks of 16 tokens and of 64 (the default)."""
    from transformers import Qwen2VLForConditionalGeneration

    path = generate_checkpoint(tmp_path / "2b", "2b", seed=0)
    ids = [(37 * j) % 30000 + 100 for j in range(308)]
    truth, hf_bf16 = (
        hf_logits(path, ids, dtype, Qwen2VLForConditionalGeneration) for dtype in (torch.float32, torch.bfloat16)
    )
    scale = truth.abs().amax(-1, keepdim=True)

    def distance(logits: torch.Tensor) -> tuple[float, float]:
        worst = ((logits - truth).abs() / scale).max().item()
        return worst, (logits.argmax(-1) == truth.argmax(-1)).float().mean().item()

    hf_worst, hf_agree = distance(hf_bf16)
    print(f"2b transformers bf16 vs fp32: worst |diff| / row max {hf_worst:.4f}, argmax agreement {hf_agree:.3f}")
    model = LanguageModel.from_checkpoint(path, device=CUDA, dtype=torch.bfloat16)
    layers = fuse_layers(model)
    paths: dict[str, tuple[list[FusedLayer] | None, PagedAttention]] = {  # (fused layers, attention)
        "plain torch": (None, paged_attention_reference),
        "torch layers + Triton attention": (None, paged_attention),
        "fused layers + torch attention": (layers, paged_attention_reference),
        "fused layers + Triton attention": (layers, paged_attention),
    }
    variants = {
        f"{name}, blocks of {size}": paged_logits(model, ids, fused, attention, size)
        for size in (16, 64)
        for name, (fused, attention) in paths.items()
    }
    for name, ours in variants.items():
        worst, agree = distance(ours)
        print(f"2b ours bf16 ({name}) vs fp32: worst |diff| / row max {worst:.4f}, argmax agreement {agree:.3f}")
        assert worst <= 1.5 * hf_worst, name
        assert agree >= hf_agree - 0.03, name


def hf_logits(path: Path, ids: list[int], dtype: torch.dtype, model_class: type) -> torch.Tensor:
    reference = model_class.from_pretrained(str(path), dtype=dtype).to(CUDA).eval()
    with torch.inference_mode():
        logits = reference(input_ids=torch.tensor([ids], device=CUDA), use_cache=False).logits[0].float()
    del reference
    torch.cuda.empty_cache()
    return logits


def paged_logits(
    model: LanguageModel,
    ids: list[int],
    fused: list[FusedLayer] | None,
    attention: PagedAttention,
    block_size: int,
) -> torch.Tensor:
    """Logits of every position: a prefill of all but 8 tokens, then 8 single-token decode steps."""
    blocks = -(-len(ids) // block_size)
    kv = PagedKVCache.for_model(model, blocks + 2, block_size)
    table = list(range(blocks))
    prefill = len(ids) - 8
    steps = [(0, prefill)] + [(prefill + i, prefill + i + 1) for i in range(8)]
    out = []
    for start, end in steps:
        layout = BatchLayout.build([end - start], [end], [table], block_size, CUDA)
        embeds = model.embed(ids[start:end])
        positions = torch.arange(start, end).expand(3, -1)
        rows = range(end - start)
        out.append(paged_forward(model, embeds, positions, layout, kv, rows, attention, fused).float())
    return torch.cat(out)
