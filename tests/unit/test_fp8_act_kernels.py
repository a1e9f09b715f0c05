"""The vision MLP's quick_gelu with FP8 activation quantization fused in (`workers.kernels.fp8_act`), and the MLP
taking it where fc2 is an FP8 per-channel linear that would quantize its rows itself.

The kernel's reference is the unfused FP8 path, exactly: quick_gelu's own Triton kernel (`vision_triton`, the launch
the tower makes on CUDA), whose output is rounded to bf16 or fp16, then `fp8.quantize_reference(act, K)`. Both run in
Triton's interpreter here, in a child process started with TRITON_INTERPRET=1 and VLM_FP8_INTERPRETER_CHILD=1
(`test_act_kernels_in_interpreter`), as test_fp8_norm_kernels.py does; the kernel tests skip in the parent. Equal
means the same scales and the same FP8 values (compared as values: the interpreter's cast writes -0 as +0).
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_setup import FP8_INTERPRETER_CHILD, interpreted_in_child, run_sharded
from workers.kernels import fp8_act
from workers.kernels.fp8 import FP8, quantize_reference
from workers.kernels.vision import quick_gelu_reference

CHILD = FP8_INTERPRETER_CHILD
INTERPRETED = interpreted_in_child(CHILD, "workers.kernels.fp8_act_triton")
kernel = pytest.mark.skipif(not INTERPRETED, reason="runs in test_act_kernels_in_interpreter's child process")

WIDTHS = (5120, 4304, 200, 256)  # Qwen2-VL's ViT MLP, Qwen3-VL's, one not a power of 2, one that is (no tail)
DTYPES = (torch.bfloat16, torch.float16)


def fc1_outputs(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of very different sizes, both signs, one row of zeros (its scale is the floor's), one of large negatives
    (quick_gelu of them is ~0: the amax comes from the few positives)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 10.0 ** torch.empty(rows, 1).uniform_(-2, 1.5, generator=g)
    if rows > 2:
        x[1] = 0.0
        x[2] = -torch.rand(cols, generator=g) * 30 - 5
        x[2, :3] = torch.tensor([0.5, 2.0, 7.0])
    return x.to(dtype)


def assert_same_quantization(
    got: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor]
) -> None:
    (q, s), (q_ref, s_ref) = got, expected
    assert q.dtype == FP8 and q.shape == q_ref.shape and s.shape == (q.shape[0], 1)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.float(), q_ref.float())


@kernel
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("cols", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quick_gelu_quantize_is_the_unfused_path_bit_for_bit(rows: int, cols: int, dtype: torch.dtype) -> None:
    from workers.kernels import fp8_act_triton, vision_triton

    x = fc1_outputs(rows, cols, dtype, seed=rows + cols)
    act = vision_triton.launch_quick_gelu(x)
    assert_same_quantization(fp8_act_triton.launch_quick_gelu_quantize(x), quantize_reference(act, cols))


def test_quick_gelu_quantize_on_cpu_is_the_reference() -> None:
    x = fc1_outputs(5, 200, torch.bfloat16, seed=7)
    assert_same_quantization(fp8_act.quick_gelu_quantize(x), quantize_reference(quick_gelu_reference(x), 200))


def test_quick_gelu_quantize_refuses_what_it_does_not_take() -> None:
    x = fc1_outputs(3, 64, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        fp8_act.quick_gelu_quantize(x.float())
    with pytest.raises(ValueError, match="unit column stride"):
        fp8_act.quick_gelu_quantize(x.t())
    with pytest.raises(ValueError, match="one program holds"):
        fp8_act.quick_gelu_quantize(torch.zeros(1, fp8_act.MAX_COLUMNS + 1, dtype=torch.bfloat16))


@pytest.mark.slow
def test_act_kernels_in_interpreter() -> None:
    """This module in processes of their own (`run_sharded`), where triton can still be imported under the
    interpreter."""
    if INTERPRETED:
        pytest.skip("the kernels run in this process")
    run_sharded(__file__, {CHILD: "1", "TRITON_INTERPRET": "1"}, "-k", "not in_interpreter")
