"""The vision tower's attention: every frame of every image or video attends to itself alone.

Three ways to run it, all starting from a block's qkv projection (rotary applied on the way). Two are one SDPA
call per run of consecutive frames of one length (`frame_runs`: a video's frames, images of one size side
by side), the frames its batch:
- `SegmentFrames`: the frames as they are (FlashAttention-2, or what `VisionTower.tune_attention` picked),
  the CPU's path too;
- `PaddedFrames`: for cuDNN's attention, which compiles a kernel plan per shape (a new frame length costs
  a hundred calls' worth; `benchmarks.vit_profile`) and is faster than FlashAttention-2 on large frames once
  built. Images come in every size, so each
  frame is padded to one of a few lengths (`frame_bucket`), and the padding is masked.
The third, `VarlenSegments`, is one variable-length FlashAttention call over segments of any lengths (CUDA, fp16
or bf16): Qwen2.5-VL's windows, many and of several lengths (short at a grid's edges), and its frames.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from workers.kernels.vision import vision_rotary_qk, vision_rotary_qk_into
from workers.models.runtime import upload

log = logging.getLogger(__name__)

BUCKET_FLOOR = 256
# Below this many (padded) patches a frame runs FlashAttention-2 on the padded layout instead: cuDNN's
# kernel is faster, but each call costs more host time, which a small frame's matmuls are too short to hide.
CUDNN_MIN_FRAME = 2048
SMALL_FRAME_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# A padded key's extra coordinate: q's is 1, so its score is -MASK_SCORE * scale (-1,831 at head_dim 80),
# whose softmax weight is exactly 0 in fp32. Real keys' extra coordinate is 0 and adds exactly nothing.
MASK_SCORE = 16384.0

# SDPA kernels a CUDA tower may use, each tried alone by `VisionTower.tune_attention`.
ATTENTION_CANDIDATES = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


class FrameAttention(Protocol):
    """One forward's attention, called by every block: qkv [N, 3 * heads * head_dim] -> [N, heads, head_dim]."""

    def __call__(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor: ...


def attention_for(
    backends: Sequence[SDPBackend], grid_thw: torch.Tensor, heads: int, head_dim: int, like: torch.Tensor
) -> FrameAttention:
    """Padded frames where cuDNN comes first (its plans are per shape), the frames as they are else."""
    if backends and backends[0] == SDPBackend.CUDNN_ATTENTION:
        return PaddedFrames.plan(grid_thw, heads, head_dim, like)
    return SegmentFrames(grid_thw)


def sdpa_choice(backends: Sequence[SDPBackend]) -> contextlib.AbstractContextManager[object]:
    """SDPA restricted to ``backends``, tried in that order (empty: torch's own choice)."""
    return sdpa_kernel(list(backends), set_priority=True) if backends else contextlib.nullcontext()


@dataclass
class SegmentFrames:
    grid_thw: torch.Tensor

    def __call__(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
        q, k, v = vision_rotary_qk(qkv, cos, sin, heads)  # one Triton kernel on CUDA
        return segment_attention(q, k, v, self.grid_thw)


@dataclass(frozen=True)
class FrameRun:
    """Consecutive frames of one length: a video's, or those of images of one size next to each other."""

    row: int  # its first patch row
    frames: int
    length: int  # patches per frame


def frame_runs(grid_thw: torch.Tensor) -> list[FrameRun]:
    """The items' frames as runs of one length, in row order: attention batches each run's frames (a
    frame attends to itself alone), so three 768x1024 images take one call per block, not three."""
    runs: list[FrameRun] = []
    row = 0
    for t, h, w in grid_thw.tolist():
        if runs and runs[-1].length == h * w:
            runs[-1] = FrameRun(runs[-1].row, runs[-1].frames + t, h * w)
        else:
            runs.append(FrameRun(row, t, h * w))
        row += t * h * w
    return runs


def grouped_item_order(grid_thw: torch.Tensor) -> list[int] | None:
    """The items reordered so that those of one frame length sit together (in order of each length's first
    item), or None where they already do: `frame_runs` then finds one run per length."""
    lengths = (grid_thw[:, 1] * grid_thw[:, 2]).tolist()
    first = {length: lengths.index(length) for length in lengths}
    order = sorted(range(len(lengths)), key=lambda item: first[lengths[item]])
    return None if order == sorted(order) else order


def frame_bucket(length: int) -> int:
    """The length a frame of ``length`` patches is padded to: a multiple of 1/16 of the power of two below it,
    and of 256 at least. From 4,096 patches up (where attention's cost is) at most 6.25% more rows; 16
    lengths per octave: few plans, little waste."""
    step = max(BUCKET_FLOOR, 1 << max(0, length.bit_length() - 5))
    return -(-length // step) * step


def frame_chunks(frames: int, largest: int = 8) -> list[int]:
    """An item's frames split into powers of two up to ``largest`` (a video of 11 frames: 8, 2, 1), so that
    the batch sizes, and with them cuDNN's plans, stay few."""
    chunks = []
    while frames:
        size = min(largest, 1 << (frames.bit_length() - 1))
        chunks.append(size)
        frames -= size
    return chunks


@dataclass
class PaddedChunk:
    row: int  # its first patch row
    padded_row: int  # its first row in the padded layout
    frames: int
    length: int  # patches per frame
    padded: int  # rows per frame in the padded layout


@dataclass
class PaddedFrames:
    """One forward's q, k and v laid out for cuDNN: each chunk of an item's frames (`frame_chunks`) padded
    to its `frame_bucket` length. The head size grows by one coordinate (rounded up to a multiple of 16)
    that masks the padded keys, so no mask tensor is read and the real rows' scores are the unpadded ones.
    Built once per forward with what no block changes (the padding, the masking coordinate); each block's
    rotary kernel writes its rows straight into place, so the padding costs no copies."""

    qkv: torch.Tensor  # [3, padded rows, heads, padded_dim]
    dest: torch.Tensor  # [N] int64: each patch row's row in the padded layout
    chunks: list[PaddedChunk]
    head_dim: int

    @classmethod
    def plan(cls, grid_thw: torch.Tensor, heads: int, head_dim: int, like: torch.Tensor) -> PaddedFrames:
        chunks, dest = [], []
        padded_row = 0
        for run in frame_runs(grid_thw):
            padded = frame_bucket(run.length)
            row = run.row
            for frames in frame_chunks(run.frames):
                chunks.append(PaddedChunk(row, padded_row, frames, run.length, padded))
                starts = torch.arange(frames) * padded + padded_row
                dest.append((starts[:, None] + torch.arange(run.length)).flatten())
                row += frames * run.length
                padded_row += frames * padded
        # A multiple of 16 (80 -> 96, not 88): Triton assumes alignment only of integer arguments divisible by
        # 16, so at 88 the rotary kernel's scattered stores cannot be wide (slower than not padding at all);
        # cuDNN's attention runs as fast at 96 as at 80.
        padded_dim = -(-(head_dim + 1) // 16) * 16
        qkv = torch.zeros(3, padded_row, heads, padded_dim, device=like.device, dtype=like.dtype)
        rows = upload(torch.cat(dest), like.device)
        qkv[0, :, :, head_dim] = 1.0
        qkv[1, :, :, head_dim] = -MASK_SCORE
        qkv[1, rows, :, head_dim] = 0.0  # the real keys
        return cls(qkv, rows, chunks, head_dim)

    def __call__(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
        vision_rotary_qk_into(qkv, cos, sin, heads, self.qkv, self.dest)
        dim = self.head_dim
        out = qkv.new_empty(qkv.shape[0], heads, dim)
        for c in self.chunks:
            rows = slice(c.padded_row, c.padded_row + c.frames * c.padded)
            q, k, v = (x[rows].view(c.frames, c.padded, heads, -1).transpose(1, 2) for x in self.qkv)
            small = c.padded < CUDNN_MIN_FRAME
            with sdpa_kernel(SMALL_FRAME_BACKENDS, set_priority=True) if small else contextlib.nullcontext():
                attn = F.scaled_dot_product_attention(q, k, v, scale=dim**-0.5)  # [frames, heads, padded, pdim]
            real = out[c.row : c.row + c.frames * c.length].view(c.frames, c.length, heads, dim)
            real.copy_(attn[:, :, : c.length, :dim].transpose(1, 2))
        return out


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """Non-causal attention restricted to each frame of each item. q/k/v: [N, heads, head_dim].

    One batched SDPA call per run of frames of one length (`frame_runs`), not one call per frame.
    """
    out = []
    for run in frame_runs(grid_thw):
        rows = slice(run.row, run.row + run.frames * run.length)
        qs, ks, vs = (x[rows].view(run.frames, run.length, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        # Explicit scale: SDPA's internally derived 1/sqrt(d) can differ from d**-0.5 in the last bit,
        # which the reference passes, and bf16 then drifts from it block by block.
        attn = F.scaled_dot_product_attention(qs, ks, vs, scale=q.shape[-1] ** -0.5)
        out.append(attn.transpose(1, 2).reshape(run.frames * run.length, *q.shape[1:]))
    return torch.cat(out, dim=0)


def attention_runs(
    backend: SDPBackend, heads: int, head_dim: int, tokens: int, device: torch.device, dtype: torch.dtype
) -> bool:
    """Whether SDPA's ``backend`` alone takes a frame of ``tokens`` patches as the tower gives it
    (`attention_for`, rotary included)."""
    qkv = torch.randn(tokens, 3 * heads * head_dim, device=device, dtype=dtype)
    cos = torch.ones(tokens, head_dim, device=device)
    attend = attention_for((backend,), torch.tensor([[1, 1, tokens]]), heads, head_dim, qkv)
    try:
        with sdpa_choice((backend,)):
            attend(qkv, cos, torch.zeros_like(cos), heads)
    except RuntimeError:
        return False
    return True


@functools.cache
def varlen_kernel() -> Callable[..., torch.Tensor] | None:
    """torch's variable-length FlashAttention (``torch.nn.attention.varlen.varlen_attn``, torch 2.10 on), with
    the softmax scale bound where its signature takes one (2.11's may not: FlashAttention's own 1/sqrt(d) then);
    None, logged once, where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        log.warning(
            "torch %s has no torch.nn.attention.varlen: window attention runs one SDPA call per run of equal windows",
            torch.__version__,
        )
        return None
    takes_scale = "scale" in inspect.signature(varlen_attn).parameters
    log.info(
        "vision attention: variable-length FlashAttention (softmax scale %s)",
        "passed" if takes_scale else "the kernel's own",
    )

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int) -> torch.Tensor:
        scale = {"scale": q.shape[-1] ** -0.5} if takes_scale else {}
        return varlen_attn(q, k, v, cu, cu, longest, longest, **scale)

    return attend


def varlen_runs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `VarlenSegments` can run on this device in this dtype (FlashAttention: CUDA, fp16 or bf16)."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and varlen_kernel() is not None


@dataclass
class VarlenSegments:
    """Attention within consecutive segments of rows (a window, a frame), all of them in one variable-length
    FlashAttention call: no batching by length, no padding, no copies. Built once per forward, the boundaries
    uploaded without making the host wait."""

    cu_seqlens: torch.Tensor  # [segments + 1] int32 on the device
    longest: int

    @classmethod
    def of(cls, lengths: Sequence[int], device: torch.device) -> VarlenSegments:
        if not lengths or min(lengths) <= 0:
            raise ValueError(f"segments must be one or more, each of one row or more, got lengths {list(lengths)}")
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
        return cls(upload(cu, device), max(lengths))

    def __call__(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
        q, k, v = vision_rotary_qk(qkv, cos, sin, heads)  # one Triton kernel on CUDA
        return varlen_attention(q, k, v, self.cu_seqlens, self.longest)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, longest: int
) -> torch.Tensor:
    """Non-causal attention within each segment ``cu_seqlens[i]:cu_seqlens[i + 1]``; q/k/v [N, heads, head_dim]
    on CUDA in fp16 or bf16 (`varlen_runs`)."""
    kernel = varlen_kernel()
    if kernel is None:
        raise RuntimeError(f"torch {torch.__version__} has no variable-length attention (torch.nn.attention.varlen)")
    return kernel(q, k, v, cu_seqlens, longest)


def segment_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """Same as `segment_attention`, spelled out with a block-diagonal mask and an explicit softmax."""
    n = q.shape[0]
    segment = torch.bucketize(torch.arange(n, device=q.device), cu_seqlens[1:].to(q.device), right=True)
    allowed = segment[:, None] == segment[None, :]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
