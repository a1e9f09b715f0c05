"""The compiled Triton kernels against their references on CUDA, in bf16 at the real models' shapes.

tests/unit/test_kernels.py checks the same kernels in Triton's interpreter; this adds what only a GPU shows:
compilation for the target, tensor-core rounding, and lengths that take many tiles and splits. Benchmarks
are not tests: ``python -m benchmarks.kernels`` prints decode attention bandwidth.

The 16-bit tolerances here allow one more ulp than the interpreter's (CUDA's exp and rsqrt are not the
CPU's, and the compiler may contract a multiply and add into an fma): they are first guesses for the first
GPU run, to be tightened to what it measures.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from tests.triton_setup import compiled_kernels_skip_reason
from workers.kernels import activation, attention, cache, norm, rotary
from workers.models.language import LanguageModel, mrope_cos_sin, rope_inv_freq
from workers.models.paged import BatchLayout, PagedKVCache, paged_attention_reference, paged_forward
from workers.models.synth import generate_checkpoint

_SKIP_REASON = compiled_kernels_skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")]

CUDA = torch.device("cuda")
ATTN_BF16 = {"atol": 1.6e-2, "rtol": 1.6e-2}  # the interpreter's measured worst was 7.8e-3 (one bf16 ulp)
ATTN_FP32 = {"atol": 1e-5, "rtol": 1e-5}  # IEEE fp32 products; only the summation order differs
MODELS = [pytest.param(12, 2, 128, id="2b"), pytest.param(28, 4, 128, id="7b")]


def ulps_apart(actual: torch.Tensor, expected: torch.Tensor) -> float:
    bits = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}[expected.dtype]
    e = expected.float()
    _, exponent = torch.frexp(e)
    smallest = torch.finfo(expected.dtype).tiny * 2.0 ** (1 - bits)
    ulp = torch.where(e == 0, smallest, torch.ldexp(torch.ones_like(e), exponent - bits).clamp_min(smallest))
    return ((actual.float() - e).abs() / ulp).max().item()


def paged_batch(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    block_size: int = 16,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, BatchLayout]:
    """Scattered block tables; slots outside every context hold NaN so that a stray read shows."""
    need = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(need) + 8
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in need]
    layout = BatchLayout.build(query_lens, context_lens, tables, block_size, CUDA, num_blocks=num_blocks)
    g = torch.Generator(device=CUDA).manual_seed(seed)
    shape = (num_blocks * block_size, kv_heads, head_dim)
    kv_k = torch.full(shape, float("nan"), dtype=dtype, device=CUDA)
    kv_v = torch.full(shape, float("nan"), dtype=dtype, device=CUDA)
    slots = layout.context_slots
    kv_k[slots] = torch.randn((slots.shape[0], kv_heads, head_dim), generator=g, device=CUDA).to(dtype)
    kv_v[slots] = torch.randn((slots.shape[0], kv_heads, head_dim), generator=g, device=CUDA).to(dtype)
    q = torch.randn((layout.num_tokens, heads, head_dim), generator=g, device=CUDA).to(dtype)
    return q, kv_k, kv_v, layout


def check_attention(
    q: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor, layout: BatchLayout, **overrides: int
) -> None:
    scale = q.shape[-1] ** -0.5
    out = attention.paged_attention_triton(q, kv_k, kv_v, layout, scale, **overrides)
    expected = paged_attention_reference(q, kv_k, kv_v, layout, scale)
    assert not out.isnan().any()
    if q.dtype == torch.float32:
        torch.testing.assert_close(out, expected, **ATTN_FP32)
        return
    torch.testing.assert_close(out, expected, **ATTN_BF16)
    exact = paged_attention_reference(q.float(), kv_k.float(), kv_v.float(), layout, scale)
    ours = (out.float() - exact).abs().max().item()
    theirs = (expected.float() - exact).abs().max().item()
    assert ours <= theirs + 2**-8 * exact.abs().max().item(), (ours, theirs)


# --- paged attention ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), MODELS)
def test_mixed_prefill_and_decode(heads: int, kv_heads: int, head_dim: int) -> None:
    """A chunk after a long past, a fresh prefill and decodes from 1 to 4097 keys, in one launch."""
    query_lens = [512, 300, 1, 1, 1, 1, 1]
    context_lens = [1512, 300, 1, 17, 1024, 3000, 4097]
    check_attention(*paged_batch(query_lens, context_lens, heads, kv_heads, head_dim))


@pytest.mark.parametrize("batch", [1, 4, 64])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), MODELS)
def test_decode(heads: int, kv_heads: int, head_dim: int, batch: int) -> None:
    """Decode batches the heuristic splits (1, 4) and leaves whole (64), contexts around 3k."""
    rng = random.Random(batch)
    context_lens = [rng.randrange(2048, 4096) for _ in range(batch)]
    check_attention(*paged_batch([1] * batch, context_lens, heads, kv_heads, head_dim, seed=batch))


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), MODELS)
def test_decode_with_one_long_context_among_short(heads: int, kv_heads: int, head_dim: int) -> None:
    """31 decodes of about 1,100 keys and one of 30,000: every one cut into splits of one length for the batch
    (the long one then gets up to 32 splits and the short ones few)."""
    rng = random.Random(7)
    context_lens = [rng.randrange(900, 1300) for _ in range(31)] + [30_000]
    check_attention(*paged_batch([1] * 32, context_lens, heads, kv_heads, head_dim, seed=7))


@pytest.mark.parametrize("num_splits", [1, 3, 16, 32])
def test_forced_splits(num_splits: int) -> None:
    batch = paged_batch([64, 1, 1], [2000, 3000, 700], 12, 2, 128)
    check_attention(*batch, num_splits=num_splits)


@pytest.mark.parametrize("block_size", [7, 32, 64, 128])
def test_other_block_sizes(block_size: int) -> None:
    """A prefill chunk beside decodes, then decodes alone (balanced splits, a program per sequence). At 64
    and 128 every 64-key tile lies in one block: one table read and a contiguous run of slots."""
    check_attention(*paged_batch([100, 1, 1], [900, 1500, 33], 28, 4, 128, block_size=block_size))
    check_attention(*paged_batch([1, 1, 1, 1], [1500, 64, 1, 700], 28, 4, 128, block_size=block_size, seed=1))


def test_fp32_uses_ieee_products() -> None:
    """fp32 stays fp32 (Triton's default TF32 would miss this tolerance by orders of magnitude)."""
    check_attention(*paged_batch([40, 1, 1], [400, 1000, 65], 4, 2, 16, dtype=torch.float32))


def test_dispatch_picks_the_kernel_on_cuda() -> None:
    q, kv_k, kv_v, layout = paged_batch([5, 1], [5, 300], 12, 2, 128)
    scale = 128**-0.5
    assert torch.equal(
        attention.paged_attention(q, kv_k, kv_v, layout, scale),
        attention.paged_attention_triton(q, kv_k, kv_v, layout, scale),
    )


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_checkpoint(tmp_path_factory.mktemp("kernels-gpu") / "tiny", "tiny", seed=11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_forward_with_the_kernel(tiny_checkpoint: Path, dtype: torch.dtype) -> None:
    """The tiny model on CUDA: prefills, then a chunk and decodes, with kernel vs reference attention."""
    model = LanguageModel.from_checkpoint(tiny_checkpoint, device=CUDA, dtype=dtype)
    block_size = 16
    steps = [([12, 30, 5], [12, 30, 5]), ([1, 18, 1], [13, 48, 6])]
    pool = list(range(16))
    random.Random(8).shuffle(pool)
    tables = [pool[0:2], pool[2:6], pool[6:8]]
    caches = [PagedKVCache.for_model(model, 16, block_size) for _ in range(2)]
    g = torch.Generator().manual_seed(9)
    for query_lens, context_lens in steps:
        layout = BatchLayout.build(query_lens, context_lens, tables, block_size, CUDA, num_blocks=16)
        embeds = torch.randn(layout.num_tokens, model.spec.hidden_size, generator=g)
        positions = torch.randint(0, 64, (3, layout.num_tokens), generator=g)
        rows = range(layout.num_tokens)
        expected = paged_forward(model, embeds, positions, layout, caches[0], logits_for=rows).float()
        actual = paged_forward(
            model, embeds, positions, layout, caches[1], logits_for=rows, attention=attention.paged_attention
        ).float()
        rel = 1e-5 if dtype == torch.float32 else 3e-2
        assert ((actual - expected).abs() <= rel * expected.abs().amax(-1, keepdim=True)).all()


# --- the other kernels --------------------------------------------------------------------------------


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), MODELS)
def test_reshape_and_cache(heads: int, kv_heads: int, head_dim: int) -> None:
    _, kv_k, kv_v, layout = paged_batch([512, 1, 1], [1512, 17, 3000], heads, kv_heads, head_dim)
    g = torch.Generator(device=CUDA).manual_seed(1)
    qkv = torch.randn((layout.num_tokens, heads + 2 * kv_heads, head_dim), generator=g, device=CUDA).bfloat16()
    k, v = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    ours = (kv_k.clone(), kv_v.clone())
    cache.reshape_and_cache(k, v, *ours, layout.slot_mapping)
    cache.reshape_and_cache_reference(k, v, kv_k, kv_v, layout.slot_mapping)
    assert torch.equal(ours[0].nan_to_num(), kv_k.nan_to_num()) and torch.equal(ours[1].nan_to_num(), kv_v.nan_to_num())


@pytest.mark.parametrize("hidden", [1536, 3584])  # 2b, 7b
def test_norms(hidden: int) -> None:
    g = torch.Generator(device=CUDA).manual_seed(2)
    x = (3 * torch.randn((257, hidden), generator=g, device=CUDA)).bfloat16()
    residual = torch.randn((257, hidden), generator=g, device=CUDA).bfloat16()
    weight = (1 + 0.1 * torch.randn(hidden, generator=g, device=CUDA)).bfloat16()
    assert ulps_apart(norm.rms_norm(x, weight, 1e-6), norm.rms_norm_reference(x, weight, 1e-6)) <= 2
    normed, summed = norm.fused_add_rms_norm(x, residual, weight, 1e-6)
    expected_normed, expected_summed = norm.fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    assert torch.equal(summed, expected_summed)
    assert ulps_apart(normed, expected_normed) <= 2


@pytest.mark.parametrize("hidden", [1280])  # the vision tower's width (2b and 7b)
def test_fused_add_layer_norm(hidden: int) -> None:
    g = torch.Generator(device=CUDA).manual_seed(3)
    x = (3 * torch.randn((4099, hidden), generator=g, device=CUDA) + 2.5).bfloat16()
    residual = torch.randn((4099, hidden), generator=g, device=CUDA).bfloat16()
    weight = (1 + 0.1 * torch.randn(hidden, generator=g, device=CUDA)).bfloat16()
    bias = (0.1 * torch.randn(hidden, generator=g, device=CUDA)).bfloat16()
    normed, summed = norm.fused_add_layer_norm(x, residual, weight, bias, 1e-6)
    expected_normed, expected_summed = norm.fused_add_layer_norm_reference(x, residual, weight, bias, 1e-6)
    assert torch.equal(summed, expected_summed)
    # One bf16 rounding apart at unit scale; not in ulps: the bias makes outputs near zero, where torch's
    # Welford statistics and the kernel's two passes differ by more than such an output's own ulp.
    torch.testing.assert_close(normed, expected_normed, rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("intermediate", [8960, 18944])  # 2b, 7b
def test_silu_and_mul(intermediate: int) -> None:
    g = torch.Generator(device=CUDA).manual_seed(3)
    gate_up = torch.randn((257, 2 * intermediate), generator=g, device=CUDA).bfloat16() * 4
    gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
    assert ulps_apart(activation.silu_and_mul(gate, up), activation.silu_and_mul_reference(gate, up)) <= 3


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), MODELS)
def test_apply_mrope(heads: int, kv_heads: int, head_dim: int) -> None:
    g = torch.Generator(device=CUDA).manual_seed(4)
    tokens = 1000
    positions = torch.randint(0, 30_000, (3, tokens), generator=g, device=CUDA)
    inv_freq = rope_inv_freq(head_dim, 1_000_000.0, CUDA)
    cos, sin = mrope_cos_sin(positions, inv_freq, (16, 24, 24), torch.bfloat16)
    qkv = torch.randn((tokens, heads + 2 * kv_heads, head_dim), generator=g, device=CUDA).bfloat16()
    q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
    q_rot, k_rot = rotary.apply_mrope(q, k, cos, sin)
    # The kernel rounds each product to bf16 as the reference's tensor ops do, so where the two terms cancel
    # both give an exact 0 (a plain cast pair did not: the compiler fused a product into the add; see round_to).
    expected_q, expected_k = rotary.apply_mrope_reference(q, k, cos, sin)
    assert ulps_apart(q_rot, expected_q) <= 1 and ulps_apart(k_rot, expected_k) <= 1
