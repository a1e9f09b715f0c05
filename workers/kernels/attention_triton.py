"""Triton kernels behind `workers.kernels.attention` (imports triton; import it only through that module).

Layout of the work. Queries are flat [T, heads, D], sequence after sequence. A program takes BLOCK_Q
consecutive new tokens of one sequence and all GROUP query heads that share one kv head, as the
BLOCK_M = BLOCK_Q * GROUP (padded) rows of one tile: the K/V it streams through the block table are read
once for the whole head group, which is what makes GQA decode cheap. The grid's first axis enumerates
(sequence, query block) pairs without a host-side table: sequence s owns programs
``query_starts[s] // BLOCK_Q + s ..`` (at least as many as it needs, at most one spare), and each
program finds its sequence by binary search over query_starts.

Keys are read one position at a time through the block table (physical block, then offset), so any block
size works, including ones that are not a power of two or not a multiple of the key tile.

Split-K: with few programs and long contexts the key range of each query block is cut into
``num_splits`` parts, one program each; they write their unnormalised output, running max and sum to fp32
scratch, and `_reduce_splits_kernel` merges them.

Softmax is online, in fp32 and base 2 (the scale is pre-multiplied by log2(e)). As in FlashAttention, the
probabilities are rounded to the input dtype before the P @ V product so that both products run on tensor
cores for 16-bit inputs; fp32 inputs use IEEE fp32 products (Triton's default would be TF32).

An FP8 cache (FP8_KV) is read at one byte an element: each K/V tile is widened to fp32 as loaded, multiplied by
its (slot, kv head) scales and rounded to q's dtype, then the products run as for a cache of that dtype.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from workers.kernels._launch import check_launchable, interpreted, next_power_of_2
from workers.kernels._triton_common import Launch, to_dtype
from workers.kernels.layout import AttentionMetadata

LOG2E = math.log2(math.e)
MAX_SPLITS = 32
# One key tile per split at least. Decode at small batch is latency bound (each program walks its tiles one
# dependent load after another), so a short context is better served by many short splits, which cost only
# their merge.
MIN_SPLIT_TOKENS = 64
# What `choose_num_splits` aims at (a module setting so that benchmarks can sweep it). More, shorter programs
# bound the launch's wait for its longest ones when a few long (image) contexts sit among short ones.
SPLIT_PROGRAMS_PER_SM = 4
DEFAULT_SM_COUNT = 132  # H200; used when the device cannot be asked (the interpreter)
# Decode launches with no forced split count cut every sequence's keys into splits of one length for the whole
# batch (`_balanced_tiles`), instead of each sequence into the same number of splits: a long context among
# short ones then gets more programs rather than longer ones, and does not slow every stream's step.
# Decode launches also run one program per sequence (token s is sequence s's query) instead of the general
# grid's program per query block plus a spare per sequence, each found by a binary search over query_starts.


@dataclass(frozen=True)
class Tiles:
    """A launch's tile shape: ``block_m`` query rows (query tokens x their head group, padded) against
    ``block_n`` keys per step, and the compiler's warps and pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    # A sequence's query blocks in reverse: the last block sees the most keys (causal), and started first it
    # does not finish alone after the others (GPUs dispatch programs roughly in order).
    heavy_first: bool = False


# Decode: the head group padded to the 16 rows of a tensor-core tile (`plan` widens it to the group).
DECODE_TILES = Tiles(block_m=16, block_n=64, num_warps=4, num_stages=2)
PREFILL_TILES = Tiles(block_m=64, block_n=64, num_warps=4, num_stages=2)


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    query_starts_ptr,
    query_lens_ptr,
    context_lens_ptr,
    context_total_ptr,
    block_table_ptr,
    num_seqs,
    num_heads,
    num_splits,
    block_table_stride,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ss,
    stride_ot,
    stride_oh,
    scale_log2,
    split_target,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    BALANCED: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
    ONE_PER_SEQUENCE: tl.constexpr,
    INTERPRETED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8_KV: tl.constexpr,
):
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if ONE_PER_SEQUENCE:
        # One program per sequence, whose one query is token `seq`: no search, no spare programs. Every one
        # of them starts with this chain of dependent loads, so it is short (a padded graph's empty
        # sequences, query length 0, leave at once).
        seq = program
        q_start = program
        q_len = tl.load(query_lens_ptr + seq)
        ctx_len = tl.load(context_lens_ptr + seq)
        q_block = 0
        if q_len == 0:
            return
    else:
        # The sequence: the last s with query_starts[s] // BLOCK_Q + s <= program.
        seq = _sequence_at(query_starts_ptr, num_seqs, program, BLOCK_Q, True)
        q_start = tl.load(query_starts_ptr + seq)
        q_len = tl.load(query_lens_ptr + seq)
        ctx_len = tl.load(context_lens_ptr + seq)
        q_block = program - (q_start // BLOCK_Q + seq)
        if q_block * BLOCK_Q >= q_len:
            return  # the spare program of this sequence
    if HEAVY_FIRST:
        q_block = tl.cdiv(q_len, BLOCK_Q) - 1 - q_block

    # Keys up to the block's last query; this program takes its split's share of them, in whole tiles.
    kv_len = ctx_len - q_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    num_tiles = tl.cdiv(kv_len, BLOCK_N)
    if BALANCED:
        tiles_per_split = _balanced_tiles(
            context_total_ptr, tl.num_programs(1), split_target, num_tiles, num_splits, BLOCK_N
        )
        if (split > 0) & (split * tiles_per_split >= num_tiles):
            return  # a split this sequence does not use: the merge does not read it
    else:
        tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    tok = q_block * BLOCK_Q + offs_m // GROUP  # index among the sequence's new tokens
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m // GROUP < BLOCK_Q) & (tok < q_len)
    d_ok = offs_d < HEAD_DIM
    q_pos = ctx_len - q_len + tok  # the query's position in its sequence: it sees keys 0 .. q_pos
    q_row = (q_start + tok).to(tl.int64)

    q = tl.load(
        q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if INTERPRETED:
        q = q.to(tl.float32)  # the interpreter cannot multiply bf16 values

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * block_table_stride
    for tile in range(tile_begin, tile_end):
        k_pos = tile * BLOCK_N + offs_n
        k_ok = k_pos < kv_len
        if BLOCK_SIZE % BLOCK_N == 0:
            # The tile lies in one block: one table read, then a contiguous run of slots (its first key is
            # within the context, so that entry is a real block).
            first = tile * BLOCK_N
            block = tl.load(table_row + first // BLOCK_SIZE).to(tl.int64)
            slot = block * BLOCK_SIZE + first % BLOCK_SIZE + offs_n
        else:
            block = tl.load(table_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + k_pos % BLOCK_SIZE
        k = tl.load(  # [HEAD_DIM_PAD, BLOCK_N]: K transposed by the addressing
            k_cache_ptr + slot[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None],
            mask=k_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
            mask=k_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if FP8_KV:  # dequantized as loaded: the rest of the loop is the 16/32-bit cache's
            k_scale = tl.load(k_scale_ptr + slot * stride_ss + kv_head, mask=k_ok, other=0.0)
            v_scale = tl.load(v_scale_ptr + slot * stride_ss + kv_head, mask=k_ok, other=0.0)
            k = to_dtype(k.to(tl.float32) * k_scale[None, :], q_ptr.dtype.element_ty, INTERPRETED)
            v = to_dtype(v.to(tl.float32) * v_scale[:, None], q_ptr.dtype.element_ty, INTERPRETED)
        s = tl.dot(q, k.to(tl.float32)) if INTERPRETED else tl.dot(q, k, input_precision=DOT_PRECISION)
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        s = tl.where(visible, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that sees no key of this tile (a split past its query, a padding row) keeps -inf: shift by
        # 0 instead so that exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p_in = to_dtype(p, v.dtype, INTERPRETED)
        if INTERPRETED:
            acc = acc * alpha[:, None] + tl.dot(p_in.to(tl.float32), v.to(tl.float32))
        else:
            acc = tl.dot(p_in, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        part = (q_row * num_heads + head) * num_splits + split
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l_i is 0 only on padding rows
        tl.store(
            out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            to_dtype(out, out_ptr.dtype.element_ty, INTERPRETED),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _sequence_at(query_starts_ptr, num_seqs, position, BLOCK_Q: tl.constexpr, SPARE_PER_SEQ: tl.constexpr):
    """The last sequence s whose first program, query_starts[s] // BLOCK_Q (plus s where every sequence has a
    spare program before the next), is at or before ``position``: a binary search over query_starts."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_starts_ptr + mid) // BLOCK_Q
        if SPARE_PER_SEQ:
            first += mid
        if first <= position:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _balanced_tiles(context_total_ptr, num_kv_heads, split_target, num_tiles, num_splits, BLOCK_N: tl.constexpr):
    """Key tiles per split when splits are cut to one length for the whole batch: about ``split_target``
    programs with work in all, so a long context gets more splits, not longer ones (up to the grid's
    ``num_splits``; past that its splits grow). The batch's keys in all are one number summed once a step, not
    by each program."""
    total = tl.load(context_total_ptr)
    # Rounded up: rounding to nearest (more, shorter programs) made the engine's decode steps slower.
    split_tiles = tl.maximum(tl.cdiv(tl.cdiv(total, BLOCK_N) * num_kv_heads, split_target), 1)
    return tl.maximum(split_tiles, tl.cdiv(num_tiles, num_splits))


@triton.jit
def _reduce_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    query_starts_ptr,
    context_lens_ptr,
    context_total_ptr,
    num_seqs,
    num_heads,
    num_kv_heads,
    num_splits,
    split_target,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BALANCED: tl.constexpr,
    ONE_PER_SEQUENCE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    used = num_splits
    if BALANCED:  # (decode only: the token's keys are its sequence's whole context)
        seq = token if ONE_PER_SEQUENCE else _sequence_at(query_starts_ptr, num_seqs, token, 1, False)
        num_tiles = tl.cdiv(tl.load(context_lens_ptr + seq), BLOCK_N)
        tiles = _balanced_tiles(context_total_ptr, num_kv_heads, split_target, num_tiles, num_splits, BLOCK_N)
        used = tl.maximum(tl.cdiv(num_tiles, tiles), 1)
    s_ok = offs_s < used
    part = (token * num_heads + head) * num_splits + offs_s
    m = tl.load(part_max_ptr + part, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_sum_ptr + part, mask=s_ok, other=0.0)
    # Split 0 always holds key 0, which every query sees, so the max is finite; empty splits weigh 0.
    weight = tl.exp2(m - tl.max(m, 0))
    total = tl.sum(weight * l_s, 0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / total
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        to_dtype(out, out_ptr.dtype.element_ty, INTERPRETED),
        mask=offs_d < HEAD_DIM,
    )


def launch(
    q: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    tiles: Tiles | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run the kernel(s); inputs are validated by `attention.check_inputs` (the scales by `cache.check_scales`)."""
    check_launchable(q.device)
    out, launches = plan(q, kv_k, kv_v, metadata, scale, num_splits, block_m, block_n, interpreted(), tiles, kv_scales)
    for step in launches:
        step()
    return out


def plan(
    q: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    interpreted_mode: bool = False,
    tiles: Tiles | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[Launch]]:
    """The output tensor and the launches that fill it (the attention kernel, then the split merge if any).
    ``tiles`` replaces the default tile shape of the batch's kind; ``block_m``/``block_n`` override it.
    Decode batches with no forced split count get balanced splits. ``kv_scales``: an FP8 cache's (k, v) scales."""
    if kv_scales is not None and kv_scales[0].stride() != kv_scales[1].stride():
        raise ValueError(f"k and v scales must share strides, got {[s.stride() for s in kv_scales]}")
    tokens, heads, head_dim = q.shape
    kv_heads = kv_k.shape[1]
    group = heads // kv_heads
    decode_only = metadata.max_query_len == 1
    tiles = tiles or (DECODE_TILES if decode_only else PREFILL_TILES)
    block_m = block_m or max(tiles.block_m, next_power_of_2(group))
    block_n = block_n or tiles.block_n
    _check_blocks(block_m, block_n, group)
    # Decode-only batches put one token per program: more query rows would only be padding.
    block_q = 1 if decode_only else block_m // group
    balanced = decode_only and num_splits is None
    if num_splits is None:
        busy = -(-tokens // block_q) * kv_heads  # programs with work (the grid also holds spares)
        num_splits = choose_num_splits(busy, metadata.max_context_len, sm_count(q.device))
        if balanced:  # room for a long context's extra splits: the unused ones exit at once
            num_splits = min(MAX_SPLITS, max(2 * num_splits, 4), -(-metadata.max_context_len // block_n))
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must lie in [1, {MAX_SPLITS}], got {num_splits}")

    out = torch.empty_like(q)
    head_dim_pad = max(16, next_power_of_2(head_dim))  # tl.dot needs K >= 16
    split = num_splits > 1
    balanced = balanced and split  # (one split has nothing to balance)
    split_target = SPLIT_PROGRAMS_PER_SM * sm_count(q.device)
    # A program per sequence where token s is sequence s's one query: a decode batch, the empty sequences of
    # a padded graph (if any) after the real ones, as `BatchLayout` and the graphs lay them out.
    one_per_seq = decode_only and tokens == metadata.num_seqs
    context_total = metadata.context_total if balanced else metadata.context_lens  # (read only if balanced)
    if split:
        part_max = torch.empty((tokens, heads, num_splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty((tokens, heads, num_splits, head_dim_pad), dtype=torch.float32, device=q.device)
    else:
        part_max = part_sum = part_acc = out  # not read: SPLIT is a compile-time False

    attend = Launch(
        _paged_attention_kernel,
        # Else a program per query block, plus a spare per sequence, since blocks do not cross sequences.
        grid=(metadata.num_seqs if one_per_seq else tokens // block_q + metadata.num_seqs, kv_heads, num_splits),
        args={
            "q_ptr": q,
            "k_cache_ptr": kv_k,
            "v_cache_ptr": kv_v,
            "k_scale_ptr": kv_scales[0] if kv_scales else kv_k,  # (not read without FP8_KV: a compile-time False)
            "v_scale_ptr": kv_scales[1] if kv_scales else kv_v,
            "out_ptr": out,
            "part_acc_ptr": part_acc,
            "part_max_ptr": part_max,
            "part_sum_ptr": part_sum,
            "query_starts_ptr": metadata.query_starts,
            "query_lens_ptr": metadata.query_lens,
            "context_lens_ptr": metadata.context_lens,
            "context_total_ptr": context_total,
            "block_table_ptr": metadata.block_table,
            "num_seqs": metadata.num_seqs,
            "num_heads": heads,
            "num_splits": num_splits,
            "block_table_stride": metadata.block_table.stride(0),
            "stride_qt": q.stride(0),
            "stride_qh": q.stride(1),
            "stride_ks": kv_k.stride(0),
            "stride_kh": kv_k.stride(1),
            "stride_vs": kv_v.stride(0),
            "stride_vh": kv_v.stride(1),
            "stride_ss": kv_scales[0].stride(0) if kv_scales else 0,
            "stride_ot": out.stride(0),
            "stride_oh": out.stride(1),
            "scale_log2": scale * LOG2E,
            "split_target": split_target,
        },
        constexprs={
            "HEAD_DIM": head_dim,
            "HEAD_DIM_PAD": head_dim_pad,
            "GROUP": group,
            "BLOCK_M": block_m,
            "BLOCK_Q": block_q,
            "BLOCK_N": block_n,
            "BLOCK_SIZE": metadata.block_size,
            "SPLIT": split,
            "BALANCED": balanced,
            "HEAVY_FIRST": tiles.heavy_first,
            "ONE_PER_SEQUENCE": one_per_seq,
            "INTERPRETED": interpreted_mode,
            "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
            "FP8_KV": kv_scales is not None,
        },
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if not split:
        return out, [attend]
    merge = Launch(
        _reduce_splits_kernel,
        grid=(tokens, heads),
        args={
            "out_ptr": out,
            "part_acc_ptr": part_acc,
            "part_max_ptr": part_max,
            "part_sum_ptr": part_sum,
            "query_starts_ptr": metadata.query_starts,
            "context_lens_ptr": metadata.context_lens,
            "context_total_ptr": context_total,
            "num_seqs": metadata.num_seqs,
            "num_heads": heads,
            "num_kv_heads": kv_heads,
            "num_splits": num_splits,
            "split_target": split_target,
            "stride_ot": out.stride(0),
            "stride_oh": out.stride(1),
        },
        constexprs={
            "HEAD_DIM": head_dim,
            "HEAD_DIM_PAD": head_dim_pad,
            "SPLITS_PAD": next_power_of_2(num_splits),
            "BALANCED": balanced,
            "ONE_PER_SEQUENCE": one_per_seq,
            "BLOCK_N": block_n,
            "INTERPRETED": interpreted_mode,
        },
        num_warps=4,
    )
    return out, [attend, merge]


def choose_num_splits(programs: int, max_context_len: int, sm_count: int) -> int:
    """1 unless the launch would leave most SMs idle and the contexts are long enough to cut.

    Aims at about SPLIT_PROGRAMS_PER_SM programs per SM, with at least MIN_SPLIT_TOKENS keys per split. (Any count: the
    merge kernel compiles per power of two above it, the attention kernel takes it as an argument.)
    """
    if programs >= sm_count:
        return 1
    wanted = -(-SPLIT_PROGRAMS_PER_SM * sm_count // programs)
    return max(1, min(wanted, max_context_len // MIN_SPLIT_TOKENS, MAX_SPLITS))


def _check_blocks(block_m: int, block_n: int, group: int) -> None:
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if block_m < group:
        raise ValueError(f"block_m ({block_m}) must hold a whole head group ({group})")


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (the H200's count off a GPU, for the heuristic only)."""
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count
