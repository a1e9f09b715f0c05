"""The FP8 KV cache's compiled Triton paths on CUDA (tests/unit/test_kv_fp8.py runs them in the interpreter): the cache
write against the reference bit for bit, the attention over an FP8 cache against the dequantizing reference at the
real models' shapes, both inside a CUDA graph capture, and the engine with graphs, fused layers and the FP8 cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.test_engine_gpu import generate
from tests.gpu.test_kernels_gpu import _SKIP_REASON, ATTN_BF16, MODELS, paged_batch
from workers.kernels import attention, cache, paged_attention
from workers.kernels.cache import KV_FP8, reshape_and_cache_reference
from workers.models.paged import PagedKVCache, paged_attention_reference
from workers.models.synth import generate_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")]

CUDA = torch.device("cuda")


def kv_vectors(tokens: int, kv_heads: int, head_dim: int, seed: int) -> torch.Tensor:
    """bf16 k/v over six decades, a bias-like outlier column (Qwen's k bias), one zero vector."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn((tokens, kv_heads, head_dim), generator=g, device=CUDA)
    x = x * 10.0 ** torch.empty_like(x).uniform_(-3, 1, generator=g)
    x[:, 0, 1] += 300.0
    x[tokens // 2, -1] = 0
    return x.to(torch.bfloat16)


def fp8_cache(slots: int, kv_heads: int, head_dim: int) -> list[torch.Tensor]:
    """kv_k, kv_v, k_scale, v_scale."""
    data = [torch.zeros((slots, kv_heads, head_dim), dtype=KV_FP8, device=CUDA) for _ in range(2)]
    return data + [torch.zeros((slots, kv_heads), device=CUDA) for _ in range(2)]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), MODELS)
def test_cache_kernel_equals_the_reference(heads: int, kv_heads: int, head_dim: int) -> None:
    tokens, slots = 300, 4096
    k, v = kv_vectors(tokens, kv_heads, head_dim, 1), kv_vectors(tokens, kv_heads, head_dim, 2)
    slot_mapping = torch.randperm(slots, device=CUDA)[:tokens]
    kernel, reference = fp8_cache(slots, kv_heads, head_dim), fp8_cache(slots, kv_heads, head_dim)
    cache.reshape_and_cache(k, v, *kernel[:2], slot_mapping, *kernel[2:])
    reshape_and_cache_reference(k, v, *reference[:2], slot_mapping, *reference[2:])
    for actual, expected in zip(kernel, reference, strict=True):
        assert torch.equal(actual.float(), expected.float())  # (as values: +0 and -0 alike)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), MODELS)
@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [([1] * 8, [3000, 17, 400, 1, 64, 65, 2048, 900]), ([300, 1, 77], [300, 5000, 1200])],
    ids=["decode", "mixed"],
)
def test_attention_over_an_fp8_cache(
    heads: int, kv_heads: int, head_dim: int, query_lens: list[int], context_lens: list[int]
) -> None:
    q, plain_k, plain_v, layout = paged_batch(query_lens, context_lens, heads, kv_heads, head_dim)
    slots = layout.context_slots
    kv_k, kv_v, k_scale, v_scale = fp8_cache(plain_k.shape[0], kv_heads, head_dim)
    reshape_and_cache_reference(plain_k[slots], plain_v[slots] * 40, kv_k, kv_v, slots, k_scale, v_scale)
    scale = head_dim**-0.5
    out = attention.paged_attention(q, kv_k, kv_v, layout, scale, k_scale=k_scale, v_scale=v_scale)
    expected = paged_attention_reference(q, kv_k, kv_v, layout, scale, k_scale, v_scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=ATTN_BF16["atol"] * 40, rtol=ATTN_BF16["rtol"])
    # and within FP8's reach of the plain cache (a missing scale is off by orders of magnitude)
    plain = paged_attention_reference(q, plain_k, plain_v * 40, layout, scale)
    assert (out.float() - plain.float()).abs().max() <= 0.1 * plain.float().abs().max()


def test_cache_write_and_attention_under_a_cuda_graph() -> None:
    """Captured once, replayed over new k/v/q in the same buffers: the replay's cache and output equal an eager
    call's on the same inputs."""
    q, plain_k, plain_v, layout = paged_batch([1] * 4, [100, 7, 513, 64], 28, 4, 128)
    kv = PagedKVCache(1, 4, 128, plain_k.shape[0] // 16, 16, CUDA, torch.bfloat16, KV_FP8)
    context = layout.context_slots
    kv.write(0, context, plain_k[context], plain_v[context])
    slots = layout.slot_mapping.to(CUDA)  # each sequence's last position: its new token
    k_new, v_new = kv_vectors(4, 4, 128, 3), kv_vectors(4, 4, 128, 4)
    metadata = attention.attention_metadata(layout, CUDA)

    def step() -> torch.Tensor:
        cache.reshape_and_cache(k_new, v_new, kv.keys[0], kv.values[0], slots, **kv.scales(0))
        return attention.paged_attention(q, kv.keys[0], kv.values[0], metadata, 0.125, **kv.scales(0))

    step()  # (compiles outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    k_new.copy_(kv_vectors(4, 4, 128, 5))
    v_new.copy_(kv_vectors(4, 4, 128, 6))
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    stores = (kv.keys[0], kv.values[0], kv.key_scales[0], kv.value_scales[0])
    replayed = [out.clone(), *(t.clone() for t in stores)]
    eager = step()  # the same inputs again, eagerly: the same slots get the same bytes
    assert torch.equal(replayed[0], eager)
    for actual, expected in zip(replayed[1:], stores, strict=True):
        assert torch.equal(as_bits(actual), as_bits(expected))


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == KV_FP8 else t


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_checkpoint(tmp_path_factory.mktemp("kv-fp8-gpu") / "tiny", "tiny", seed=5)


def test_engine_graphs_over_an_fp8_cache(tiny_checkpoint: Path) -> None:
    """The engine with an FP8 cache: CUDA-graph replay equals the static path bit for bit (bf16), and in fp32 the
    fused Triton engine with graphs keeps the plain-torch engine's greedy outputs over the same FP8 cache."""
    fast = {"attention": paged_attention, "fuse": True, "graph_tokens": 128, "kv_cache_dtype": "fp8"}
    replayed, engine = generate(tiny_checkpoint, torch.bfloat16, graphs="cuda", **fast)
    static, _ = generate(tiny_checkpoint, torch.bfloat16, graphs="static", **fast)
    assert engine.runner.kv.fp8 and engine.counters["graph_steps"] >= 20
    assert replayed == static
    graphs, _ = generate(tiny_checkpoint, torch.float32, graphs="cuda", overlap=True, **fast)
    plain, _ = generate(tiny_checkpoint, torch.float32, attention=paged_attention_reference, kv_cache_dtype="fp8")
    assert graphs == plain
