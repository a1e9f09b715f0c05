"""@triton.jit helpers shared by the kernels (imports triton)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import triton
import triton.language as tl


@triton.jit
def to_dtype(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 ``x`` in ``dtype``, rounded to nearest even as GPUs convert.

    Triton's interpreter truncates fp32 -> bf16, which would make every bf16 comparison with torch a rounding
    off; there the rounding is done on the bits instead (finite values: the kernels produce no NaN).
    """
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(dtype)


@triton.jit
def round_to(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` and back: an intermediate rounding that a torch reference makes.

    bf16 is rounded on the bits in compiled code too: on sm_90 a plain cast pair let the compiler keep a
    product unrounded (fused into the following add), so q*cos + rot*sin missed the reference's exact zeros.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return to_dtype(x, dtype, INTERPRETED).to(tl.float32)


@dataclass
class Launch:
    """One kernel launch spelled out: what `aot` compiles for a GPU target and what `__call__` runs.

    Built from tensors of any device (meta included), so that a launch can be compiled without a GPU.
    """

    kernel: Any
    grid: tuple[int, ...]
    args: dict[str, Any]  # runtime arguments by name: tensors, ints, floats
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int = 3  # Triton's default
    options: dict[str, Any] = field(default_factory=dict)  # other compile options, e.g. enable_fp_fusion

    def __call__(self) -> None:
        self.kernel[self.grid](
            **self.args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages, **self.options
        )
