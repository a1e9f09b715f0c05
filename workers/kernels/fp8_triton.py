"""Triton kernels behind `workers.kernels.fp8` (imports triton): dynamic FP8 activation quantization (per token, per
1 x group) and the scaled FP8 GEMM (block-wise or per-channel weight scales, activation scales per group or per
token). The decode GEMV, which multiplies bf16 activations by the FP8 weights directly, is `fp8_gemv_triton`.

Scale indexing, one rule for every layout: the weight's ``[n, k]`` element has scale
``w_scale[n // scale_block_n, k // scale_block_k]`` and the activation's ``[m, k]`` one ``x_scale[m, k // group]``. A
K tile never straddles a scale block (``BLOCK_K`` divides the block, or the block covers all of K), so each tile
takes one scale per row and column and the scaling happens on the tile's fp32 product, after the dot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from workers.kernels._launch import check_launchable, interpreted, next_power_of_2
from workers.kernels._triton_common import Launch, to_dtype

FP8_MAX = tl.constexpr(448.0)  # (constexpr: compiled kernels may read no other globals)
FP8_MIN_SCALE_AMAX = tl.constexpr(1e-10)  # a row of zeros gets a tiny scale, so its values quantize to 0, not NaN


@triton.jit
def _to_e4m3(x, INTERPRETED: tl.constexpr):
    """fp32 ``x`` (within +-448) in float8_e4m3fn, rounded to nearest even as torch and sm_90's cvt.rn round.

    Triton's interpreter (3.6) drops the carry when rounding a mantissa up past its last value (7.8 became 4, not
    8); there the value is put on the e4m3 grid in fp32 first, where the conversion is exact: normal numbers keep
    3 mantissa bits (rounded on the bits), subnormals (below 2**-6) are multiples of 2**-9 (their magnitude rounded
    by adding and taking away 1.5 * 2**23 * 2**-9, which rounds the lost bits to even).
    """
    if INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
        normal = bits.to(tl.float32, bitcast=True)
        magic = 12582912.0 * 0.001953125  # 1.5 * 2**23 * 2**-9
        sub = (tl.abs(x) + magic) - magic
        x = tl.where(tl.abs(x) < 0.015625, tl.where(x < 0, -sub, sub), normal)  # the sign kept, -0 included
    return x.to(tl.float8e4nv)


@triton.jit
def quantize_tile_rows(x):
    """x [R, C] fp32 (masked lanes 0) as values on e4m3's range and their scales [R]: amax / 448 per row,
    q = x * (1 / scale) (`fp8.quantize_reference`); the two divisions a row are IEEE ones (div_rn), as torch's
    (compiled Triton's ``/`` is an approximate fp32 division)."""
    scale, inverse = row_scale(tl.max(tl.abs(x), 1))
    return to_e4m3_range(x, inverse[:, None]), scale


@triton.jit
def quantize_row(x):
    """`quantize_tile_rows` of one row: x [C] fp32 (masked lanes 0) on e4m3's range and its scale (a scalar)."""
    scale, inverse = row_scale(tl.max(tl.abs(x), 0))
    return to_e4m3_range(x, inverse), scale


@triton.jit
def row_scale(amax):
    """(scale, its reciprocal) of a row's amax (or of each row's, given a vector): for the quantize kernels, and
    for a row held in pieces."""
    scale = tl.div_rn(tl.maximum(amax, FP8_MIN_SCALE_AMAX), FP8_MAX)
    return scale, tl.div_rn(1.0, scale)


@triton.jit
def to_e4m3_range(x, inverse):
    return tl.clamp(x * inverse, -FP8_MAX, FP8_MAX)


@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    n_cols,
    n_groups,
    stride_x,
    stride_q,
    stride_s,
    stride_sg,
    group,
    BLOCK: tl.constexpr,
    GROUPS: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One program per (row, GROUPS groups of ``group`` columns): amax, scale = amax / 448, q = x * (1 / scale). Narrow
    groups (1 x 128) go many to a program, as a [GROUPS, BLOCK] tile, so a program has a useful amount to load; a
    group wider than BLOCK (a whole row, per token) is read twice in BLOCK chunks: once for its amax, once to
    quantize. The two divisions a group are IEEE-rounded (div_rn; compiled Triton's ``/`` is an approximate fp32
    division), as torch's tensor division is. Scale ``[row, g]`` goes to
    ``s_ptr + row * stride_s + g * stride_sg``: row-major, or the
    column-major layout cuBLASLt's 1 x 128 scaling reads."""
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * GROUPS
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    if ONE_BLOCK:
        groups = first + tl.arange(0, GROUPS)
        offs = tl.arange(0, BLOCK)
        cols = groups[:, None] * group + offs[None, :]
        mask = (offs[None, :] < group) & (cols < n_cols) & (groups[:, None] < n_groups)
        q, scale = quantize_tile_rows(tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32))
        tl.store(q_row + cols, _to_e4m3(q, INTERPRETED), mask=mask)
        tl.store(s_ptr + row * stride_s + groups * stride_sg, scale, mask=groups < n_groups)
    else:
        start = first * group
        end = tl.minimum(start + group, n_cols)
        offs = tl.arange(0, BLOCK)
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for c in range(start, end, BLOCK):
            x = tl.load(x_row + c + offs, mask=c + offs < end, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale, inverse = row_scale(tl.max(amax, 0))
        for c in range(start, end, BLOCK):
            mask = c + offs < end
            x = tl.load(x_row + c + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_row + c + offs, _to_e4m3(to_e4m3_range(x, inverse), INTERPRETED), mask=mask)
        tl.store(s_ptr + row * stride_s + first * stride_sg, scale)


@triton.jit
def _scaled_mm_kernel(
    a_ptr,
    a_s_ptr,
    b_ptr,
    b_s_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_cm,
    a_group,
    scale_block_n,
    scale_block_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """c = (a * a_s) @ (b * b_s)^T: per K tile, the FP8 dot in fp32, times a_s[m, kb] * b_s[nb, kb], summed."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row tiles share each column tile while it is in L2.
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Out-of-range rows and columns wrap onto valid ones (no load masks on M and N); their results are not stored.
    rows_in = (rows % M).to(tl.int64)
    cols_in = (cols % N).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_in[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + cols_in[None, :] * stride_bn + ks[:, None]
    a_s_ptrs = a_s_ptr + rows_in * stride_asm
    b_s_ptrs = b_s_ptr + (cols_in // scale_block_n) * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_in = ks < K - k0
        a = tl.load(a_ptrs, mask=k_in[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_in[:, None], other=0.0)
        a_s = tl.load(a_s_ptrs + k0 // a_group)
        b_s = tl.load(b_s_ptrs + k0 // scale_block_k)
        if INTERPRETED:  # noqa: SIM108 (fp8 values are exact in fp32; the interpreter's dot is numpy's)
            part = tl.dot(a.to(tl.float32), b.to(tl.float32))
        else:
            part = tl.dot(a, b)
        acc += part * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:  # (indexed by the columns afresh: cols_in kept live across the loop spills 128 x 128 tiles)
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out = to_dtype(acc, c_ptr.dtype.element_ty, INTERPRETED)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :], out, mask=mask)


# --- launches -----------------------------------------------------------------------------------------------------


SCALE_LAYOUTS = ("row-major", "column-major")


def quantize(x: torch.Tensor, group: int, scale_layout: str = "row-major") -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, K] float8_e4m3fn, scales [M, ceil(K / group)] fp32) of x [M, K] with unit column stride; the scales
    row-major, or column-major (strides (1, M): cuBLASLt's 1 x 128 layout) with ``scale_layout="column-major"``."""
    check_launchable(x.device)
    q, s, step = plan_quantize(x, group, interpreted(), scale_layout)
    if x.numel():
        step()
    return q, s


def plan_quantize(
    x: torch.Tensor, group: int, interpreted_mode: bool = False, scale_layout: str = "row-major"
) -> tuple[torch.Tensor, torch.Tensor, Launch]:
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")
    rows, cols = x.shape
    groups = -(-cols // group)
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    if scale_layout == "row-major":
        s = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    else:  # written in place in the layout the GEMM reads, not transposed by a copy afterwards
        s = torch.empty((groups, rows), dtype=torch.float32, device=x.device).t()
    block = min(next_power_of_2(group), QUANTIZE_BLOCK)
    one_block = block >= group
    per_program = max(1, QUANTIZE_BLOCK // block) if one_block else 1
    step = Launch(
        _quantize_kernel,
        grid=(rows, triton.cdiv(groups, per_program)),
        args={
            "x_ptr": x,
            "q_ptr": q,
            "s_ptr": s,
            "n_cols": cols,
            "n_groups": groups,
            "stride_x": x.stride(0),
            "stride_q": q.stride(0),
            "stride_s": s.stride(0),
            "stride_sg": s.stride(1),
            "group": group,
        },
        constexprs={"BLOCK": block, "GROUPS": per_program, "ONE_BLOCK": one_block, "INTERPRETED": interpreted_mode},
        num_warps=max(1, min(8, block * per_program // 256)),
    )
    return q, s, step


QUANTIZE_BLOCK = 2048  # columns a program holds at once (8 per thread at 8 warps); a wider row is read in chunks


def scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_group: int,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    check_launchable(a.device)
    out, step = plan_scaled_mm(a, a_scale, a_group, b, b_scale, block, bias, out_dtype, interpreted())
    if out.numel():
        step()
    return out


def plan_scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_group: int,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    interpreted_mode: bool = False,
    config: ScaledMmConfig | None = None,
) -> tuple[torch.Tensor, Launch]:
    """(out [M, N], the launch that fills it) for a [M, K] fp8 with a_scale [M, ceil(K / a_group)], b [N, K] fp8 with
    b_scale [ceil(N / block_n), ceil(K / block_k)]; ``config`` overrides the tiling (`benchmarks.fp8_gemm` sweeps
    it)."""
    (m, k), n = a.shape, b.shape[0]
    if a_scale.shape[1] > 1 and a_scale.stride(1) != 1:
        raise ValueError(f"the Triton scaled GEMM reads row-major activation scales, got strides {a_scale.stride()}")
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    config = config or scaled_mm_config(m, n)
    step = Launch(
        _scaled_mm_kernel,
        grid=(triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),),
        args={
            "a_ptr": a,
            "a_s_ptr": a_scale,
            "b_ptr": b,
            "b_s_ptr": b_scale,
            "bias_ptr": bias if bias is not None else b_scale,  # read only with HAS_BIAS
            "c_ptr": out,
            "M": m,
            "N": n,
            "K": k,
            "stride_am": a.stride(0),
            "stride_asm": a_scale.stride(0),
            "stride_bn": b.stride(0),
            "stride_bsn": b_scale.stride(0),
            "stride_cm": out.stride(0),
            "a_group": a_group,
            "scale_block_n": block[0],
            "scale_block_k": block[1],
        },
        constexprs={
            "BLOCK_M": config.block_m,
            "BLOCK_N": config.block_n,
            "BLOCK_K": SCALED_MM_BLOCK_K,
            "GROUP_M": config.group_m,
            "HAS_BIAS": bias is not None,
            "INTERPRETED": interpreted_mode,
        },
        num_warps=config.warps,
        num_stages=config.stages,
    )
    return out, step


SCALED_MM_BLOCK_K = 128  # the scale group: a K tile never straddles two scale blocks


@dataclass(frozen=True)
class ScaledMmConfig:
    """The block-scaled GEMM's tiling: BLOCK_M x BLOCK_N output tiles over 128-wide K tiles, GROUP_M row tiles taking
    each column tile in turn (while it is in L2), warps a program and the loads' pipeline stages."""

    block_m: int = 64
    block_n: int = 128
    group_m: int = 8
    warps: int = 4
    stages: int = 3

    @property
    def name(self) -> str:
        return f"{self.block_m}x{self.block_n} g{self.group_m} w{self.warps} s{self.stages}"


def scaled_mm_config(m: int, n: int) -> ScaledMmConfig:
    """The tiling for an [m, K] x [n, K] product: 64 x 128 tiles, 4 warps, 3 stages for every shape until
    ``benchmarks.fp8_gemm --sweep-block`` has timed the alternatives on the H200 (the configs it sweeps all compile
    for sm_90 without spills)."""
    return ScaledMmConfig()
