"""The FP8 decode GEMV behind `workers.kernels.fp8.gemv_triton` (imports triton): ``out = x @ (w * w_s)^T + bias``
for up to `DOT_MAX_ROWS` rows of x (bf16 as they come), reading the FP8 weight once, as every decode step does.

Scale indexing, the one rule of `workers.kernels.fp8_triton`: the weight's ``[n, k]`` element has scale
``w_scale[n // scale_block_n, k // scale_block_k]``. A K sub-tile of `SCALE_K` columns never straddles a scale block
(`SCALE_K` divides the block, or the block covers all of K), so each sub-tile takes one scale per weight row and the
scaling happens on the sub-tile's fp32 sum.

Two kernels, `GemvConfig.variant` picks one:

* ``dot``: the x rows as a tile of 16, 32 or 64 rows, times the weight tile widened to bf16 (exact: every e4m3 value
  is a bf16 value) on the tensor cores. Any M <= `DOT_MAX_ROWS`: decode batches too.
* ``sum``: no MMA, for few rows (up to `SUM_MAX_ROWS`): a [BLOCK_N, BLOCK_K] weight tile loaded K-contiguous (16-byte
  loads of FP8), widened to fp32, multiplied by each x row and summed along K, the rows unrolled at compile time. A
  16-row MMA tile would spend 15/16 of its work on padding at batch 1, and the widened weight tile would go through
  shared memory into the MMA's layout. BLOCK_K may span several `SCALE_K` sub-tiles (more bytes in flight a
  program): their sums are scaled before they are added. Its loads are pipelined through shared memory by
  ``tl.range``'s stages (the kernel's num_stages pipelines only loads that feed a dot); the x rows reach the weight
  tile's layout through shared memory (a barrier a tile), or, with ``x_direct`` (1 stage), are loaded by each thread
  in that layout.

`gemv_config` picks the kernel by (M, N, K) from `default_kernel`, which `benchmarks.fp8_gemm --sweep-gemv` informs.
Both read the weight with evict-first loads where the config asks (each weight is read once a step; x, read by every
program, stays cached) and split K the same way (`gemv_config`, `_gemv_epilogue`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from workers.kernels._launch import check_launchable, interpreted, next_power_of_2
from workers.kernels._triton_common import Launch, to_dtype

SCALE_K = tl.constexpr(128)  # the weight's K scale block (or a divisor of it): one scale a sub-tile
DOT_MIN_ROWS = 16  # the smallest tl.dot: fewer rows are padded to it (masked, never read)
# Up to this many rows the weight's bytes still dominate a product's traffic (a 7B projection's weight is ~50x 64 rows
# of activations), so streaming the weight once beats quantizing the activations for a GEMM: decode batches too.
DOT_MAX_ROWS = 64
SUM_MAX_ROWS = 8  # the sum kernel unrolls its rows: past this the dot kernel does the rows' work in one MMA
VARIANTS = ("dot", "sum")


@triton.jit
def _gemv_dot_kernel(
    x_ptr,
    w_ptr,
    w_s_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    arrivals_ptr,
    M,
    N,
    K,
    k_per_split,
    split_k,
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_om,
    scale_block_n,
    scale_block_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WEIGHT_EVICTION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Each program streams BLOCK_N weight rows over its slice of K once, a `SCALE_K` tile at a time, widening each
    FP8 tile to x's dtype in registers, and scales the tile's fp32 product by the weight's scales for that tile."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_in = (cols % N).to(tl.int64)  # columns past N wrap onto real ones (no load mask on N); not stored
    ks = tl.arange(0, SCALE_K)
    row_in = rows < M
    k_start = pid_k * k_per_split
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + k_start + ks[None, :]
    w_ptrs = w_ptr + cols_in[None, :] * stride_wn + k_start + ks[:, None]
    w_s_ptrs = w_s_ptr + (cols_in // scale_block_n) * stride_wsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), SCALE_K):
        k_in = ks < K - k0
        x = tl.load(x_ptrs, mask=row_in[:, None] & k_in[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_in[:, None], other=0.0, eviction_policy=WEIGHT_EVICTION)
        w_s = tl.load(w_s_ptrs + k0 // scale_block_k)
        if INTERPRETED:  # noqa: SIM108 (a static branch; the ternary form is not what Triton kernels here use)
            part = tl.dot(x.to(tl.float32), w.to(tl.float32))
        else:
            part = tl.dot(x, w.to(x.dtype))
        acc += part * w_s[None, :]
        x_ptrs += SCALE_K
        w_ptrs += SCALE_K
    _gemv_epilogue(
        acc, rows, cols, M, N, pid_n, pid_k, split_k, partial_ptr, arrivals_ptr, bias_ptr, out_ptr, stride_om,
        BLOCK_M, BLOCK_N, SPLIT, HAS_BIAS, INTERPRETED,
    )  # fmt: skip


@triton.jit
def _gemv_sum_kernel(
    x_ptr,
    w_ptr,
    w_s_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    arrivals_ptr,
    M,
    N,
    K,
    k_per_split,
    split_k,
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_om,
    scale_block_n,
    scale_block_k,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUBS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    X_DIRECT: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WEIGHT_EVICTION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Each program streams BLOCK_N weight rows over its slice of K once, a [BLOCK_N, SUBS, SCALE_K] tile at a time
    widened to fp32; per x row (ROWS = M of them, unrolled, one accumulator each): the tile times the row, summed
    per sub-tile, times the sub-tile's scales, summed. The accumulators become one [BLOCK_M, BLOCK_N] tile for the
    split-K epilogue the dot kernel shares."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_in = (cols % N).to(tl.int64)  # columns past N wrap onto real ones (no load mask on N); not stored
    sub_starts = tl.arange(0, SUBS) * SCALE_K
    kk = sub_starts[:, None] + tl.arange(0, SCALE_K)[None, :]  # [SUBS, SCALE_K]: a tile's K offsets
    k_start = pid_k * k_per_split
    w_ptrs = w_ptr + cols_in[:, None, None] * stride_wn + k_start + kk[None, :, :]
    x_ptrs = x_ptr + k_start + kk
    w_s_ptrs = w_s_ptr + (cols_in // scale_block_n)[:, None] * stride_wsn

    acc0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc4 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc5 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc6 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc7 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # tl.range's stages: Triton pipelines a loop's loads through shared memory by the kernel's num_stages only where
    # they feed a dot; this loop has none.
    for k0 in tl.range(k_start, tl.minimum(k_start + k_per_split, K), SUBS * SCALE_K, num_stages=NUM_STAGES):
        k_in = kk < K - k0
        w = tl.load(w_ptrs, mask=k_in[None, :, :], other=0.0, eviction_policy=WEIGHT_EVICTION).to(tl.float32)
        w_s = tl.load(
            w_s_ptrs + ((k0 + sub_starts) // scale_block_k)[None, :], mask=(sub_starts < K - k0)[None, :], other=0.0
        )
        acc0 += _row_sum(w, w_s, x_ptrs, k_in, X_DIRECT)
        if ROWS > 1:
            acc1 += _row_sum(w, w_s, x_ptrs + stride_xm, k_in, X_DIRECT)
        if ROWS > 2:
            acc2 += _row_sum(w, w_s, x_ptrs + 2 * stride_xm, k_in, X_DIRECT)
        if ROWS > 3:
            acc3 += _row_sum(w, w_s, x_ptrs + 3 * stride_xm, k_in, X_DIRECT)
        if ROWS > 4:
            acc4 += _row_sum(w, w_s, x_ptrs + 4 * stride_xm, k_in, X_DIRECT)
        if ROWS > 5:
            acc5 += _row_sum(w, w_s, x_ptrs + 5 * stride_xm, k_in, X_DIRECT)
        if ROWS > 6:
            acc6 += _row_sum(w, w_s, x_ptrs + 6 * stride_xm, k_in, X_DIRECT)
        if ROWS > 7:
            acc7 += _row_sum(w, w_s, x_ptrs + 7 * stride_xm, k_in, X_DIRECT)
        w_ptrs += SUBS * SCALE_K
        x_ptrs += SUBS * SCALE_K

    rows = tl.arange(0, BLOCK_M)
    acc = tl.where(rows[:, None] == 0, acc0[None, :], 0.0)
    if ROWS > 1:
        acc = tl.where(rows[:, None] == 1, acc1[None, :], acc)
    if ROWS > 2:
        acc = tl.where(rows[:, None] == 2, acc2[None, :], acc)
    if ROWS > 3:
        acc = tl.where(rows[:, None] == 3, acc3[None, :], acc)
    if ROWS > 4:
        acc = tl.where(rows[:, None] == 4, acc4[None, :], acc)
    if ROWS > 5:
        acc = tl.where(rows[:, None] == 5, acc5[None, :], acc)
    if ROWS > 6:
        acc = tl.where(rows[:, None] == 6, acc6[None, :], acc)
    if ROWS > 7:
        acc = tl.where(rows[:, None] == 7, acc7[None, :], acc)
    _gemv_epilogue(
        acc, rows, cols, M, N, pid_n, pid_k, split_k, partial_ptr, arrivals_ptr, bias_ptr, out_ptr, stride_om,
        BLOCK_M, BLOCK_N, SPLIT, HAS_BIAS, INTERPRETED,
    )  # fmt: skip


@triton.jit
def _row_sum(w, w_s, x_ptrs, k_in, X_DIRECT: tl.constexpr):
    """One x row's share of a weight tile: [BLOCK_N] fp32, each `SCALE_K` sub-tile's sum scaled before the add.

    X_DIRECT loads the row straight into the weight tile's layout, each thread its own copy (L1 hits, for every
    weight row a thread holds); otherwise the row is loaded once and spread to that layout through shared memory, a
    barrier a tile."""
    if X_DIRECT:
        mask = tl.broadcast_to(k_in[None, :, :], w.shape)
        x = tl.load(tl.broadcast_to(x_ptrs[None, :, :], w.shape), mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(x_ptrs, mask=k_in, other=0.0).to(tl.float32)[None, :, :]
    return tl.sum(tl.sum(w * x, axis=2) * w_s, axis=1)


@triton.jit
def _gemv_epilogue(
    acc,
    rows,
    cols,
    M,
    N,
    pid_n,
    pid_k,
    split_k,
    partial_ptr,
    arrivals_ptr,
    bias_ptr,
    out_ptr,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """The output of a program's [BLOCK_M, BLOCK_N] fp32 tile, directly or through split K's last arrival.

    Split K (SPLIT): a projection with few output columns (a 7B down_proj has 3584) gives too few programs to keep
    every SM's loads in flight, so K is cut into ``split_k`` slices. Each slice's program writes its fp32 partial
    sums, then counts itself in on its column tile's arrival counter; the last to arrive adds the slices in a fixed
    order (the result does not depend on which program came last), writes the output and sets the counter back to
    0 for the next launch (so the counters need no clearing, also inside a CUDA graph)."""
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    if SPLIT:
        tile = rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(partial_ptr + pid_k * M * N + tile, acc, mask=mask)
        # Every thread's partial stored before one thread's release: the barrier, then the atomic's acq_rel at GPU
        # scope. The last arrival's acquire makes the others' partials visible; .cg reads them from L2, not a stale L1.
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(split_k):
                acc += tl.load(partial_ptr + s * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
            _gemv_store(acc, bias_ptr, out_ptr, rows, cols, N, mask, stride_om, HAS_BIAS, INTERPRETED)
            tl.atomic_xchg(arrivals_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        _gemv_store(acc, bias_ptr, out_ptr, rows, cols, N, mask, stride_om, HAS_BIAS, INTERPRETED)


@triton.jit
def _gemv_store(
    acc, bias_ptr, out_ptr, rows, cols, N, mask, stride_om, HAS_BIAS: tl.constexpr, INTERPRETED: tl.constexpr
):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + (cols % N)).to(tl.float32)[None, :]
    out = to_dtype(acc, out_ptr.dtype.element_ty, INTERPRETED)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], out, mask=mask)


# --- configs and launches -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemvConfig:
    """The decode GEMV's kernel and tiling: BLOCK_N weight rows a program, BLOCK_K columns a loop step (`SCALE_K` for
    ``dot``, a power-of-2 multiple of it for ``sum``), K cut into ``split_k`` slices of ``k_per_split`` columns (whole
    K tiles). The defaults are the kernel issue 29 measured first."""

    block_n: int
    split_k: int
    k_per_split: int
    variant: str = "dot"
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    evict_first: bool = False
    x_direct: bool = False  # sum at 1 stage: x loaded straight into the weight tile's layout (`_row_sum`)

    @property
    def name(self) -> str:
        flags = (" evict" if self.evict_first else "") + (" xdirect" if self.x_direct else "")
        tile = f"n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages}"
        return f"{self.variant} {tile}{flags} x{self.split_k}"


def default_kernel(m: int, n: int) -> GemvConfig:
    """The kernel and tile `gemv_config` uses for M rows (its split fields are placeholders), as the H200 sweep of the
    7B decode shapes (`benchmarks.fp8_gemm --sweep-gemv`, docs/performance.md) ranked them: at one row the ``sum``
    kernel, whose 16-byte weight loads skip the MMA's padding and layout change; from two rows the ``dot`` kernel, on
    32-column tiles while the rows fit the smallest MMA and 64-column tiles past it (its x tile then weighs as much as
    the weight tile). Evict-first weight loads everywhere: each weight is read once a step."""
    del n  # (one tile for every projection: the split, not the tile, adapts to N)
    if m == 1:
        return GemvConfig(32, 1, 0, variant="sum", block_k=256, num_stages=1, evict_first=True)
    return GemvConfig(32 if m <= DOT_MIN_ROWS else 64, 1, 0, evict_first=True)


def default_programs_per_sm(m: int) -> int:
    """Column tiles times K slices an SM: enough loads in flight to stream weights at HBM rate; more slices (a deeper
    split) won while the x tile is small."""
    return 8 if m <= DOT_MIN_ROWS else 4


def gemv_config(
    m: int, n: int, k: int, sm_count: int, programs_per_sm: int | None = None, **kernel: int | str | bool
) -> GemvConfig:
    """The config for x [m, k] times a weight [n, k]: `default_kernel`'s, with any of GemvConfig's kernel fields
    (``variant``, ``block_n``, ``block_k``, ``num_warps``, ``num_stages``, ``evict_first``, ``x_direct``) overridden,
    and K split until the column tiles times the slices fill every SM ``programs_per_sm`` times over; a slice is whole
    K tiles."""
    base = replace(default_kernel(m, n), **kernel)
    tiles_n = -(-n // base.block_n)
    tiles_k = -(-k // base.block_k)
    wanted = -(-(sm_count * (programs_per_sm or default_programs_per_sm(m))) // tiles_n)
    per_split = -(-tiles_k // max(1, min(wanted, tiles_k)))
    return replace(base, split_k=-(-tiles_k // per_split), k_per_split=per_split * base.block_k)


def sm_count(device: torch.device) -> int:
    """The device's SMs; an H200's where there is no CUDA device (meta tensors compiled ahead of time, the
    interpreter), so a plan is the same as on the box."""
    return _cuda_sm_count(device.index or 0) if device.type == "cuda" else H200_SMS


@functools.cache
def _cuda_sm_count(index: int) -> int:  # (asked by every eager GEMV call: once per device)
    return torch.cuda.get_device_properties(index).multi_processor_count


H200_SMS = 132
_ARRIVALS: dict[torch.device, torch.Tensor] = {}
ARRIVAL_COUNTERS = 1 << 16  # column tiles of one launch at most (a 64-row tile: 4M output columns)


def arrival_counters(device: torch.device) -> torch.Tensor:
    """The split-K GEMV's per-column-tile counters on ``device``: zero, and zero again after every launch (its last
    arrival resets its counter), so one buffer serves every launch on a stream in turn. Launches on concurrent
    streams would need buffers of their own: every process here runs its model on one stream."""
    if device not in _ARRIVALS:
        _ARRIVALS[device] = torch.zeros(ARRIVAL_COUNTERS, dtype=torch.int32, device=device)
    return _ARRIVALS[device]


def weight_gemv(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None
) -> torch.Tensor:
    check_launchable(x.device)
    out, step = plan_weight_gemv(x, w, w_scale, block, bias, interpreted())
    if out.numel():
        step()
    return out


def plan_weight_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    interpreted_mode: bool = False,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, Launch]:
    """(out [M, N] in x's dtype, the launch) for x [M <= DOT_MAX_ROWS, K], w [N, K] fp8 with w_scale [ceil(N / block_n),
    ceil(K / block_k)] (``block_k`` a multiple of `SCALE_K`, or K); ``config`` overrides `gemv_config`'s choice
    (`benchmarks.fp8_gemm` sweeps it)."""
    (m, k), n = x.shape, w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    config = config or gemv_config(m, n, k, sm_count(x.device))
    check_config(config, m)
    tiles_n = triton.cdiv(n, config.block_n)
    if tiles_n > ARRIVAL_COUNTERS:
        raise ValueError(f"the FP8 GEMV takes up to {ARRIVAL_COUNTERS * config.block_n} output columns, got {n}")
    partial = torch.empty((config.split_k, m, n) if config.split_k > 1 else (1,), dtype=torch.float32, device=x.device)
    common = {
        "BLOCK_N": config.block_n,
        "SPLIT": config.split_k > 1,
        "HAS_BIAS": bias is not None,
        "WEIGHT_EVICTION": "evict_first" if config.evict_first else "",
        "INTERPRETED": interpreted_mode,
    }
    if config.variant == "sum":
        kernel = _gemv_sum_kernel
        constexprs = {
            "ROWS": m,
            "BLOCK_M": next_power_of_2(m),
            "SUBS": config.block_k // 128,
            "NUM_STAGES": config.num_stages,
            "X_DIRECT": config.x_direct,
        }
        constexprs.update(common)
    else:
        kernel, constexprs = _gemv_dot_kernel, {"BLOCK_M": max(DOT_MIN_ROWS, next_power_of_2(m)), **common}
    step = Launch(
        kernel,
        grid=(tiles_n, config.split_k),
        args={
            "x_ptr": x,
            "w_ptr": w,
            "w_s_ptr": w_scale,
            "bias_ptr": bias if bias is not None else w_scale,  # read only with HAS_BIAS
            "out_ptr": out,
            "partial_ptr": partial,
            "arrivals_ptr": arrival_counters(x.device),
            "M": m,
            "N": n,
            "K": k,
            "k_per_split": config.k_per_split,
            "split_k": config.split_k,
            "stride_xm": x.stride(0),
            "stride_wn": w.stride(0),
            "stride_wsn": w_scale.stride(0),
            "stride_om": out.stride(0),
            "scale_block_n": block[0],
            "scale_block_k": block[1],
        },
        constexprs=constexprs,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out, step


def check_config(config: GemvConfig, m: int) -> None:
    """ValueError for a config no kernel can run on M rows (a sweep's or a caller's mistake, said plainly)."""
    if config.variant not in VARIANTS:
        raise ValueError(f"GemvConfig.variant must be one of {VARIANTS}, got {config.variant!r}")
    rows = SUM_MAX_ROWS if config.variant == "sum" else DOT_MAX_ROWS
    if m > rows:
        raise ValueError(f"the FP8 GEMV's {config.variant} kernel takes up to {rows} rows, got {m}")
    subs = config.block_k // 128
    if config.block_k % 128 or subs != next_power_of_2(subs) or (config.variant == "dot" and subs != 1):
        raise ValueError(f"GemvConfig.block_k must be 128 (dot) or 128 times a power of 2 (sum), got {config.block_k}")
    if config.x_direct and (config.variant != "sum" or config.num_stages > 1):
        raise ValueError(
            "GemvConfig.x_direct is for the sum kernel at num_stages 1 (pipelined, each thread's copy of x would be "
            "staged in shared memory)"
        )
    if config.k_per_split % config.block_k or config.k_per_split < 1 or config.split_k < 1:
        raise ValueError(
            f"GemvConfig's K slices must be whole {config.block_k}-column tiles, got {config.split_k} of "
            f"{config.k_per_split}"
        )
