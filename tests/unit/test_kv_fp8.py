"""The FP8 KV cache (``[decoder] kv_cache_dtype = "fp8"``): e4m3 values with an fp32 scale per (token, kv head).

The torch side runs here: the quantization's definition, the cache's writes and block copies, the reference attention
over it, the model's forward over it against a cache of the model's dtype, the capacity and the setting's checks. The
Triton kernels (cache write and attention) run in Triton's interpreter in a child process (`test_kernels_in_
interpreter`, as tests/unit/test_fp8_kernels.py does: triton picks the interpreter when first imported).

Tolerances:
- quantization, cache write (reference and kernel): equal (one fp32 amax, IEEE divisions, round to nearest even on
  e4m3's grid); FP8 values compared as values, since the interpreter's cast writes -0 as +0.
- attention over an FP8 cache: the kernel dequantizes each tile exactly as the reference does (fp32 product, one
  rounding to q's dtype), so it meets the bounds test_kernels.py holds it to over a 16/32-bit cache (fp32: the absolute
  one relative to the outputs' size, which the V outliers raise).
- the model over an FP8 cache against the model's dtype: each cached value moves by at most half an e4m3 step
  (2**-4 relative, 2**-10 of the scale below 2**-6 of it); `FP8_LOGITS` bounds what that does to the tiny model's
  logits (a cache read without its key scales misses it).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.config import Config, DecoderConfig
from tests.triton_setup import interpreted_in_child
from workers.decoder.config import EngineConfig, check_kv_cache_dtype
from workers.decoder.worker import kv_cache_blocks
from workers.kernels import attention, cache
from workers.kernels.cache import KV_FP8, dequantize_kv_reference, quantize_kv_reference, reshape_and_cache_reference
from workers.models.language import LanguageModel
from workers.models.paged import (
    BatchLayout,
    PagedKVCache,
    fuse_layers,
    kv_cache_dtype,
    paged_attention_reference,
    paged_forward,
)
from workers.models.synth import generate_checkpoint

CHILD = "VLM_KV_FP8_INTERPRETER_CHILD"
INTERPRETED = interpreted_in_child(CHILD, "workers.kernels.attention_triton")
kernel = pytest.mark.skipif(not INTERPRETED, reason="runs in test_kernels_in_interpreter's child process")

# Of the row's logit scale (max |logit|). Measured worst 0.1 on the tiny model (random weights, whose two layers
# amplify the cache's rounding; its bf16 weights move the fp32 logits by up to 0.04); unscaled keys: > 1.
FP8_LOGITS = 0.15
GEOMETRIES = [(2, 16), (3, 64), (1, 128)]  # (kv_heads, head_dim): 3 heads pad to 4 in the cache kernel


def kv_vectors(tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """k/v [T, kv_heads, D] over six decades (e4m3 subnormals occur after scaling), a bias-like outlier column in head
    0 (Qwen's k bias), and one all-zero vector."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, kv_heads, head_dim, generator=g) * 10.0 ** torch.empty(tokens, kv_heads, head_dim).uniform_(
        -3, 1, generator=g
    )
    x[:, 0, 1] += 300.0
    x[tokens // 2, -1] = 0
    return x.to(dtype)


# --- the definition ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantization_is_the_definition(dtype: torch.dtype) -> None:
    x = kv_vectors(9, 3, 64, dtype, seed=1)
    q, scale = quantize_kv_reference(x)
    assert q.dtype == KV_FP8 and q.shape == x.shape and scale.dtype == torch.float32 and scale.shape == (9, 3)
    amax = x.float().abs().amax(-1)
    nonzero = amax > 0
    assert torch.equal(scale[nonzero], amax[nonzero] / torch.full_like(amax[nonzero], 448.0))
    expected = (x.float() * (torch.ones_like(scale) / scale)[..., None]).clamp(-448, 448).to(KV_FP8)
    assert torch.equal(q.float(), expected.float())
    assert (q.float().abs().amax(-1)[nonzero] == 448).all()  # each vector's largest value lands on e4m3's max
    deq = dequantize_kv_reference(q, scale, torch.float32)
    assert torch.equal(deq[4, -1], torch.zeros(64))  # the zero vector comes back as zeros
    half_step = 2**-4 * x.float().abs() + 2**-10 * scale[..., None]
    assert ((deq - x.float()).abs() <= half_step).all()
    assert torch.equal(dequantize_kv_reference(q, scale, dtype), (q.float() * scale[..., None]).to(dtype))


def test_cache_write_quantizes_and_copies_blocks_with_their_scales() -> None:
    x_k, x_v = kv_vectors(5, 2, 16, torch.float32, seed=2), kv_vectors(5, 2, 16, torch.float32, seed=3)
    slots = torch.tensor([9, 0, 4, 13, 6])
    kv = PagedKVCache(2, 2, 16, num_blocks=4, block_size=4, cache_dtype=KV_FP8)
    assert kv.fp8 and kv.dtype == torch.float32 and kv.cache_dtype == KV_FP8
    kv.write(1, slots, x_k, x_v)
    for x, store, scales in ((x_k, kv.keys, kv.key_scales), (x_v, kv.values, kv.value_scales)):
        q, scale = quantize_kv_reference(x)
        assert torch.equal(store[1][slots].float(), q.float()) and torch.equal(scales[1][slots], scale)
        assert not store[0].float().any() and not scales[0].any()  # the other layer untouched
    # the cache kernel's reference writes what the cache's own write does
    keys, values = torch.zeros_like(kv.keys[1]), torch.zeros_like(kv.values[1])
    k_scale, v_scale = torch.zeros_like(kv.key_scales[1]), torch.zeros_like(kv.value_scales[1])
    reshape_and_cache_reference(x_k, x_v, keys, values, slots, k_scale, v_scale)
    assert torch.equal(keys.view(torch.uint8), kv.keys[1].view(torch.uint8))
    assert torch.equal(values.view(torch.uint8), kv.values[1].view(torch.uint8))
    assert torch.equal(k_scale, kv.key_scales[1]) and torch.equal(v_scale, kv.value_scales[1])
    kv.copy_blocks([(2, 3)])  # slots 8..11 to 12..15: slot 9's vector and scale now also at 13
    for store in (kv.keys, kv.values, kv.key_scales, kv.value_scales):
        assert torch.equal(store[1][12:16].float(), store[1][8:12].float())
    with pytest.raises(ValueError, match="FP8 cache needs"):
        reshape_and_cache_reference(x_k, x_v, keys, values, slots)


def test_reference_attention_reads_the_dequantized_cache() -> None:
    """Over an FP8 cache: exactly the attention over the cache dequantized to q's dtype, and not that over zero
    scales (the scales are read)."""
    layout = BatchLayout.build([3, 1], [7, 12], [[2, 0], [1, 3, 4]], 4, num_blocks=6)
    slots = layout.context_slots
    x_k, x_v = kv_vectors(len(slots), 2, 16, torch.float32, seed=4), kv_vectors(len(slots), 2, 16, torch.float32, 5)
    kv = PagedKVCache(1, 2, 16, num_blocks=6, block_size=4, cache_dtype=KV_FP8)
    kv.write(0, slots, x_k, x_v)
    q = torch.randn(layout.num_tokens, 4, 16, generator=torch.Generator().manual_seed(6))
    actual = paged_attention_reference(q, kv.keys[0], kv.values[0], layout, 0.25, **kv.scales(0))
    plain_k = dequantize_kv_reference(kv.keys[0], kv.key_scales[0], torch.float32)
    plain_v = dequantize_kv_reference(kv.values[0], kv.value_scales[0], torch.float32)
    assert torch.equal(actual, paged_attention_reference(q, plain_k, plain_v, layout, 0.25))
    assert (
        actual - paged_attention_reference(q, x_k_at(x_k, slots, 24), x_k_at(x_v, slots, 24), layout, 0.25)
    ).abs().max() < 0.05 * actual.abs().max()
    with pytest.raises(ValueError, match="FP8 cache needs k_scale"):
        paged_attention_reference(q, kv.keys[0], kv.values[0], layout, 0.25)


def x_k_at(x: torch.Tensor, slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """A plain cache of ``num_slots`` holding x's vectors at ``slots``."""
    plain = torch.zeros(num_slots, *x.shape[1:])
    plain[slots] = x
    return plain


# --- the model over it --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_checkpoint(tmp_path_factory.mktemp("kvfp8") / "tiny", "tiny", seed=11)


@pytest.fixture(scope="module")
def tiny_model(tiny_path: Path) -> LanguageModel:
    return LanguageModel.from_checkpoint(tiny_path, dtype=torch.float32)


class RoundTripCache(PagedKVCache):
    """A cache of the model's dtype that stores each k/v as FP8 would give it back: quantized, then dequantized.
    The model over an FP8 cache must compute exactly what it computes over this one."""

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        super().write(layer, slots, *(dequantize_kv_reference(*quantize_kv_reference(x), x.dtype) for x in (k, v)))


def prefill_and_decode(model: LanguageModel, kv: PagedKVCache, fused: bool = False, **kw: object) -> torch.Tensor:
    """Logits of every token of two prefills (12 and 30 tokens), then three steps of one decode token each."""
    spec, block_size = model.spec, kv.block_size
    tables = [[5, 1, 7], [2, 0, 6, 3, 4]]
    g = torch.Generator().manual_seed(9)
    steps = [([12, 30], [12, 30])] + [([1, 1], [13 + i, 31 + i]) for i in range(3)]
    layers = fuse_layers(model) if fused else None
    out = []
    for query_lens, context_lens in steps:
        layout = BatchLayout.build(query_lens, context_lens, tables, block_size, num_blocks=kv.num_blocks)
        embeds = torch.randn(layout.num_tokens, spec.hidden_size, generator=g)
        positions = torch.arange(context_lens[0] - query_lens[0], context_lens[0]).expand(3, -1)
        positions = torch.cat(
            [positions, torch.arange(context_lens[1] - query_lens[1], context_lens[1]).expand(3, -1)], 1
        )
        rows = range(layout.num_tokens)
        out.append(paged_forward(model, embeds, positions, layout, kv, logits_for=rows, fused=layers, **kw))
    return torch.cat(out)


def test_model_over_an_fp8_cache(tiny_model: LanguageModel) -> None:
    """Prefill + decode: over an FP8 cache exactly what the model computes over the round-tripped values; against
    the plain cache within FP8's error, which the same cache read without its scales misses."""
    fp8 = prefill_and_decode(tiny_model, PagedKVCache.for_model(tiny_model, 8, 16, KV_FP8))
    round_trip = prefill_and_decode(tiny_model, RoundTripCache.for_model(tiny_model, 8, 16))
    plain = prefill_and_decode(tiny_model, PagedKVCache.for_model(tiny_model, 8, 16))
    assert torch.equal(fp8, round_trip)
    scale = plain.abs().amax(-1, keepdim=True)
    error = ((fp8 - plain).abs() / scale).max().item()
    assert 0 < error <= FP8_LOGITS, error
    unscaled = prefill_and_decode(tiny_model, PagedKVCache.for_model(tiny_model, 8, 16, KV_FP8), attention=unscaled_k)
    assert ((unscaled - plain).abs() / scale).max().item() > FP8_LOGITS


def unscaled_k(
    q: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor, layout: BatchLayout, scale: float, **scales: torch.Tensor
) -> torch.Tensor:
    """The reference attention reading the FP8 keys without their scales (a wrong implementation)."""
    ones = torch.ones_like(scales["k_scale"])
    return paged_attention_reference(q, kv_k, kv_v, layout, scale, k_scale=ones, v_scale=scales["v_scale"])


def test_fused_layers_over_an_fp8_cache(tiny_model: LanguageModel) -> None:
    """The fused layers write through `reshape_and_cache` (its reference here): the same as the eager layers."""
    eager = prefill_and_decode(tiny_model, PagedKVCache.for_model(tiny_model, 8, 16, KV_FP8))
    fused = prefill_and_decode(tiny_model, PagedKVCache.for_model(tiny_model, 8, 16, KV_FP8), fused=True)
    scale = eager.abs().amax(-1, keepdim=True)
    assert ((fused - eager).abs() <= 1e-4 * scale).all()


# --- capacity and settings ----------------------------------------------------------------------------------------


def test_an_fp8_block_costs_a_byte_an_element_and_its_scales(tiny_model: LanguageModel) -> None:
    spec = dataclasses.replace(tiny_model.spec, num_layers=28, num_kv_heads=4, head_dim=128)  # Qwen2-VL-7B's cache
    bf16 = PagedKVCache.bytes_per_block(spec, 64, torch.bfloat16)
    fp8 = PagedKVCache.bytes_per_block(spec, 64, KV_FP8)
    assert bf16 == 2 * 28 * 64 * 4 * 128 * 2
    assert fp8 == 2 * 28 * 64 * 4 * (128 + 4)
    assert 1.9 < bf16 / fp8 < 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_capacity_from_the_same_bytes(tiny_path: Path, dtype: torch.dtype) -> None:
    """The worker's block count: budget // (a block's bytes), so ~2x the blocks of a bf16 cache (head_dim 128;
    the tiny model's head_dim 16 makes the 4-byte scale weigh more), ~4x those of the CPU's fp32 cache."""
    cfg = Config()
    cfg.decoder.kv_cache_bytes = 64 * 2**20
    model = LanguageModel.from_checkpoint(tiny_path, dtype=dtype)
    plain = kv_cache_blocks(cfg, model)
    cfg.decoder.kv_cache_dtype = "fp8"
    fp8 = kv_cache_blocks(cfg, model)
    spec, head_dim = model.spec, model.spec.head_dim
    assert fp8 == cfg.decoder.kv_cache_bytes // (2 * spec.num_layers * 64 * spec.num_kv_heads * (head_dim + 4))
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert fp8 * (head_dim + 4) // (head_dim * itemsize) in (plain, plain - 1)  # plain's blocks x the byte ratio


def test_the_setting_is_checked() -> None:
    settings = DecoderConfig()
    settings.kv_cache_dtype = "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype: expected 'auto'"):
        settings.validate("decoder")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_cache_dtype("fp16", torch.bfloat16)
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16 and kv_cache_dtype("fp8", torch.float32) == KV_FP8
    settings.kv_cache_dtype = "fp8"
    settings.validate("decoder")
    config = EngineConfig.from_settings(settings, torch.device("cpu"), 16, 512)  # CPU: the dequantizing reference
    assert config.kv_cache_dtype == "fp8" and config.attention is attention.paged_attention_reference
    check_kv_cache_dtype("fp8", (9, 0), "cuda:0")  # H100/H200: the Triton kernels
    check_kv_cache_dtype("fp8", None, "cuda:0")  # kernels = "torch" on any GPU
    check_kv_cache_dtype("auto", (8, 0), "cuda:0")
    with pytest.raises(ValueError, match=r'kv_cache_dtype = "fp8" needs a GPU of compute capability >= 8\.9.*8\.0'):
        check_kv_cache_dtype("fp8", (8, 0), "cuda:0")  # A100: Triton has no e4m3 conversion there


# --- the Triton kernels, interpreted ------------------------------------------------------------------------------


@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_heads", "head_dim"), GEOMETRIES)
def test_cache_kernel_stores_the_reference_bytes_and_scales(dtype: torch.dtype, kv_heads: int, head_dim: int) -> None:
    k, v = kv_vectors(7, kv_heads, head_dim, dtype, seed=head_dim), kv_vectors(7, kv_heads, head_dim, dtype, seed=7)
    slots = torch.tensor([11, 3, 0, 15, 8, 4, 9])
    stores = [
        [torch.zeros(16, kv_heads, head_dim, dtype=KV_FP8) for _ in range(2)]
        + [torch.zeros(16, kv_heads) for _ in range(2)]
        for _ in range(2)
    ]
    cache.reshape_and_cache_triton(k, v, *stores[0][:2], slots, *stores[0][2:])
    reshape_and_cache_reference(k, v, *stores[1][:2], slots, *stores[1][2:])
    for actual, expected in zip(*stores, strict=True):
        assert torch.equal(actual.float(), expected.float())  # as values: the interpreter writes -0 as +0


@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("query_lens", "context_lens", "num_splits"),
    [([5, 1, 9], [5, 20, 30], 1), ([1, 1, 1], [40, 3, 17], None), ([1, 1], [70, 33], 3)],
    ids=["prefill", "decode-balanced", "decode-split"],
)
def test_attention_kernel_over_an_fp8_cache(
    dtype: torch.dtype, query_lens: list[int], context_lens: list[int], num_splits: int | None
) -> None:
    block_size, heads, kv_heads, head_dim = 16, 4, 2, 64
    need = [-(-c // block_size) for c in context_lens]
    pool = list(range(sum(need) + 2))[::-1]
    tables = [[pool.pop() for _ in range(n)][::-1] for n in need]
    layout = BatchLayout.build(query_lens, context_lens, tables, block_size, num_blocks=sum(need) + 2)
    kv = PagedKVCache(1, kv_heads, head_dim, sum(need) + 2, block_size, dtype=dtype, cache_dtype=KV_FP8)
    slots = layout.context_slots
    kv.write(
        0, slots, kv_vectors(len(slots), kv_heads, head_dim, dtype, 1), kv_vectors(len(slots), kv_heads, 64, dtype, 2)
    )
    q = torch.randn(layout.num_tokens, heads, head_dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    actual = attention.paged_attention_triton(
        q, kv.keys[0], kv.values[0], layout, 0.125, num_splits=num_splits, block_n=16, **kv.scales(0)
    )
    expected = paged_attention_reference(q, kv.keys[0], kv.values[0], layout, 0.125, **kv.scales(0))
    # test_kernels.py's bounds for the kernel over a 16/32-bit cache, whose values are of unit scale: here the V
    # outliers make the outputs larger, and the fp32 sums' reordering with them
    size = expected.abs().amax().item()
    tolerance = {"atol": 2e-6 * size, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1.6e-2, "rtol": 1.6e-2}
    torch.testing.assert_close(actual, expected, **tolerance)
    unscaled = attention.paged_attention_triton(
        q,
        kv.keys[0],
        kv.values[0],
        layout,
        0.125,
        num_splits=num_splits,
        block_n=16,
        k_scale=torch.ones_like(kv.key_scales[0]),
        v_scale=kv.value_scales[0],
    )
    assert not torch.allclose(unscaled, expected, **tolerance)  # the k scales are read


@kernel
def test_model_with_the_kernels_over_an_fp8_cache(tiny_model: LanguageModel) -> None:
    """The fused layers with the Triton attention (interpreted; the cache write is the reference on CPU tensors, the
    kernel's bytes are checked above) against the reference layers."""
    expected = prefill_and_decode(tiny_model, PagedKVCache.for_model(tiny_model, 8, 16, KV_FP8))
    actual = prefill_and_decode(
        tiny_model, PagedKVCache.for_model(tiny_model, 8, 16, KV_FP8), fused=True, attention=kernel_attention
    )
    scale = expected.abs().amax(-1, keepdim=True)
    assert ((actual - expected).abs() <= 1e-4 * scale).all()


def kernel_attention(
    q: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor, layout: BatchLayout, scale: float, **kw: torch.Tensor
) -> torch.Tensor:
    return attention.paged_attention_triton(q, kv_k, kv_v, layout, scale, block_n=16, **kw)


# --- the interpreter run --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_kernels_in_interpreter() -> None:
    """This module in a process of its own, where triton can still be imported under the interpreter."""
    if INTERPRETED:
        pytest.skip("the kernels run in this process")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            __file__,
            "-q",
            "-p",
            "no:cacheprovider",
            "-x",
            "-k",
            "kernel and not in_interpreter",
        ],
        env={**os.environ, CHILD: "1", "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,  # (a bound for a hang, not a speed check)
        cwd=Path(__file__).resolve().parents[2],
    )
    tail = "\n".join(result.stdout.splitlines()[-15:])
    assert result.returncode == 0, tail + result.stderr[-3000:]
    assert " skipped" not in tail.splitlines()[-1], tail
