"""The FP8 GEMM kernels of `workers.kernels.fp8` in Triton's interpreter on CPU, against the dequantizing reference
(`fp8_matmul_reference`: the weight dequantized exactly to the format's definition, as `workers.models.fp8`'s
`fp8_linear` does on CPU, the product in fp32).

Triton picks the interpreter when it is imported; in a test run triton is usually imported compiled first (torch's
dynamo imports it), so `test_kernels_in_interpreter` runs this module again in a fresh process with
TRITON_INTERPRET=1, and the kernel tests skip in the parent.

Tolerances, from the formats' precision:
- quantization: equal (amax, one fp32 division, round to nearest even on the e4m3 grid, as torch); zeros compared
  as values, since the interpreter's cast to FP8 drops the sign of -0 (no product sees it).
- GEMV (bf16 activations as they are, exact FP8 weights): the reference is exact up to fp32 summation, so the only
  differences are the order of fp32 sums and the one rounding to bf16: ``|y - ref| <= 2**-8 |ref| + 2**-16 S`` with
  ``S = |x| @ |w|.T`` (half a bf16 ulp is at most 2**-8 relative; fp32 reordering over K <= 4096 terms stays far
  below 2**-16 of the absolute sum).
- scaled GEMM on the same quantized activations: the same bound. Against the bf16 activations: each activation
  moves by at most half an e4m3 ulp, ``max(2**-4 |x|, 2**-10 scale)`` (3 mantissa bits; subnormals are multiples of
  2**-9 scale), so ``|y - x @ w.T| <= E @ |w|.T + 2**-8 |ref|`` with ``E`` those bounds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.triton_setup import FP8_INTERPRETER_CHILD, interpreted_in_child, run_sharded
from workers.kernels import fp8
from workers.kernels.fp8 import FP8, choose_path, dequantize_reference, fp8_matmul_reference, quantize_reference

CHILD = FP8_INTERPRETER_CHILD
INTERPRETED = interpreted_in_child(CHILD, "workers.kernels.fp8_triton")
kernel = pytest.mark.skipif(not INTERPRETED, reason="runs in test_kernels_in_interpreter's child process")

ROWS = (1, 3, 17)
SHAPES = [(128, 256), (256, 384), (200, 300)]  # (N, K); the last ragged in both
LAYOUTS = {"block128": (128, 128), "channel": None, "row128": (1, 128)}  # None: (1, K)


def activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """bf16 activations over six decades (so e4m3 subnormals and carries past a mantissa's last value occur), one row
    of zeros where there are several rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 10.0 ** torch.empty(rows, k).uniform_(-3, 3, generator=g)
    if rows > 2:
        x[1] = 0
    return x.to(torch.bfloat16)


def fp8_weight(n: int, k: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(FP8)
    grid = (-(-n // block[0]), -(-k // block[1]))
    scale = torch.empty(grid).uniform_(1e-3, 3e-3, generator=g)  # scales differ by up to 3x: a wrong index shows
    return w, scale


def within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> None:
    excess = (actual.float() - expected.float()).abs() - bound
    assert excess.max().item() <= 0, f"worst excess {excess.max().item():.3g} over the bound"


def order_bound(x: torch.Tensor, w_deq: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return 2**-8 * ref.float().abs() + 2**-16 * (x.float().abs() @ w_deq.abs().T)


# --- quantization ---------------------------------------------------------------------------------------------------


@kernel
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("k", [128, 300, 4100])
@pytest.mark.parametrize("per_token", [True, False], ids=["token", "group128"])
def test_quantize_matches_the_reference_bit_for_bit(rows: int, k: int, per_token: bool) -> None:
    x = activations(rows, k, seed=rows * k)
    group = k if per_token else 128
    q, s = fp8.quantize_triton(x, group)
    q_ref, s_ref = quantize_reference(x, group)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.float(), q_ref.float())  # as values: the interpreter's cast writes -0 as +0


@kernel
@pytest.mark.parametrize("rows", [1, 17, 37])
@pytest.mark.parametrize("k", [256, 300, 4100])
def test_quantize_writes_column_major_scales_where_cublaslt_reads_them(rows: int, k: int) -> None:
    """``scale_layout="column-major"``: scales [M, ceil(K / 128)] with strides (1, M) (cuBLASLt's 1 x 128 layout),
    each in its place in memory (read back through the raw storage, not the strided view)."""
    x = activations(rows, k, seed=rows + k)
    q, s = fp8.quantize_triton(x, 128, "column-major")
    q_ref, s_ref = quantize_reference(x, 128)
    assert s.shape == s_ref.shape and s.stride() == (1, rows)
    stored = torch.as_strided(s, (s.numel(),), (1,))
    assert torch.equal(stored, s_ref.t().reshape(-1))
    assert torch.equal(q.float(), q_ref.float())


def test_quantize_refuses_an_unknown_scale_layout() -> None:
    pytest.importorskip("triton")
    from workers.kernels import fp8_triton

    with pytest.raises(ValueError, match="scale_layout must be one of"):
        fp8_triton.plan_quantize(torch.empty(4, 256, device="meta"), 128, scale_layout="transposed")


# --- GEMMs ----------------------------------------------------------------------------------------------------------


@kernel
@pytest.mark.parametrize("rows", [1, 3, 16, 40, 64])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gemv_matches_the_dequantizing_reference(rows: int, n: int, k: int, layout: str) -> None:
    block = LAYOUTS[layout] or (1, k)
    x = activations(rows, k, seed=rows + n)
    w, scale = fp8_weight(n, k, block, seed=k)
    bias = torch.randn(n).to(torch.bfloat16)
    out = fp8.gemv_triton(x, w, scale, block, bias)
    ref = fp8_matmul_reference(x.float(), w, scale, block, bias)  # fp32: only the kernel rounds to bf16
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    within(out, ref, order_bound(x, dequantize_reference(w, scale, block), ref))


# (variant, block_k, num_warps, num_stages, x_direct): each GEMV kernel, the sum kernel's K tile one and several scale
# sub-tiles, its x rows loaded either way
GEMV_KERNELS = {
    "dot": ("dot", 128, 4, 4, False),
    "sum128": ("sum", 128, 4, 1, False),
    "sum256": ("sum", 256, 4, 3, False),
    "sum256_direct": ("sum", 256, 4, 1, True),
    "sum512": ("sum", 512, 8, 3, False),
    "sum512_direct": ("sum", 512, 8, 1, True),
}


SWEEP_PARTS = 4


def gemv_with(
    config: object,
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, object]:
    """(out, launch) of the GEMV launched with ``config``, the scale block as `fp8.gemv_triton` passes it, after
    checking that every arrival counter is back at zero."""
    from workers.kernels import fp8_gemv_triton

    k = x.shape[1]
    out, launch = fp8_gemv_triton.plan_weight_gemv(
        x, w, scale, (block[0], min(block[1], k)), bias, interpreted_mode=True, config=config
    )
    launch()
    assert not fp8_gemv_triton.arrival_counters(x.device).any(), "an arrival counter left set"
    return out, launch


# (the ragged shape alone: its column and K tiles are both whole and cut short, so it runs every load and mask the two
# others do; those two go through the dispatched GEMV above)
@kernel
@pytest.mark.parametrize(
    ("kernel_name", "rows"),
    [(name, rows) for name in GEMV_KERNELS for rows in (1, 3, 8, 16) if name == "dot" or rows <= 8],  # SUM_MAX_ROWS
)
@pytest.mark.parametrize(("n", "k"), [SHAPES[-1]])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_gemv_kernel_matches_the_dequantizing_reference(
    kernel_name: str, rows: int, n: int, k: int, layout: str
) -> None:
    from workers.kernels import fp8_gemv_triton

    variant, block_k, warps, stages, x_direct = GEMV_KERNELS[kernel_name]
    block = LAYOUTS[layout] or (1, k)
    x = activations(rows, k, seed=rows + n + k)
    w, scale = fp8_weight(n, k, block, seed=n + k)
    bias = torch.randn(n).to(torch.bfloat16) if rows != 3 else None
    config = fp8_gemv_triton.gemv_config(
        rows, n, k, 132, variant=variant, block_n=32, block_k=block_k, num_warps=warps, num_stages=stages,
        x_direct=x_direct,
    )  # fmt: skip
    out, _ = gemv_with(config, x, w, scale, block, bias)
    ref = fp8_matmul_reference(x.float(), w, scale, block, bias)  # fp32: only the kernel rounds to bf16
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    within(out, ref, order_bound(x, dequantize_reference(w, scale, block), ref))


@kernel
@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("kernel_name", GEMV_KERNELS)
def test_gemv_slices_of_k_add_up_to_the_whole_and_leave_the_counters_clear(kernel_name: str, split_k: int) -> None:
    """The split-K GEMV: each slice's partial, the last arrival's sum, and every arrival counter back at zero (the
    next launch, or a CUDA graph's next replay, counts from zero). K spans several K tiles of the widest kernel."""
    from workers.kernels import fp8_gemv_triton

    variant, block_k, warps, stages, x_direct = GEMV_KERNELS[kernel_name]
    n, k, block = 200, 7 * 128 + 44, (128, 128)
    x = activations(5, k, seed=11)
    w, scale = fp8_weight(n, k, block, seed=12)
    bias = torch.randn(n).to(torch.bfloat16)
    tiles_k = -(-k // block_k)
    per_split = -(-tiles_k // split_k) * block_k
    config = fp8_gemv_triton.GemvConfig(64, split_k, per_split, variant, block_k, warps, stages, True, x_direct)
    out, launch = gemv_with(config, x, w, scale, block, bias)
    ref = fp8_matmul_reference(x.float(), w, scale, block, bias)
    within(out, ref, order_bound(x, dequantize_reference(w, scale, block), ref))
    assert launch.grid == (4, split_k)


@kernel
@pytest.mark.parametrize("part", range(SWEEP_PARTS))
def test_every_swept_gemv_kernel_matches_the_reference(part: int) -> None:
    """Each kernel `benchmarks.fp8_gemm --sweep-gemv` times (so a sweep's winner is a correct kernel), at the rows it
    is swept at, split K and not, on a small ragged shape with 1 x 128 scales.

    The interpreter runs one program after another and ignores what only a GPU sees (num_warps, the loop's
    num_stages, eviction hints): kernels that differ only there compute alike here and run once; the compiled kernels
    are test_every_fp8_kernel_compiles_for_h200's and tests/gpu's. Each test takes every SWEEP_PARTS-th kernel (the
    processes of `test_kernels_in_interpreter` share them out)."""
    from benchmarks.fp8_gemm import SWEEP_KERNELS, SWEEP_M
    from workers.kernels import fp8_gemv_triton

    n, k, block = 200, 5 * 128 + 20, (1, 128)
    w, scale = fp8_weight(n, k, block, seed=21)
    w_deq = dequantize_reference(w, scale, block)
    interpreted = {(kernel[:3], kernel[-1]): kernel for kernel in reversed(SWEEP_KERNELS)}  # (the first of alike ones)
    for variant, block_n, block_k, warps, stages, evict, x_direct in list(interpreted.values())[part::SWEEP_PARTS]:
        for rows in SWEEP_M:
            if variant == "sum" and rows > fp8_gemv_triton.SUM_MAX_ROWS:
                continue
            x = activations(rows, k, seed=rows)
            ref = fp8_matmul_reference(x.float(), w, scale, block, None)
            for sms in (1, 132):  # 1: a program per column tile, K whole; 132: 13 column tiles at most, so K split
                config = fp8_gemv_triton.gemv_config(
                    rows, n, k, sms, 1, variant=variant, block_n=block_n, block_k=block_k, num_warps=warps,
                    num_stages=stages, evict_first=evict, x_direct=x_direct,
                )  # fmt: skip
                assert (config.split_k > 1) == (sms > 1), config.name
                try:
                    within(gemv_with(config, x, w, scale, block, None)[0], ref, order_bound(x, w_deq, ref))
                except AssertionError as error:
                    raise AssertionError(f"{config.name}, {rows} rows: {error}") from error


@kernel
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scaled_gemm_matches_the_reference_on_its_quantized_activations(rows: int, n: int, k: int, layout: str) -> None:

    block = LAYOUTS[layout] or (1, k)
    group = k if layout == "channel" else 128
    x = activations(rows, k, seed=rows * n)
    w, scale = fp8_weight(n, k, block, seed=n)
    bias = torch.randn(n).to(torch.bfloat16) if rows != 3 else None
    out = fp8.block_triton(x, w, scale, block, bias)

    x_q, x_s = quantize_reference(x, group)
    x_deq = dequantize_reference(x_q, x_s, (1, group))
    w_deq = dequantize_reference(w, scale, block)
    ref = fp8_matmul_reference(x_deq, w, scale, block, bias)
    within(out, ref, order_bound(x_deq, w_deq, ref))

    # Against the bf16 activations themselves: the quantization's own error, bounded element by element.
    exact = fp8_matmul_reference(x.float(), w, scale, block, bias)
    step = torch.maximum(2**-4 * x.float().abs(), 2**-10 * x_s.repeat_interleave(group, 1)[:, :k])
    within(out, exact, step @ w_deq.abs().T + 2**-8 * exact.abs())


@kernel
@pytest.mark.parametrize("config", [(128, 128, 32, 8, 2), (64, 256, 8, 8, 4)], ids=lambda c: "x".join(map(str, c)))
def test_scaled_gemm_under_another_tiling(config: tuple[int, int, int, int, int]) -> None:
    """A `ScaledMmConfig` override (as `benchmarks.fp8_gemm --sweep-block` passes): the same products, ragged in
    every dimension, with GROUP_M larger than the row tiles."""
    from workers.kernels import fp8_triton

    n, k, rows = 300, 384, 70
    x = activations(rows, k, seed=21)
    w, scale = fp8_weight(n, k, (128, 128), seed=22)
    bias = torch.randn(n).to(torch.bfloat16)
    x_q, x_s = quantize_reference(x, 128)
    cfg = fp8_triton.ScaledMmConfig(*config)
    out, launch = fp8_triton.plan_scaled_mm(x_q, x_s, 128, w, scale, (128, 128), bias, x.dtype, True, cfg)
    launch()
    assert launch.num_warps == cfg.warps and launch.num_stages == cfg.stages
    assert launch.grid == (-(-rows // cfg.block_m) * -(-n // cfg.block_n),)
    x_deq = dequantize_reference(x_q, x_s, (1, 128))
    ref = fp8_matmul_reference(x_deq, w, scale, (128, 128), bias)
    within(out, ref, order_bound(x_deq, dequantize_reference(w, scale, (128, 128)), ref))


def test_the_triton_scaled_gemm_refuses_column_major_activation_scales() -> None:
    pytest.importorskip("triton")
    from workers.kernels import fp8_triton

    meta = torch.device("meta")
    x_q = torch.empty(64, 256, dtype=FP8, device=meta)
    x_s = torch.empty(2, 64, device=meta).t()
    w, scale = torch.empty(128, 256, dtype=FP8, device=meta), torch.empty(1, 2, device=meta)
    with pytest.raises(ValueError, match="row-major activation scales"):
        fp8_triton.plan_scaled_mm(x_q, x_s, 128, w, scale, (128, 128), None, torch.bfloat16)


@kernel
def test_a_scaled_gemm_tile_taller_than_the_rows_and_a_bias() -> None:
    """Rows past M wrap onto real rows in the loads; they must not be stored (M = 17 in a 64-row tile is above)."""
    x = activations(65, 256, seed=5)
    w, scale = fp8_weight(130, 256, (128, 128), seed=6)
    out = fp8.block_triton(x, w, scale, (128, 128), None)
    assert out.shape == (65, 130)
    x_q, x_s = quantize_reference(x, 128)
    ref = fp8_matmul_reference(dequantize_reference(x_q, x_s, (1, 128)), w, scale, (128, 128), None)
    within(out, ref, order_bound(x, dequantize_reference(w, scale, (128, 128)), ref))


# --- dispatch (no kernel) -------------------------------------------------------------------------------------------


def test_dispatch_chooses_by_rows_and_scale_layout() -> None:
    hopper, ampere = (9, 0), (8, 0)
    assert choose_path(1, 37888, 3584, (128, 128), hopper) == "gemv"
    assert choose_path(16, 3584, 18944, (1, 18944), hopper) == "gemv"
    rows = fp8.DECODE_ROWS
    assert choose_path(rows, 3584, 18944, (1, 18944), hopper) == "gemv"  # a decode batch: the weight's bytes dominate
    assert choose_path(rows + 1, 3584, 18944, (1, 18944), hopper) == "scaled_mm"
    assert choose_path(2048, 3584, 18944, (1, 18944), ampere) == "block"  # no FP8 tensor cores for cuBLASLt
    assert choose_path(2048, 3590, 3584, (1, 3584), hopper) == "block"  # _scaled_mm wants multiples of 16
    assert choose_path(2048, 4608, 3584, (128, 128), hopper) == "block"
    assert choose_path(2048, 4608, 3584, (1, 128), hopper) == "block"
    assert choose_path(2048, 4608, 3584, (64, 64), hopper) == "dequantize"


def test_dispatch_takes_cublaslt_block_scaling_only_where_the_probe_passed() -> None:
    hopper, ada = (9, 0), (8, 9)
    assert choose_path(2048, 4608, 3584, (128, 128), hopper, blockwise=True) == "scaled_mm_blockwise"
    rows = fp8.DECODE_ROWS
    assert choose_path(rows + 1, 4608, 3584, (128, 128), hopper, blockwise=True) == "scaled_mm_blockwise"
    assert choose_path(rows, 4608, 3584, (128, 128), hopper, blockwise=True) == "gemv"  # decode streams the weight
    assert choose_path(2048, 4608, 3584, (128, 128), hopper, blockwise=False) == "block"
    assert choose_path(2048, 4608, 3584, (128, 128), ada, blockwise=True) == "block"  # cuBLASLt's recipe is sm_90+
    assert choose_path(2048, 4608, 3584, (1, 128), hopper, blockwise=True) == "block"  # a fused projection's rows
    assert choose_path(2048, 4600, 3584, (128, 128), hopper, blockwise=True) == "block"  # N not a multiple of 16
    assert choose_path(2048, 3584, 18944, (1, 18944), hopper, blockwise=True) == "scaled_mm"  # per channel


def test_weight_scales_padded_to_a_row_stride_of_four() -> None:
    scale = torch.arange(30.0).view(3, 10)
    padded = fp8.padded_rows(scale)
    assert torch.equal(padded, scale) and padded.stride() == (12, 1)
    whole = torch.arange(24.0).view(3, 8)
    assert fp8.padded_rows(whole) is whole  # already a multiple of 4: no copy


def test_weight_scales_padded_to_whole_fours_of_k_blocks_in_shape() -> None:
    scale = torch.arange(1.0, 31.0).view(3, 10)
    padded = fp8.padded_columns(scale)
    assert padded.shape == (3, 12) and torch.equal(padded[:, :10], scale) and not padded[:, 10:].any()
    whole = torch.arange(24.0).view(3, 8)
    assert fp8.padded_columns(whole) is whole
    calls = {call.padding: call for call in fp8.BLOCKWISE_CALLS if call.api == "_scaled_mm"}
    assert fp8.blockwise_weight_scales(scale, calls["none"]) is scale
    assert fp8.blockwise_weight_scales(scale, calls["stride"]).stride() == (12, 1)
    assert fp8.blockwise_weight_scales(scale, calls["shape"]).shape == (3, 12)


def test_the_blockwise_path_waits_for_its_probe_and_falls_back_without_one() -> None:
    """Without a probe answer for the tensors' device (none on CPU) the path is the Triton block GEMM's: the
    interpreter's, or compiled, a clear refusal of CPU tensors; never torch's block-scaled call."""
    x = activations(20, 256, seed=3)
    w, scale = fp8_weight(128, 256, (128, 128), seed=4)
    pytest.importorskip("triton")
    from workers.kernels._launch import interpreted

    # (this module's child process, or any process where another test module imported triton under the
    # interpreter first: tests/unit/test_kernels.py does at collection)
    if interpreted():
        expected = fp8.block_triton(x, w, scale, (128, 128), None)
        assert torch.equal(fp8.scaled_mm_blockwise(x, w, scale, (128, 128), None), expected)
    else:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            fp8.scaled_mm_blockwise(x, w, scale, (128, 128), None)


def test_gemv_splits_k_only_where_the_column_tiles_leave_sms_idle() -> None:
    pytest.importorskip("triton")
    from workers.kernels.fp8_gemv_triton import gemv_config

    tile = {"programs_per_sm": 4, "variant": "dot", "block_n": 64, "block_k": 128}
    down = gemv_config(1, 3584, 18944, sm_count=132, **tile)  # 56 column tiles: K cut until ~4 programs an SM
    assert down.block_n == 64 and down.split_k > 1 and down.k_per_split % down.block_k == 0
    assert 56 * down.split_k >= 4 * 132 and down.k_per_split * down.split_k >= 18944
    assert down.k_per_split * (down.split_k - 1) < 18944  # no empty slice
    gate_up = gemv_config(1, 37888, 3584, sm_count=132, **tile)  # 592 column tiles fill the SMs already
    assert gate_up.split_k == 1 and gate_up.k_per_split >= 3584
    small_k = gemv_config(1, 3584, 128, sm_count=132, **tile)  # one K tile: nothing to split
    assert small_k.split_k == 1
    wide = gemv_config(1, 3584, 18944, sm_count=132, variant="sum", block_k=512)  # slices of whole 512-column tiles
    assert (
        wide.k_per_split % 512 == 0 and wide.k_per_split * (wide.split_k - 1) < 18944 <= wide.k_per_split * wide.split_k
    )


def test_the_default_gemv_configs_run_on_every_decode_batch() -> None:
    pytest.importorskip("triton")
    from workers.kernels.fp8_gemv_triton import check_config, gemv_config

    for m in range(1, fp8.DECODE_ROWS + 1):
        for n, k in ((4608, 3584), (3584, 18944), (96, 64)):
            check_config(gemv_config(m, n, k, sm_count=132), m)


def test_gemv_refuses_a_config_no_kernel_runs() -> None:
    pytest.importorskip("triton")
    from workers.kernels.fp8_gemv_triton import SUM_MAX_ROWS, check_config, gemv_config

    with pytest.raises(ValueError, match="sum kernel takes up to 8 rows, got 9"):
        check_config(gemv_config(SUM_MAX_ROWS + 1, 256, 256, 132, variant="sum"), SUM_MAX_ROWS + 1)
    with pytest.raises(ValueError, match="block_k must be 128 \\(dot\\) or 128 times a power of 2"):
        check_config(gemv_config(1, 256, 768, 132, variant="sum", block_k=384), 1)
    with pytest.raises(ValueError, match="block_k must be 128"):
        check_config(gemv_config(1, 256, 768, 132, variant="dot", block_k=256), 1)
    with pytest.raises(ValueError, match="x_direct is for the sum kernel at num_stages 1"):
        check_config(gemv_config(1, 256, 768, 132, variant="sum", num_stages=3, x_direct=True), 1)
    with pytest.raises(ValueError, match="variant must be one of"):
        check_config(gemv_config(1, 256, 768, 132, variant="mma"), 1)
    check_config(gemv_config(64, 256, 768, 132), 64)  # the dot kernel: up to 64 rows
    with pytest.raises(ValueError, match="takes up to 64 rows, got 65"):
        check_config(gemv_config(65, 256, 768, 132), 65)


def test_fp8_matmul_on_cpu_is_the_dequantizing_reference() -> None:
    x = activations(3, 300, seed=1)
    w, scale = fp8_weight(200, 300, (128, 128), seed=2)
    ref = (x.float() @ dequantize_reference(w, scale, (128, 128)).T).to(torch.bfloat16)
    assert torch.equal(fp8.fp8_matmul(x.view(1, 3, 300), w, scale, (128, 128)), ref.view(1, 3, 200))


def test_fp8_matmul_refuses_a_scale_grid_that_does_not_fit() -> None:
    w, scale = fp8_weight(200, 300, (128, 128), seed=2)
    with pytest.raises(ValueError, match="w_scale must be contiguous fp32 \\[2, 3\\]"):
        fp8.fp8_matmul(activations(1, 300, seed=1), w, scale[:, :2], (128, 128))


# --- the interpreter run ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_kernels_in_interpreter() -> None:
    """This module in processes of their own (`run_sharded`), where triton can still be imported under the
    interpreter."""
    if INTERPRETED:
        pytest.skip("the kernels run in this process")
    run_sharded(__file__, {CHILD: "1", "TRITON_INTERPRET": "1"}, "-k", "not in_interpreter and not compiles")


@pytest.mark.slow
def test_every_fp8_kernel_compiles_for_h200() -> None:
    """`python -m benchmarks.fp8_gemm --aot 90` in a process of its own (no GPU needed): what only the compiler and
    ptxas reject, which the interpreter never sees, and no kernel spills registers at the benchmark's shapes."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", CHILD)}
    shards = max(1, min(4, len(os.sched_getaffinity(0))))  # (a process per core: compiling is CPU-bound)
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.fp8_gemm", "--aot", "90", "--shard", f"{k}/{shards}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        for k in range(shards)
    ]
    outputs = [run.communicate(timeout=600) for run in runs]
    compiled = []
    for run, (stdout, stderr) in zip(runs, outputs, strict=True):
        assert run.returncode == 0, stdout[-3000:] + stderr[-3000:]
        assert "FAILED" not in stdout
        compiled += stdout.splitlines()
    assert compiled  # (the shards' lines: every launch once, the K-th of every N in shard K)
    spilled = [line for line in compiled if " 0 B spilled" not in line]
    assert not spilled, spilled
