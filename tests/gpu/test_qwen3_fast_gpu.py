"""Qwen3-VL's language model on the GPU fast path: the compiled q/k norm + rotary kernel against its reference, and
the tiny Qwen3-VL checkpoint's engine with fused layers, Triton kernels and CUDA graphs (DeepStack adds inside the
mixed graphs) against the static path and the plain-torch engine. Needs a CUDA GPU and triton (skipped otherwise).

tests/unit/test_kernels.py checks the kernel in Triton's interpreter and tests/unit/test_qwen3_vl_serving.py the
fused layers and the graphs' static buffers on CPU; this adds compilation, GPU rounding and the captured graphs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.protocol import PreparedMedia, PreparedRequest, SamplingParams
from tests.gpu.test_kernels_gpu import _SKIP_REASON
from workers.decoder.config import EngineConfig
from workers.decoder.engine import Engine
from workers.kernels import paged_attention, rotary
from workers.models.language import mrope_cos_sin, rope_inv_freq
from workers.models.paged import BatchLayout, PagedKVCache, fuse_layers, paged_attention_reference, paged_forward
from workers.models.qwen3_vl_text import DeepStack, Qwen3LanguageModel, interleaved_mrope_axis
from workers.models.registry import checkpoint_family, read_spec
from workers.models.spec import ModelSpec
from workers.models.synth import generate_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")]

CUDA = torch.device("cuda")
IMAGE_TOKENS = 12  # a [1, 6, 8] grid of patch 16, merged 2x2


# --- the kernel -------------------------------------------------------------------------------------------------


def _qk_inputs(
    heads: int, kv_heads: int, head_dim: int, section: tuple[int, int, int], dtype: torch.dtype, tokens: int
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(41)
    positions = torch.randint(0, 30000, (3, tokens), generator=g)
    axis = interleaved_mrope_axis(section)
    cos, sin = mrope_cos_sin(positions, rope_inv_freq(head_dim, 5_000_000.0), section, dtype, axis)
    scale = torch.rand(tokens, heads + 2 * kv_heads, 1, generator=g) * 20 + 0.05
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=g) * scale).to(dtype)
    q_weight = (torch.rand(head_dim, generator=g) + 0.5).to(dtype)
    k_weight = (torch.rand(head_dim, generator=g) * 2 - 0.5).to(dtype)
    tensors = (qkv, q_weight, k_weight, cos, sin)
    qkv, q_weight, k_weight, cos, sin = (t.to(CUDA) for t in tensors)
    return qkv[:, :heads], qkv[:, heads : heads + kv_heads], q_weight, k_weight, cos, sin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "section"),
    [
        pytest.param(4, 2, 16, (4, 2, 2), id="tiny"),
        pytest.param(16, 8, 128, (24, 20, 20), id="2b"),
        pytest.param(32, 8, 128, (24, 20, 20), id="8b"),
    ],
)
def test_qk_norm_rotary_kernel_equals_the_reference(
    heads: int, kv_heads: int, head_dim: int, section: tuple[int, int, int], dtype: torch.dtype
) -> None:
    """In place on the strided q/k views of one qkv, as the fused layer runs it; v untouched. bf16: within two
    ulps everywhere and nearly every element exact (the kernel rounds where the reference does)."""
    q, k, q_weight, k_weight, cos, sin = _qk_inputs(heads, kv_heads, head_dim, section, dtype, tokens=333)
    qkv = q._base
    assert qkv is not None
    v_before = qkv[:, heads + kv_heads :].clone()
    expected = rotary.apply_qk_norm_mrope_reference(q, k, q_weight, k_weight, 1e-6, cos, sin)
    rotary.apply_qk_norm_mrope(q, k, q_weight, k_weight, 1e-6, cos, sin, inplace=True)  # dispatches to Triton
    for actual, wanted in zip((q, k), expected, strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-5)
            continue
        torch.testing.assert_close(actual.float(), wanted.float(), rtol=2**-6, atol=2**-6)
        assert (actual == wanted).float().mean().item() >= 0.98
    assert torch.equal(qkv[:, heads + kv_heads :], v_before)


# --- the engine ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_checkpoint(tmp_path_factory.mktemp("qwen3-fast-gpu") / "tiny", "tiny", 0, family="qwen3_vl")


def _model(path: Path, dtype: torch.dtype) -> tuple[Qwen3LanguageModel, ModelSpec]:
    spec = read_spec(path)
    model = checkpoint_family(path).language_model(path, device=CUDA, dtype=dtype, spec=spec)
    assert isinstance(model, Qwen3LanguageModel)
    return model, spec


def _requests(spec: ModelSpec) -> list[tuple[PreparedRequest, torch.Tensor | None]]:
    """Image prompts of several lengths (their DeepStack sets scaled so that the adds move the tokens) and text."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    out: list[tuple[PreparedRequest, torch.Tensor | None]] = []
    for i in range(4):
        prefix = [(17 * j + i) % 900 + 20 for j in range(5 + 23 * i)]
        ids = [*prefix, spec.vision_start_token_id, spec.image_token_id, spec.vision_end_token_id, 31 + i, 32]
        media = PreparedMedia("image", f"hash-{i}", [1, 6, 8], IMAGE_TOKENS)
        g = torch.Generator().manual_seed(i)
        sets = 4 * torch.randn(spec.embedding_sets, IMAGE_TOKENS, spec.hidden_size, generator=g)
        out.append((PreparedRequest(f"img{i}", ids, [media], params), sets))
    for i in range(3):
        out.append((PreparedRequest(f"txt{i}", [(13 * j + i) % 900 + 20 for j in range(9 + 31 * i)], [], params), None))
    return out


def generate(path: Path, dtype: torch.dtype, **runner: object) -> tuple[dict[str, list[int]], Engine]:
    model, spec = _model(path, dtype)
    config = EngineConfig(max_model_len=2048, max_running=8, prefill_budget=48, num_blocks=256, block_size=16, **runner)  # type: ignore[arg-type]
    engine = Engine(model, spec, config)  # type: ignore[arg-type]
    for req, sets in _requests(spec):
        seq = engine.prepare(req)
        if sets is not None:
            sets = sets.to(device=CUDA, dtype=dtype)
            seq.media_embeds, seq.deepstack_embeds = sets[0], sets[1:]
        engine.add(seq)
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
    return tokens, engine


FAST = {"attention": paged_attention, "fuse": True, "graph_tokens": 128}


def test_graph_replay_equals_the_static_path_bit_for_bit(qwen3_checkpoint: Path) -> None:
    """bf16, the same kernels on the same inputs: replaying the captured graphs (DeepStack buffer included)
    changes nothing; image prefill chunks (budget 48) ran in mixed graphs beside decodes."""
    replayed, engine = generate(qwen3_checkpoint, torch.bfloat16, graphs="cuda", **FAST)
    static, _ = generate(qwen3_checkpoint, torch.bfloat16, graphs="static", **FAST)
    graphs = engine.runner.graphs
    assert graphs is not None and set(graphs.graphs) == set(graphs.keys()) and graphs.deepstack is not None
    assert graphs.mixed_runs and engine.counters["graph_steps"] >= 20
    assert replayed == static


def test_graphs_and_fused_kernels_keep_fp32_greedy_outputs(qwen3_checkpoint: Path) -> None:
    """fp32: graphs (decode and mixed) + overlap + fused layers + Triton kernels against the plain-torch engine."""
    fast, engine = generate(qwen3_checkpoint, torch.float32, graphs="cuda", overlap=True, **FAST)
    plain, _ = generate(qwen3_checkpoint, torch.float32, attention=paged_attention_reference)
    assert engine.counters["graph_steps"] == engine.counters["steps"]
    assert fast == plain


def test_bf16_fused_logits_are_as_close_to_fp32_as_the_eager_bf16(qwen3_checkpoint: Path) -> None:
    """One image prompt's prefill logits (DeepStack) through the fused Triton layers in bf16, against the fp32
    one-sequence model: no further from it than the eager bf16 model is (worst |diff| / row max at most 1.5x its,
    plus a bf16 ulp), and the same argmax on nearly every row."""
    req, sets = _requests(read_spec(qwen3_checkpoint))[2]
    assert sets is not None
    truth = _reference_logits(qwen3_checkpoint, torch.float32, req, sets, fused=False)
    eager = _reference_logits(qwen3_checkpoint, torch.bfloat16, req, sets, fused=False)
    fused = _reference_logits(qwen3_checkpoint, torch.bfloat16, req, sets, fused=True)

    def distance(logits: torch.Tensor) -> tuple[float, float]:
        worst = ((logits.float() - truth).abs().amax(-1) / truth.abs().amax(-1)).max().item()
        return worst, (logits.float().argmax(-1) == truth.argmax(-1)).float().mean().item()

    eager_worst, eager_agree = distance(eager)
    fused_worst, fused_agree = distance(fused)
    print(
        f"qwen3 tiny bf16 vs fp32: eager {eager_worst:.4f}/{eager_agree:.3f}, fused {fused_worst:.4f}/{fused_agree:.3f}"
    )
    assert fused_worst <= 1.5 * eager_worst + 2**-8
    assert fused_agree >= eager_agree - 0.05


def _reference_logits(
    path: Path, dtype: torch.dtype, req: PreparedRequest, sets: torch.Tensor, fused: bool
) -> torch.Tensor:
    """Every prompt token's logits: the one-sequence model (eager) or the fused paged layers with Triton kernels."""
    from workers.models.language import merge_media_embeddings
    from workers.models.paged import StepDeepStack

    model, spec = _model(path, dtype)
    engine = Engine(model, spec, EngineConfig(2048, 4, 2048, 64, 16))  # type: ignore[arg-type]
    seq = engine.prepare(req)
    ids = seq.prompt_ids
    sets = sets.to(device=CUDA, dtype=dtype)
    embeds = merge_media_embeddings(model.embed(ids), ids, sets[0], [spec.image_token_id])
    deepstack = DeepStack.at_placeholders(ids, [spec.image_token_id], list(sets[1:]))
    if not fused:
        return model(embeds, seq.positions, model.new_cache(), deepstack, all_logits=True)
    kv = PagedKVCache.for_model(model, 64, 16)  # type: ignore[arg-type]
    layout = BatchLayout.build([len(ids)], [len(ids)], [list(range(-(-len(ids) // 16)))], 16)
    step = StepDeepStack(deepstack.rows, torch.stack(list(deepstack.features)))
    rows = list(range(len(ids)))
    layers = fuse_layers(model)
    return paged_forward(model, embeds, seq.positions, layout, kv, rows, paged_attention, layers, deepstack=step)  # type: ignore[arg-type]
