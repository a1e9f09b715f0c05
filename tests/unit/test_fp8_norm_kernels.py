"""The vision tower's norms with FP8 activation quantization fused in (`workers.kernels.fp8_norm`), and when the
towers take that path (`workers.models.fp8_rows.takes_quantized_rows`).

The kernel's reference is the unfused FP8 path, exactly: `workers.kernels.norm`'s Triton kernel (the same launch the
tower makes on CUDA: `fused_add_layer_norm_triton`, `fused_add_rms_norm_triton`, `rms_norm_triton`), whose rows are
rounded to bf16 or fp16, then `fp8.quantize_reference(normed, K)` (the quantize kernel's arithmetic, itself checked bit
for bit in tests/unit/test_fp8_kernels.py). Both run in Triton's interpreter here, in a child process started with
TRITON_INTERPRET=1 and VLM_FP8_INTERPRETER_CHILD=1 (`test_norm_kernels_in_interpreter`), as test_fp8_kernels.py does;
the kernel tests skip in the parent. Equal means: the same scales, the same FP8 values (compared as values, since the
interpreter's cast writes -0 as +0) and the same residual sums.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_setup import FP8_INTERPRETER_CHILD, interpreted_in_child, run_sharded
from workers.kernels import fp8, fp8_norm
from workers.kernels.fp8 import FP8, quantize_reference
from workers.models.fp8 import Fp8Weight, quantize_per_channel
from workers.models.fp8_rows import QuantizedRows, linear_on, quantized_norms, takes_quantized_rows

CHILD = FP8_INTERPRETER_CHILD
INTERPRETED = interpreted_in_child(CHILD, "workers.kernels.fp8_norm_triton")
kernel = pytest.mark.skipif(not INTERPRETED, reason="runs in test_norm_kernels_in_interpreter's child process")

HIDDEN = (1280, 1152, 200)  # Qwen2-VL's and Qwen2.5-VL's ViT width, Qwen3-VL-8B's, and one not a power of 2
DTYPES = (torch.bfloat16, torch.float16)


def norm_inputs(
    rows: int, hidden: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(update, stream, weight, bias): rows of very different sizes and a mean far from zero (the LayerNorm must
    centre them), one row whose sum is zero (its normalised row is the bias alone), weights of both signs."""
    g = torch.Generator().manual_seed(seed)
    stream = torch.randn(rows, hidden, generator=g) * 10.0 ** torch.empty(rows, 1).uniform_(-2, 2, generator=g) + 2.5
    update = torch.randn(rows, hidden, generator=g)
    if rows > 2:
        update[1] = -stream[1].to(dtype).float()
    weight = torch.randn(hidden, generator=g) * 2
    bias = torch.randn(hidden, generator=g) * 0.1
    return update.to(dtype), stream.to(dtype), weight.to(dtype), bias.to(dtype)


def assert_same_quantization(got: tuple, expected: tuple) -> None:
    (q, s, summed), (q_ref, s_ref, summed_ref) = got, expected
    assert q.dtype == FP8 and q.shape == q_ref.shape and s.shape == (q.shape[0], 1)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.float(), q_ref.float())
    assert (summed is None) == (summed_ref is None)
    if summed is not None:
        assert torch.equal(summed, summed_ref)


# --- the kernel, bit for bit ------------------------------------------------------------------------------------


@kernel
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_layer_norm_quantize_is_the_unfused_path_bit_for_bit(rows: int, hidden: int, dtype: torch.dtype) -> None:
    from workers.kernels import norm

    update, stream, weight, bias = norm_inputs(rows, hidden, dtype, seed=rows + hidden)
    normed, summed = norm.fused_add_layer_norm_triton(update, stream, weight, bias, 1e-6)
    expected = (*quantize_reference(normed, hidden), summed)
    assert_same_quantization(fp8_norm.norm_quantize_triton(update, stream, weight, 1e-6, bias), expected)


@kernel
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [True, False], ids=["add", "alone"])
def test_rms_norm_quantize_is_the_unfused_path_bit_for_bit(
    rows: int, hidden: int, dtype: torch.dtype, residual: bool
) -> None:
    from workers.kernels import norm

    update, stream, weight, _ = norm_inputs(rows, hidden, dtype, seed=2 * rows + hidden)
    if residual:
        normed, summed = norm.fused_add_rms_norm_triton(update, stream, weight, 1e-6)
        got = fp8_norm.norm_quantize_triton(update, stream, weight, 1e-6)
    else:
        normed, summed = norm.rms_norm_triton(stream, weight, 1e-6), None
        got = fp8_norm.norm_quantize_triton(stream, None, weight, 1e-6)
    assert_same_quantization(got, (*quantize_reference(normed, hidden), summed))


@kernel
def test_a_row_of_zeros_quantizes_to_zeros_with_the_floor_scale() -> None:
    """RMSNorm of a zero row is zero: scale 1e-10 / 448 and q all 0 (no NaN), as the quantize kernel's."""
    weight = torch.ones(256, dtype=torch.bfloat16)
    zeros = torch.zeros(2, 256, dtype=torch.bfloat16)
    q, s, _ = fp8_norm.norm_quantize_triton(zeros, None, weight, 1e-6)
    assert torch.equal(q.float(), torch.zeros(2, 256)) and torch.equal(s, quantize_reference(zeros, 256)[1])


# --- off the interpreter: the entry's checks and the CPU's path -------------------------------------------------


def test_norm_quantize_on_cpu_is_the_reference() -> None:
    update, stream, weight, bias = norm_inputs(5, 200, torch.bfloat16, seed=7)
    got = fp8_norm.norm_quantize(update, stream, weight, 1e-6, bias)
    normed = torch.nn.functional.layer_norm(update + stream, (200,), weight, bias, 1e-6)
    assert_same_quantization(got, (*quantize_reference(normed, 200), update + stream))


def test_norm_quantize_refuses_what_it_does_not_fuse() -> None:
    update, stream, weight, bias = norm_inputs(3, 64, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="after a residual add only"):
        fp8_norm.norm_quantize(stream, None, weight, 1e-6, bias)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        fp8_norm.norm_quantize(stream.float(), None, weight.float(), 1e-6)
    with pytest.raises(ValueError, match="weight must be \\[64\\] in x's dtype"):
        fp8_norm.norm_quantize(stream, None, weight.float(), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fp8_norm.norm_quantize(update, stream[:2], weight, 1e-6)


def test_the_gemm_on_prequantized_rows_is_the_scaled_mm_paths_arithmetic() -> None:
    """On CPU `fp8_matmul_quantized` is both operands dequantized exactly, the product in fp32 and the bias added
    before one rounding; it refuses a weight that is not per channel, and scales that are not per token."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(70, 256, generator=g).bfloat16()
    w, w_scale = quantize_per_channel(torch.randn(48, 256, generator=g))
    bias = torch.randn(48, generator=g).bfloat16()
    x_q, x_s = quantize_reference(x, 256)
    got = fp8.fp8_matmul_quantized(x_q, x_s, w, w_scale, (1, 256), bias, torch.bfloat16)
    x_deq = fp8.dequantize_reference(x_q, x_s, (1, 256))
    expected = (x_deq @ fp8.dequantize_reference(w, w_scale, (1, 256)).T + bias.float()).bfloat16()
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    with pytest.raises(ValueError, match="per-channel weight"):
        fp8.fp8_matmul_quantized(x_q, x_s, w, torch.ones(1, 2), (128, 128), None, torch.bfloat16)
    with pytest.raises(ValueError, match="scales \\[M, 1\\]"):
        fp8.fp8_matmul_quantized(x_q, quantize_reference(x, 128)[1], w, w_scale, (1, 256), None, torch.bfloat16)


# --- when the towers take the fused path ----------------------------------------------------------------------


def fp8_weight(n: int, k: int, block: tuple[int, int] | None = None) -> Fp8Weight:
    block = block or (1, k)
    grid = (-(-n // block[0]), -(-k // block[1]))
    return Fp8Weight(torch.zeros(n, k, dtype=FP8), torch.ones(grid), block)


H200 = (9, 0)


def test_the_norm_quantizes_where_the_linear_would_quantize_per_token() -> None:
    """Per-channel FP8 weights past the decode rows: the ViT's qkv and fc1 (``scaled_mm``), and Qwen2.5-VL-7B's
    gate|up, 2 x 3420 columns, not a multiple of 16 (the Triton GEMM on per-token scales, ``block``)."""
    for n, k in ((3840, 1280), (5120, 1280), (2 * 3420, 1280)):
        assert takes_quantized_rows(fp8_weight(n, k), 4096, H200)
        assert takes_quantized_rows(fp8_weight(n, k), fp8.DECODE_ROWS + 1, (8, 9))
    assert fp8.choose_path(4096, 2 * 3420, 1280, (1, 1280), H200) == "block"


def test_the_norm_writes_its_rows_as_before_everywhere_else() -> None:
    per_channel = fp8_weight(3840, 1280)
    assert not takes_quantized_rows(None, 4096, H200)  # a bf16 linear
    assert not takes_quantized_rows(per_channel, 4096, None)  # off CUDA: the CPU's path stays the reference's
    assert not takes_quantized_rows(per_channel, fp8.DECODE_ROWS, H200)  # the GEMV takes bf16 rows
    assert not takes_quantized_rows(fp8_weight(3840, 1280, (128, 128)), 4096, H200)  # block-scaled weights
    assert not takes_quantized_rows(fp8_weight(3840, 1280, (1, 128)), 4096, H200)  # per row in K blocks
    assert not takes_quantized_rows(fp8_weight(3840, 1288, (1, 128)), 4096, H200)  # K not in whole 128 blocks
    with quantized_norms(False):
        assert not takes_quantized_rows(per_channel, 4096, H200)
    assert takes_quantized_rows(per_channel, 4096, H200)


def test_quantized_rows_reach_only_an_fp8_linear() -> None:
    g = torch.Generator().manual_seed(2)
    layer = torch.nn.Linear(64, 32)
    rows = QuantizedRows(*quantize_reference(torch.randn(4, 64, generator=g).bfloat16(), 64), torch.bfloat16)
    with pytest.raises(ValueError, match="rows quantized to FP8 reach a Linear"):
        linear_on(layer, rows)
    x = torch.randn(4, 64, generator=g)
    assert torch.equal(linear_on(layer, x), layer(x))


def test_the_cpu_norms_write_their_rows_as_before_for_an_fp8_linear() -> None:
    """On CPU a norm that feeds an FP8 per-channel linear writes its rows in the model dtype, as the reference's: the
    towers' CPU path (which tests compare with transformers) is unchanged."""
    from workers.kernels.norm import fused_add_layer_norm, fused_add_rms_norm
    from workers.models.fp8_rows import add_and_rms_norm
    from workers.models.language import RMSNorm
    from workers.models.vision import add_and_norm
    from workers.models.vision_fp8 import quantized

    update, stream, _, _ = norm_inputs(80, 64, torch.bfloat16, seed=3)
    layer_norm = torch.nn.LayerNorm(64, eps=1e-6).bfloat16()
    rms = RMSNorm(64, 1e-6).bfloat16()
    consumer = quantized(torch.nn.Linear(64, 64))
    summed, normed = add_and_norm(update, stream, layer_norm, consumer)
    expected, expected_sum = fused_add_layer_norm(update, stream, layer_norm.weight, layer_norm.bias, 1e-6)
    assert isinstance(normed, torch.Tensor) and torch.equal(normed, expected) and torch.equal(summed, expected_sum)
    summed, normed = add_and_rms_norm(update, stream, rms, consumer.fp8_weight())
    expected, expected_sum = fused_add_rms_norm(update, stream, rms.weight, 1e-6)
    assert isinstance(normed, torch.Tensor) and torch.equal(normed, expected) and torch.equal(summed, expected_sum)


# --- the interpreter run ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_norm_kernels_in_interpreter() -> None:
    """This module in processes of their own (`run_sharded`), where triton can still be imported under the
    interpreter."""
    if INTERPRETED:
        pytest.skip("the kernels run in this process")
    run_sharded(__file__, {CHILD: "1", "TRITON_INTERPRET": "1"}, "-k", "not in_interpreter")
