"""The Triton kernels of `workers.kernels` against their plain-torch references, in Triton's interpreter on CPU.

The interpreter runs each kernel program by program in numpy: the same kernel source, indexing, masking and
dtype conversions as on a GPU, so wrong addressing, masks or block-table walks show up here. What it cannot
show (the compiled code's speed, tensor-core rounding, races between programs) is for
tests/gpu/test_kernels_gpu.py. One test compiles every kernel for the H200 (sm_90) without a GPU
(`benchmarks.aot`), which the interpreter never does: that catches what only the compiler rejects.

Triton picks the interpreter once, when it is imported, from TRITON_INTERPRET; this module sets the variable
before that import. Where it cannot (triton already imported compiled in this process, or a CUDA device
present, where tests/gpu checks the compiled kernels) it skips, saying how to run it on its own.
In a full test run triton is usually imported compiled before this module (torch._dynamo imports it); then
one test runs this module again in a fresh process and the others skip here.

Tolerances (measured worst cases are in the comments beside them):
- paged attention fp32 vs the fp32 reference: ATTN_FP32; bf16 vs the bf16 reference: ATTN_BF16, and vs an
  fp32 computation no worse than the bf16 reference itself (plus one bf16 rounding).
- reshape_and_cache: bit for bit.
- rms_norm, fused_add_rms_norm: fp32 within FP32_ULPS units in the last place (measured 3: the fp32 sum's
  order), 16-bit within 1 ulp (measured 0); the fused residual sum bit for bit.
- fused_add_layer_norm: fp32 within LAYER_NORM_FP32 of the row's scale (an output near zero is a difference
  of near-equal terms, so ulps say nothing there), 16-bit within 1 ulp; the residual sum bit for bit.
- silu_and_mul: fp32 within FP32_ULPS (measured 3: exp), 16-bit within 2 ulps (measured 2 in fp16, 0 in bf16:
  an fp32 ulp of exp can flip the rounding of silu(gate), which the product with up then scales).
- apply_mrope: bit for bit in every dtype (products of 16-bit values are exact in fp32, roundings as torch's).
- vision_rotary_qk: bit for bit (fp32 arithmetic from the same tables, no fused multiply-add); quick_gelu:
  fp32 within FP32_ULPS, 16-bit within 2 ulps (an fp32 ulp of exp can flip a rounding, as in silu).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import random
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from tests.triton_setup import fix_interpreter_scalar_index, run_sharded
from workers.kernels import (
    activation,
    attention,
    cache,
    norm,
    rotary,
    vision,
)
from workers.kernels.attention import AttentionMetadata, attention_metadata
from workers.models.language import LanguageModel, mrope_cos_sin, rope_inv_freq
from workers.models.paged import BatchLayout, PagedKVCache, paged_attention_reference, paged_forward
from workers.models.synth import generate_checkpoint

KERNEL_MODULES = (
    "attention_triton",
    "cache_triton",
    "norm_triton",
    "activation_triton",
    "rotary_triton",
    "vision_triton",
)


def _import_interpreted_triton() -> tuple[str | None, bool]:
    """Import triton and the kernel modules under TRITON_INTERPRET=1.

    Returns (the reason to skip the whole module, or None; whether the kernels run in this process). They
    cannot when triton was imported compiled already (torch._dynamo imports it, and transformers imports
    torch._dynamo, in test modules collected before this one): then `test_interpreter_in_subprocess` runs
    this module in a fresh process.
    """
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install -e '.[kernels]')", False
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return (
            "a CUDA device is present, so tests/gpu checks the compiled kernels; for the interpreter run "
            "`TRITON_INTERPRET=1 pytest tests/unit/test_kernels.py`"
        ), False
    if "triton" not in sys.modules:
        # It stays set: parts of triton imported lazily at the first launch check it again. Without CUDA
        # nothing else in the test suite launches Triton kernels.
        os.environ["TRITON_INTERPRET"] = "1"
        for name in KERNEL_MODULES:
            importlib.import_module(f"workers.kernels.{name}")
    from workers.kernels._launch import interpreted

    if not interpreted():
        return None, False
    fix_interpreter_scalar_index()
    return None, True


_SKIP_REASON, _IN_PROCESS = _import_interpreted_triton()
pytestmark = pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")
SUBPROCESS_TEST = "test_interpreter_in_subprocess"


@pytest.fixture(autouse=True)
def _kernels_run_here(request: pytest.FixtureRequest) -> None:
    if not _IN_PROCESS and request.node.name != SUBPROCESS_TEST:
        pytest.skip(f"triton was imported compiled earlier in this process: {SUBPROCESS_TEST} runs this module")


ATTN_FP32 = {"atol": 2e-6, "rtol": 1e-5}  # measured worst: 6.4e-7 absolute on outputs up to 3.4
ATTN_BF16 = {"atol": 1.6e-2, "rtol": 1.6e-2}  # measured worst: 7.8e-3, one bf16 ulp in [1, 2)
FP32_ULPS = 4  # measured worst: 3
LAYER_NORM_FP32 = 2e-6  # absolute, on outputs of unit scale; measured worst: 4.8e-7
GEOMETRIES = [  # (heads, kv_heads, head_dim): GQA ratios 2 (the tiny model), 1, 7, 7 with a single kv head
    pytest.param(4, 2, 16, id="tiny-4x2x16"),
    pytest.param(4, 4, 64, id="mha-4x4x64"),
    pytest.param(14, 2, 128, id="gqa7-14x2x128"),
    pytest.param(7, 1, 64, id="gqa7-7x1x64"),
]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


# --- helpers ------------------------------------------------------------------------------------------


def ulps_apart(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest |actual - expected| in units of the last place of ``expected``'s dtype at its magnitude."""
    bits = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}[expected.dtype]
    e = expected.float()
    _, exponent = torch.frexp(e)
    smallest = torch.finfo(expected.dtype).tiny * 2.0 ** (1 - bits)  # the subnormal spacing (also at 0)
    ulp = torch.where(e == 0, smallest, torch.ldexp(torch.ones_like(e), exponent - bits).clamp_min(smallest))
    return ((actual.float() - e).abs() / ulp).max().item()


def assert_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps16: int = 1) -> None:
    """Within FP32_ULPS in fp32, ``ulps16`` in bf16/fp16."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    limit = FP32_ULPS if expected.dtype == torch.float32 else ulps16
    apart = ulps_apart(actual, expected)
    assert apart <= limit, f"{apart} ulps apart (limit {limit})"


def shuffled_tables(need: Sequence[int], spare: int, seed: int) -> tuple[list[list[int]], int]:
    """Block tables drawn from a shuffled pool (no sequence's blocks contiguous or ordered), and the pool size.

    Every other table gets one unused extra block at its end, as an engine that reserves ahead has.
    """
    extra = [s % 2 for s in range(len(need))]
    num_blocks = sum(need) + sum(extra) + spare
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)
    return [[pool.pop() for _ in range(n + e)] for n, e in zip(need, extra, strict=True)], num_blocks


def paged_batch(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_size: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, BatchLayout]:
    """q [T, heads, D] and caches whose slots outside every context hold NaN: a stray read poisons the output."""
    need = [-(-c // block_size) for c in context_lens]
    tables, num_blocks = shuffled_tables(need, spare=3, seed=seed)
    layout = BatchLayout.build(query_lens, context_lens, tables, block_size, num_blocks=num_blocks)
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks * block_size, kv_heads, head_dim)
    kv_k = torch.full(shape, float("nan"), dtype=dtype)
    kv_v = torch.full(shape, float("nan"), dtype=dtype)
    slots = layout.context_slots
    kv_k[slots] = torch.randn(slots.shape[0], kv_heads, head_dim, generator=g).to(dtype)
    kv_v[slots] = torch.randn(slots.shape[0], kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(layout.num_tokens, heads, head_dim, generator=g).to(dtype)
    return q, kv_k, kv_v, layout


def check_attention(
    q: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor, layout: BatchLayout, **overrides: object
) -> None:
    scale = q.shape[-1] ** -0.5
    out = attention.paged_attention_triton(q, kv_k, kv_v, layout, scale, **overrides)
    expected = paged_attention_reference(q, kv_k, kv_v, layout, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert not out.isnan().any()
    if q.dtype == torch.float32:
        torch.testing.assert_close(out, expected, **ATTN_FP32)
        return
    torch.testing.assert_close(out, expected, **ATTN_BF16)
    # Also against fp32 math on the same inputs: no worse than the bf16 reference, give or take a rounding.
    exact = paged_attention_reference(q.float(), kv_k.float(), kv_v.float(), layout, scale)
    ours = (out.float() - exact).abs().max().item()
    theirs = (expected.float() - exact).abs().max().item()
    assert ours <= theirs + 2**-8 * exact.abs().max().item(), (ours, theirs)


# Sequences of one batch: a fresh prefill, decodes at and across block/tile edges, a chunk after a long past.
MIXED_QUERY_LENS = [9, 1, 6, 1, 1, 40]
MIXED_CONTEXT_LENS = [9, 37, 50, 16, 1, 45]


# --- paged attention ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 7])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), GEOMETRIES)
def test_mixed_batch(heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> None:
    """Prefill chunks and decodes in one launch; 16-key tiles so that the short contexts cross several."""
    batch = paged_batch(MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, block_size, heads, kv_heads, head_dim, dtype)
    check_attention(*batch, block_n=16)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [GEOMETRIES[0], GEOMETRIES[2]])
def test_default_tiles_and_small_query_blocks(heads: int, kv_heads: int, head_dim: int) -> None:
    """The default 64x64 tiles, then 16-row query blocks (a 40-token chunk spans several, 2 tokens each at GQA 7)."""
    batch = paged_batch(MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, 16, heads, kv_heads, head_dim, torch.float32, seed=1)
    check_attention(*batch)
    check_attention(*batch, block_m=16, block_n=16)


@pytest.mark.parametrize("heavy_first", [False, True], ids=["in-order", "heavy-first"])
@pytest.mark.parametrize(("block_m", "block_n"), [(128, 32), (128, 64), (128, 128), (64, 128), (32, 64)])
def test_prefill_tile_shapes(block_m: int, block_n: int, heavy_first: bool) -> None:
    """Every tile shape `benchmarks.kernels_prefill` may choose for prefill gives the same attention: 128
    query rows hold 21 tokens of a 6-head group (126 rows), 32 rows hold 5, a 128-key tile spans several
    blocks; and a sequence's query blocks may run last first."""
    from workers.kernels.attention_triton import Tiles

    batch = paged_batch(MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, 16, 12, 2, 32, torch.float32, seed=4)
    check_attention(*batch, tiles=Tiles(block_m, block_n, num_warps=8, num_stages=3, heavy_first=heavy_first))


@pytest.mark.parametrize(("block_size", "block_n"), [(32, 16), (64, 32), (32, 32)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [GEOMETRIES[0], GEOMETRIES[2]])
def test_tiles_within_one_block(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int, block_n: int
) -> None:
    """Blocks a whole number of key tiles long: a tile reads one table entry and a contiguous run of slots.
    The mixed batch (tiles ending mid-block, a context of 1) and a decode batch split by the heuristic; the
    slots outside the contexts hold NaN, so a read past a context's end shows."""
    from workers.kernels import attention_triton

    batch = paged_batch(MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, block_size, heads, kv_heads, head_dim, dtype, seed=5)
    _, launches = attention_triton.plan(*batch[:3], attention_metadata(batch[3]), 0.1, block_n=block_n)
    assert launches[0].constexprs["BLOCK_SIZE"] % launches[0].constexprs["BLOCK_N"] == 0
    check_attention(*batch, block_n=block_n)
    decode = paged_batch([1] * 4, [700, 65, 1, block_size], block_size, heads, kv_heads, head_dim, dtype, seed=6)
    check_attention(*decode, block_n=block_n)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "num_splits", "dtype"),
    [
        pytest.param(*GEOMETRIES[0].values, 3, DTYPES[1].values[0], id="tiny-4x2x16-3-bf16"),
        pytest.param(*GEOMETRIES[0].values, 8, DTYPES[0].values[0], id="tiny-4x2x16-8-fp32"),
        pytest.param(*GEOMETRIES[3].values, 3, DTYPES[0].values[0], id="gqa7-7x1x64-3-fp32"),
        pytest.param(*GEOMETRIES[3].values, 8, DTYPES[1].values[0], id="gqa7-7x1x64-8-bf16"),
    ],  # (each geometry with each split count and each dtype: the interpreter's slowest tests, not every triple)
)
def test_split_k(heads: int, kv_heads: int, head_dim: int, num_splits: int, dtype: torch.dtype) -> None:
    """Forced splits on the mixed batch: split edges fall mid-block (block size 7), some splits are empty
    (context 1 or 9 split 8 ways), and the chunk's early queries see nothing in the later splits."""
    batch = paged_batch(MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, 7, heads, kv_heads, head_dim, dtype, seed=2)
    check_attention(*batch, num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [GEOMETRIES[0], GEOMETRIES[2]])
def test_decode_batch_splits_by_itself(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    """A small decode-only batch with a long context: the heuristic splits it (700 keys: 10 splits), into
    splits of one length for the batch."""
    from workers.kernels import attention_triton

    context_lens = [700, 65, 1]
    assert attention_triton.choose_num_splits(len(context_lens) * kv_heads, max(context_lens), 132) == 10
    batch = paged_batch([1, 1, 1], context_lens, 16, heads, kv_heads, head_dim, dtype, seed=3)
    check_attention(*batch)


SKEWED_CONTEXT_LENS = [1200, 40, 300, 1, 200, 64, 65, 129]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "dtype"),
    [
        pytest.param(*GEOMETRIES[0].values, DTYPES[0].values[0], id="tiny-4x2x16-fp32"),
        pytest.param(*GEOMETRIES[2].values, DTYPES[1].values[0], id="gqa7-14x2x128-bf16"),
    ],  # (each geometry and each dtype, not every pair: the interpreter's slowest test, a 1200-key context)
)
def test_balanced_decode_splits(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    """Splits of one length for the whole batch: the long context uses many splits, the short ones few or
    one, and the merge reads only those that were written (a stray read of another split's scratch would
    show)."""
    from workers.kernels import attention_triton

    q, kv_k, kv_v, layout = paged_batch([1] * 8, SKEWED_CONTEXT_LENS, 16, heads, kv_heads, head_dim, dtype, seed=4)
    _, launches = attention_triton.plan(q, kv_k, kv_v, attention_metadata(layout), 0.1, block_n=16)
    assert launches[0].constexprs["BALANCED"] and launches[1].constexprs["BALANCED"]
    check_attention(q, kv_k, kv_v, layout, block_n=16)


# The padding rows merge scratch that no program wrote (as in a graph, where nothing reads them): numpy may warn.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:divide by zero:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_balanced_decode_splits_with_graph_padding() -> None:
    """As a padded decode graph launches it: empty sequences and tokens of no sequence after the real ones,
    splits planned for a longer context than any present. The real rows match the reference, with a
    program per sequence."""
    from workers.kernels import attention_triton

    heads, kv_heads, head_dim = GEOMETRIES[2].values
    q, kv_k, kv_v, layout = paged_batch([1] * 8, SKEWED_CONTEXT_LENS, 16, heads, kv_heads, head_dim, torch.float32)
    real = attention_metadata(layout)
    pad = 3
    width = real.block_table.shape[1]
    padded = AttentionMetadata(
        query_starts=torch.cat([real.query_starts, torch.full((pad,), 8, dtype=torch.int32)]),
        query_lens=torch.cat([real.query_lens, torch.zeros(pad, dtype=torch.int32)]),
        context_lens=torch.cat([real.context_lens, torch.zeros(pad, dtype=torch.int32)]),
        block_table=torch.cat([real.block_table, torch.full((pad, width), -1, dtype=torch.int32)]),
        num_tokens=8 + pad,
        max_query_len=1,
        max_context_len=32768,
        block_size=16,
    )
    q_padded = torch.cat([q, torch.randn(pad, heads, head_dim)])
    _, launches = attention_triton.plan(q_padded, kv_k, kv_v, padded, 0.1, block_n=16)
    assert [launch.constexprs["ONE_PER_SEQUENCE"] for launch in launches] == [True] * 2
    assert launches[0].grid[0] == 8 + pad
    out = attention.paged_attention_triton(q_padded, kv_k, kv_v, padded, head_dim**-0.5, block_n=16)
    expected = paged_attention_reference(q, kv_k, kv_v, layout, head_dim**-0.5)
    torch.testing.assert_close(out[:8], expected, **ATTN_FP32)


def test_fp16() -> None:
    batch = paged_batch(MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, 16, 4, 2, 64, torch.float16, seed=4)
    scale = 64**-0.5
    out = attention.paged_attention_triton(*batch, scale, block_n=16)
    torch.testing.assert_close(out, paged_attention_reference(*batch, scale), atol=2e-3, rtol=2e-3)


def test_block_size_one_and_query_starting_mid_block() -> None:
    batch = paged_batch([3, 1, 5], [3, 20, 12], 1, 4, 2, 16, torch.float32, seed=5)
    check_attention(*batch, block_n=16)


def test_non_contiguous_q_and_cache_views() -> None:
    """q as the first heads of a fused qkv output and a cache that is one half of a [slots, 2, kv, D] pair."""
    q, kv_k, kv_v, layout = paged_batch(MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, 16, 4, 2, 16, torch.float32, seed=6)
    qkv = torch.cat([q, torch.randn(q.shape[0], 4, 16)], dim=1)
    pair = torch.stack([kv_k, kv_v], dim=1)
    check_attention(qkv[:, :4], pair[:, 0], pair[:, 1], layout, block_n=16)


def test_dispatch_on_cpu_is_the_reference() -> None:
    batch = paged_batch([4, 1], [4, 30], 16, 4, 2, 16, torch.float32, seed=7)
    expected = paged_attention_reference(*batch, 0.25)
    assert torch.equal(attention.paged_attention(*batch, 0.25), expected)


def test_metadata_is_int32_and_built_once_per_layout() -> None:
    layout = BatchLayout.build([3, 1], [3, 40], [[5, 2, 9], [7, 1, 0]], 16)
    meta = attention_metadata(layout)
    assert meta is attention_metadata(layout)
    assert meta.query_starts.tolist() == [0, 3, 4]
    assert meta.query_lens.tolist() == [3, 1]
    assert meta.context_lens.tolist() == [3, 40]
    assert meta.block_table.tolist() == [[5, 2, 9], [7, 1, 0]]
    assert {t.dtype for t in (meta.query_starts, meta.query_lens, meta.context_lens, meta.block_table)} == {torch.int32}
    assert (meta.num_tokens, meta.max_query_len, meta.max_context_len, meta.num_seqs) == (4, 3, 40, 2)
    other = BatchLayout.build([3, 1], [3, 40], [[5, 2, 9], [7, 1, 0]], 16)
    assert attention_metadata(other) is not meta
    padded = AttentionMetadata.from_layout(BatchLayout.build([1, 1], [1, 20], [[4], [3, 8]], 16))
    assert padded.block_table.tolist() == [[4, -1], [3, 8]]


def test_choose_num_splits() -> None:
    from workers.kernels.attention_triton import MAX_SPLITS, choose_num_splits

    assert choose_num_splits(200, 100_000, 132) == 1  # enough programs already
    assert choose_num_splits(64, 32_768, 132) == 9  # batch 32 of 2 kv heads: about 4 programs per SM
    assert choose_num_splits(2, 100, 132) == 1  # too short to cut: two splits would need 128 keys
    assert choose_num_splits(2, 400, 132) == 6  # 400 // 64: one key tile each
    assert choose_num_splits(2, 1_000_000, 132) == MAX_SPLITS


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, k, v: (q[:, :3], k, v), "must divide"),
        (lambda q, k, v: (q.double(), k, v), "must share"),
        (lambda q, k, v: (q[:-1], k, v), "tokens"),
        (lambda q, k, v: (q, k[:, :, :8], v[:, :, :8]), "head_dim"),
        (lambda q, k, v: (q, k[:-3], v[:-3]), "whole blocks"),
    ],
)
def test_rejects_bad_inputs(change: object, message: str) -> None:
    q, kv_k, kv_v, layout = paged_batch([2, 1], [2, 20], 16, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match=message):
        attention.paged_attention_triton(*change(q, kv_k, kv_v), layout, 0.25)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"num_splits": 0}, "num_splits"), ({"block_n": 24}, "block_n"), ({"block_m": 8}, "block_m")],
)
def test_rejects_bad_launch_overrides(overrides: dict[str, int], message: str) -> None:
    q, kv_k, kv_v, layout = paged_batch([2, 1], [2, 20], 16, 14, 2, 16, torch.float32)
    with pytest.raises(ValueError, match=message):
        attention.paged_attention_triton(q, kv_k, kv_v, layout, 0.25, **overrides)


# --- the kernel inside the model's forward --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> LanguageModel:
    path: Path = generate_checkpoint(tmp_path_factory.mktemp("kernels") / "tiny", "tiny", seed=11)
    return LanguageModel.from_checkpoint(path, dtype=torch.float32)


def test_paged_forward_with_the_kernel(tiny_model: LanguageModel) -> None:
    """Two steps of the tiny model (prefills, then a chunk and decodes) with kernel vs reference attention."""
    spec, block_size = tiny_model.spec, 16
    steps = [([12, 30, 5], [12, 30, 5]), ([1, 18, 1], [13, 48, 6])]
    tables, num_blocks = shuffled_tables([-(-c // block_size) for c in steps[-1][1]], spare=2, seed=8)
    caches = [PagedKVCache.for_model(tiny_model, num_blocks, block_size) for _ in range(2)]
    g = torch.Generator().manual_seed(9)
    for query_lens, context_lens in steps:
        layout = BatchLayout.build(query_lens, context_lens, tables, block_size, num_blocks=num_blocks)
        embeds = torch.randn(layout.num_tokens, spec.hidden_size, generator=g)
        positions = torch.randint(0, 64, (3, layout.num_tokens), generator=g)  # distinct t/h/w axes
        rows = range(layout.num_tokens)
        expected = paged_forward(tiny_model, embeds, positions, layout, caches[0], logits_for=rows)
        actual = paged_forward(
            tiny_model, embeds, positions, layout, caches[1], logits_for=rows, attention=kernel_attention
        )
        scale = expected.abs().amax(-1, keepdim=True)
        assert ((actual - expected).abs() <= 1e-5 * scale).all()


def kernel_attention(
    q: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor, layout: BatchLayout, scale: float
) -> torch.Tensor:
    return attention.paged_attention_triton(q, kv_k, kv_v, layout, scale, block_n=16)


# --- reshape_and_cache --------------------------------------------------------------------------------


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [*DTYPES, pytest.param(torch.float16, id="fp16")])
@pytest.mark.parametrize(("kv_heads", "head_dim", "block_size"), [(2, 16, 16), (4, 128, 7), (1, 64, 16)])
def test_reshape_and_cache(
    kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, slot_dtype: torch.dtype
) -> None:
    need = [-(-c // block_size) for c in MIXED_CONTEXT_LENS]
    tables, num_blocks = shuffled_tables(need, spare=2, seed=10)
    layout = BatchLayout.build(MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, tables, block_size, num_blocks=num_blocks)
    g = torch.Generator().manual_seed(10)
    # k as the middle heads of a fused qkv projection: a strided view, as the decoder has it.
    qkv = torch.randn(layout.num_tokens, 3 * kv_heads, head_dim, generator=g).to(dtype)
    k, v = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]
    before = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g).to(dtype)
    caches = [(before.clone(), before.clone() + 1) for _ in range(2)]
    slots = layout.slot_mapping.to(slot_dtype)
    cache.reshape_and_cache_triton(k, v, *caches[0], slots)
    cache.reshape_and_cache_reference(k, v, *caches[1], slots)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_reshape_and_cache_rejects_mismatches() -> None:
    k = torch.zeros(3, 2, 16)
    with pytest.raises(ValueError, match="rows"):
        cache.reshape_and_cache_triton(k, k, torch.zeros(32, 2, 8), torch.zeros(32, 2, 8), torch.arange(3))
    with pytest.raises(ValueError, match="slot_mapping"):
        cache.reshape_and_cache_triton(k, k, torch.zeros(32, 2, 16), torch.zeros(32, 2, 16), torch.zeros(3))
    with pytest.raises(ValueError, match="dtype"):
        cache.reshape_and_cache_triton(
            k, k, torch.zeros(32, 2, 16, dtype=torch.bfloat16), torch.zeros(32, 2, 16), torch.arange(3)
        )


# --- norms --------------------------------------------------------------------------------------------

ALL_DTYPES = [*DTYPES, pytest.param(torch.float16, id="fp16")]
NORM_SHAPES = [(5, 64), (3, 1536), (2, 3, 80)]  # the tiny model's hidden, the 2b's, one not a power of two


def _norm_inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    yield (torch.randn(shape, generator=g) * 3).to(dtype)
    yield torch.randn(shape, generator=g).to(dtype)
    yield (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, _, weight = _norm_inputs(shape, dtype, seed=12)
    assert_ulps(norm.rms_norm_triton(x, weight, 1e-6), norm.rms_norm_reference(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_fused_add_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, residual, weight = _norm_inputs(shape, dtype, seed=13)
    normed, summed = norm.fused_add_rms_norm_triton(x, residual, weight, 1e-6)
    expected_normed, expected_summed = norm.fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    assert torch.equal(summed, expected_summed)
    assert_ulps(normed, expected_normed)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [*NORM_SHAPES, (4, 1280)])  # and the vision tower's width
def test_fused_add_layer_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Against torch's add then LayerNorm: the sum exactly, the normalised rows within a few ulps (torch
    takes the variance by Welford's method, the kernel in two passes)."""
    x, residual, weight = _norm_inputs(shape, dtype, seed=15)
    bias = (0.1 * torch.randn(shape[-1], generator=torch.Generator().manual_seed(16))).to(dtype)
    x = x + 2.5  # a mean far from zero: the kernel must centre the rows
    normed, summed = norm.fused_add_layer_norm_triton(x, residual, weight, bias, 1e-6)
    expected_normed, expected_summed = norm.fused_add_layer_norm_reference(x, residual, weight, bias, 1e-6)
    assert torch.equal(summed, expected_summed)
    if dtype == torch.float32:
        torch.testing.assert_close(normed, expected_normed, rtol=0, atol=LAYER_NORM_FP32)
    else:
        assert_ulps(normed, expected_normed)


def test_fused_add_layer_norm_rejects_mismatches() -> None:
    x, w = torch.zeros(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="bias"):
        norm.fused_add_layer_norm_triton(x, x, w, torch.zeros(4), 1e-6)
    with pytest.raises(ValueError, match="dtype"):
        norm.fused_add_layer_norm_triton(x.bfloat16(), x.bfloat16(), w, torch.zeros(8), 1e-6)


def test_rms_norm_fp32_weight_on_bf16_rows_promotes_like_torch() -> None:
    x, _, weight = _norm_inputs((4, 64), torch.bfloat16, seed=14)
    out = norm.rms_norm_triton(x, weight.float(), 1e-6)
    assert_ulps(out, norm.rms_norm_reference(x, weight.float(), 1e-6))


def test_rms_norm_rejects_mismatches() -> None:
    with pytest.raises(ValueError, match="weight"):
        norm.rms_norm_triton(torch.zeros(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        norm.fused_add_rms_norm_triton(torch.zeros(2, 8), torch.zeros(2, 8).half(), torch.ones(8), 1e-6)


# --- silu_and_mul -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(5, 128), (3, 2500), (2, 2, 40)])
def test_silu_and_mul(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Widths of the tiny model, past one 1024-wide column block, and not a power of two."""
    g = torch.Generator().manual_seed(15)
    gate = (torch.randn(shape, generator=g) * 4).to(dtype)
    up = torch.randn(shape, generator=g).to(dtype)
    assert_ulps(activation.silu_and_mul_triton(gate, up), activation.silu_and_mul_reference(gate, up), ulps16=2)


def test_silu_and_mul_on_halves_of_a_merged_projection() -> None:
    gate_up = torch.randn(6, 2 * 96, generator=torch.Generator().manual_seed(16)).to(torch.bfloat16)
    gate, up = gate_up[:, :96], gate_up[:, 96:]
    assert_ulps(activation.silu_and_mul_triton(gate, up), activation.silu_and_mul_reference(gate, up), ulps16=2)


# --- the vision tower's rotary and QuickGELU --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "head_dim", "grid"), [(16, 80, [[1, 4, 6]]), (3, 12, [[2, 2, 2], [1, 4, 2]])])
def test_vision_rotary_qk(heads: int, head_dim: int, grid: list[list[int]], dtype: torch.dtype) -> None:
    """Qwen2-VL's tower shape (16 heads of 80: not powers of two per half) and an odd head count."""
    from workers.models.vision import vision_rotary_cos_sin, vision_rotary_positions

    cos, sin = vision_rotary_cos_sin(vision_rotary_positions(torch.tensor(grid), 2), head_dim, 10000.0)
    qkv = (torch.randn(cos.shape[0], 3 * heads * head_dim, generator=torch.Generator().manual_seed(21)) * 3).to(dtype)
    got = vision.vision_rotary_qk_triton(qkv, cos, sin, heads)
    for actual, expected in zip(got, vision.vision_rotary_qk_reference(qkv, cos, sin, heads), strict=True):
        assert actual.shape == expected.shape and torch.equal(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vision_rotary_qk_into_a_padded_layout(dtype: torch.dtype) -> None:
    """The cuDNN path's rotary: rows scattered into a padded [3, rows, heads, padded_dim] layout, v copied too,
    every other element (padding, the masking coordinate) left as it was."""
    from workers.models.vision import vision_rotary_cos_sin, vision_rotary_positions

    heads, head_dim, grid = 16, 80, [[1, 4, 6], [2, 2, 2]]
    cos, sin = vision_rotary_cos_sin(vision_rotary_positions(torch.tensor(grid), 2), head_dim, 10000.0)
    n = cos.shape[0]
    qkv = (torch.randn(n, 3 * heads * head_dim, generator=torch.Generator().manual_seed(22)) * 3).to(dtype)
    dest = torch.randperm(2 * n, generator=torch.Generator().manual_seed(23))[:n]
    before = torch.randn(3, 2 * n, heads, 88, generator=torch.Generator().manual_seed(24)).to(dtype)
    got, expected = before.clone(), before.clone()
    vision.vision_rotary_qk_into_triton(qkv, cos, sin, heads, got, dest)
    vision.vision_rotary_qk_into(qkv, cos, sin, heads, expected, dest)  # the reference: these are CPU tensors
    assert torch.equal(got, expected)
    assert torch.equal(expected[:, dest, :, :head_dim][2], qkv.view(n, 3, heads, head_dim)[:, 2])


def test_vision_rotary_qk_rejects_mismatched_tables() -> None:
    with pytest.raises(ValueError, match="cos must be fp32"):
        vision.vision_rotary_qk_triton(torch.zeros(4, 3 * 2 * 8), torch.zeros(4, 8).half(), torch.zeros(4, 8), 2)
    with pytest.raises(ValueError, match="qkv must be"):
        vision.vision_rotary_qk_triton(torch.zeros(4, 50), torch.zeros(4, 8), torch.zeros(4, 8), 2)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(5, 128), (3, 2500)])
def test_quick_gelu(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(22)) * 4).to(dtype)
    assert_ulps(vision.quick_gelu_triton(x), vision.quick_gelu_reference(x), ulps16=2)


# --- M-RoPE -------------------------------------------------------------------------------------------

ROPE_GEOMETRIES = [  # (heads, kv_heads, head_dim, mrope_section): tiny, 2b, 7b
    pytest.param(4, 2, 16, (2, 3, 3), id="tiny"),
    pytest.param(12, 2, 128, (16, 24, 24), id="2b"),
    pytest.param(28, 4, 128, (16, 24, 24), id="7b"),
]


def _rope_inputs(
    heads: int, kv_heads: int, head_dim: int, section: tuple[int, int, int], dtype: torch.dtype, tokens: int = 7
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(17)
    positions = torch.randint(0, 4000, (3, tokens), generator=g)  # t, h, w differ, as in an image run
    cos, sin = mrope_cos_sin(positions, rope_inv_freq(head_dim, 1_000_000.0), section, dtype)
    # q and k as views of one fused projection output: strided, as the decoder has them.
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    return qkv[:, :heads], qkv[:, heads : heads + kv_heads], cos, sin


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "section"), ROPE_GEOMETRIES)
def test_apply_mrope(
    heads: int, kv_heads: int, head_dim: int, section: tuple[int, int, int], dtype: torch.dtype
) -> None:
    q, k, cos, sin = _rope_inputs(heads, kv_heads, head_dim, section, dtype)
    q_rot, k_rot = rotary.apply_mrope_triton(q, k, cos, sin)
    expected_q, expected_k = rotary.apply_mrope_reference(q, k, cos, sin)
    assert torch.equal(q_rot, expected_q)
    assert torch.equal(k_rot, expected_k)


def test_apply_mrope_in_place() -> None:
    q, k, cos, sin = _rope_inputs(12, 2, 128, (16, 24, 24), torch.bfloat16)
    expected_q, expected_k = rotary.apply_mrope_reference(q, k, cos, sin)
    q_rot, k_rot = rotary.apply_mrope_triton(q, k, cos, sin, inplace=True)
    assert q_rot is q and k_rot is k
    assert torch.equal(q, expected_q)
    assert torch.equal(k, expected_k)


def test_apply_mrope_rejects_mismatches() -> None:
    q, k, cos, sin = _rope_inputs(4, 2, 16, (2, 3, 3), torch.float32)
    with pytest.raises(ValueError, match="cos and sin"):
        rotary.apply_mrope_triton(q, k, cos[:-1], sin[:-1])
    with pytest.raises(ValueError, match="share"):
        rotary.apply_mrope_triton(q, k, cos.double(), sin.double())


# --- Qwen3's q/k norm fused with the rotary ---------------------------------------------------------------

QK_NORM_GEOMETRIES = [  # (heads, kv_heads, head_dim, mrope_section): the tiny Qwen3-VL, 8b, a half not a power of 2
    pytest.param(4, 2, 16, (4, 2, 2), id="tiny"),
    pytest.param(32, 8, 128, (24, 20, 20), id="8b"),
    pytest.param(6, 2, 40, (8, 6, 6), id="head40"),
]


def qk_norm_rope_inputs(
    heads: int, kv_heads: int, head_dim: int, section: tuple[int, int, int], dtype: torch.dtype, tokens: int = 9
) -> tuple[torch.Tensor, ...]:
    """q, k (strided views of one qkv, as the fused layer has them, at several scales per head), their norm
    weights and Qwen3's interleaved M-RoPE tables of positions that differ per axis."""
    from workers.models.qwen3_vl_text import interleaved_mrope_axis

    g = torch.Generator().manual_seed(31)
    positions = torch.randint(0, 4000, (3, tokens), generator=g)
    axis = interleaved_mrope_axis(section)
    cos, sin = mrope_cos_sin(positions, rope_inv_freq(head_dim, 5_000_000.0), section, dtype, axis)
    scale = torch.rand(tokens, heads + 2 * kv_heads, 1, generator=g) * 20 + 0.05
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=g) * scale).to(dtype)
    q_weight = (torch.rand(head_dim, generator=g) + 0.5).to(dtype)
    k_weight = (torch.rand(head_dim, generator=g) * 2 - 0.5).to(dtype)
    return qkv[:, :heads], qkv[:, heads : heads + kv_heads], q_weight, k_weight, cos, sin


def assert_qk_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 to a few ulps of unit-scale values; bf16/fp16 to one ulp, and nearly every element exact (the
    kernel rounds where the reference does; only the mean square's summation order differs)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        return
    ulp = 2.0 ** -(7 if expected.dtype == torch.bfloat16 else 10)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=ulp, atol=ulp)
    assert (actual == expected).float().mean().item() >= 0.98


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "section"), QK_NORM_GEOMETRIES)
def test_apply_qk_norm_mrope(
    heads: int, kv_heads: int, head_dim: int, section: tuple[int, int, int], dtype: torch.dtype
) -> None:
    q, k, q_weight, k_weight, cos, sin = qk_norm_rope_inputs(heads, kv_heads, head_dim, section, dtype)
    got = rotary.apply_qk_norm_mrope_triton(q, k, q_weight, k_weight, 1e-6, cos, sin)
    expected = rotary.apply_qk_norm_mrope_reference(q, k, q_weight, k_weight, 1e-6, cos, sin)
    for actual, wanted in zip(got, expected, strict=True):
        assert_qk_close(actual, wanted)


def test_apply_qk_norm_mrope_in_place_leaves_v() -> None:
    q, k, q_weight, k_weight, cos, sin = qk_norm_rope_inputs(4, 2, 16, (4, 2, 2), torch.bfloat16)
    qkv = q._base
    assert qkv is not None
    v_before = qkv[:, 6:].clone()
    expected = rotary.apply_qk_norm_mrope_reference(q, k, q_weight, k_weight, 1e-6, cos, sin)
    q_out, k_out = rotary.apply_qk_norm_mrope_triton(q, k, q_weight, k_weight, 1e-6, cos, sin, inplace=True)
    assert q_out is q and k_out is k
    assert_qk_close(q, expected[0])
    assert_qk_close(k, expected[1])
    assert torch.equal(qkv[:, 6:], v_before)


def test_apply_qk_norm_mrope_rejects_mismatched_weights() -> None:
    q, k, q_weight, k_weight, cos, sin = qk_norm_rope_inputs(4, 2, 16, (4, 2, 2), torch.float32)
    with pytest.raises(ValueError, match="k_weight must be"):
        rotary.apply_qk_norm_mrope_triton(q, k, q_weight, k_weight[:-1], 1e-6, cos, sin)
    with pytest.raises(ValueError, match="q_weight must be"):
        rotary.apply_qk_norm_mrope_triton(q, k, q_weight.double(), k_weight, 1e-6, cos, sin)


# --- compiled for the GPU -----------------------------------------------------------------------------


def test_every_kernel_compiles_for_h200() -> None:
    """`python -m benchmarks.aot` in a process of its own: this one imported triton as an interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.aot", "--arch", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAILED" not in result.stdout


def test_interpreter_in_subprocess() -> None:
    """This module in processes of their own (one per core, up to 4: each takes every n-th test), where
    triton can still be imported under the interpreter."""
    if _IN_PROCESS:
        pytest.skip("the kernels run in this process")
    run_sharded(__file__, {"TRITON_INTERPRET": "1"}, "-k", "not test_interpreter_in_subprocess")
