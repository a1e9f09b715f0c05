"""@triton.jit helpers shared by the kernels (imports triton)."""

from __future__ import annotations

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
    """fp32 ``x`` rounded to ``dtype`` and back: an intermediate rounding that a torch reference makes."""
    return to_dtype(x, dtype, INTERPRETED).to(tl.float32)
