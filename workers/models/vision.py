"""Qwen2-VL vision tower: patch embedding, ViT blocks with 2-D rotary attention, patch merger.

Input rows are patches in the order Qwen2-VL's image processor emits them: per item, per temporal
patch, the (h, w) grid walked merge-window by merge-window (each ``merge x merge`` window's patches are
consecutive). The merger relies on that order: it concatenates every ``merge**2`` consecutive rows.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend

from workers.kernels import fp8_act
from workers.kernels.fp8_norm import norm_quantize
from workers.kernels.norm import fused_add_layer_norm
from workers.kernels.vision import quick_gelu
from workers.models.fp8_rows import QuantizedRows, Rows, fp8_weight_of, linear_on, quantizes_for
from workers.models.frame_attention import (
    ATTENTION_CANDIDATES,
    FrameAttention,
    attention_for,
    grouped_item_order,
    sdpa_choice,
)
from workers.models.runtime import upload
from workers.models.spec import ModelSpec, VisionSpec
from workers.models.weights import CheckpointWeights, assign_state, built_and_loaded, checkpoint_root, load_vision_state

log = logging.getLogger(__name__)

# Qwen2-VL's LayerNorms are hard-coded to this eps in the reference implementation (not in config).
LAYER_NORM_EPS = 1e-6


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": quick_gelu,  # one Triton kernel on CUDA, x * sigmoid(1.702 x) in torch elsewhere
    "gelu": F.gelu,
    "silu": F.silu,
}


# --- small pure functions (plain-torch references for later kernels) -------------------------------


def vision_rotary_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(h, w) patch coordinates of every patch, in the processor's merge-window order: [N, 2]."""
    chunks = []
    for t, h, w in grid_thw.tolist():
        hpos = torch.arange(h).view(h, 1).expand(h, w)
        wpos = torch.arange(w).view(1, w).expand(h, w)
        # Reorder row-major (h, w) into (h/m, w/m, m, m) windows to match the patch row order.
        window = (h // merge, merge, w // merge, merge)
        hpos = hpos.reshape(window).permute(0, 2, 1, 3).flatten()
        wpos = wpos.reshape(window).permute(0, 2, 1, 3).flatten()
        chunks.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
    return torch.cat(chunks, dim=0).to(grid_thw.device)


def vision_rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [N, head_dim] (fp32) for 2-D rotary: first half of each rotated half is h, second w."""
    quarter = head_dim // 2
    # Computed on the CPU like the reference's init-time buffer: CUDA's pow rounds differently in the
    # last bit, and in bf16 that difference grows into visibly different outputs after a few blocks.
    inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter))
    inv_freq = inv_freq.to(positions.device)
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [N, 2, head_dim/4]
    freqs = freqs.flatten(1)  # [N, head_dim/2]: h frequencies then w frequencies
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rows_in_order(counts: list[int], order: list[int], device: torch.device) -> torch.Tensor:
    """The row indices that gather blocks of ``counts`` rows (block i: ``counts[i]`` rows, blocks back to back)
    in ``order``."""
    starts = [0, *itertools.accumulate(counts)]
    return upload(torch.cat([torch.arange(starts[i], starts[i] + counts[i]) for i in order]), device)


def cu_seqlens_from_grid(grid_thw: torch.Tensor) -> torch.Tensor:
    """Boundaries of attention segments: every frame (h*w patches) of every item is its own segment."""
    lengths = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return F.pad(lengths.cumsum(0), (1, 0)).to(torch.int64)


# --- modules (attribute names match the checkpoint's `visual.*` keys) ------------------------------


class PatchEmbed(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        kernel = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        self.proj = nn.Conv3d(spec.in_chans, spec.embed_dim, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # Each row is one (C, T, P, P) patch, so this Conv3d is mathematically a linear layer over the
        # flattened row. On the CPU the conv is kept because it is the reference's exact op: a matmul
        # differs by ~1e-6 relative, which on random test models is enough to flip near-tied greedy tokens.
        # On CUDA the conv's implicit-GEMM kernel is a visible share of the forward; the matmul is a small
        # fraction of it, and its rounding is within bf16's own.
        rows = pixel_values.to(self.proj.weight.dtype)
        return self.as_linear(rows) if rows.is_cuda else self.as_conv(rows)

    def as_conv(self, rows: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        patches = rows.view(-1, spec.in_chans, spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        return self.proj(patches).view(-1, spec.embed_dim)

    def as_linear(self, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows, self.proj.weight.view(self.spec.embed_dim, -1))


class VisionAttention(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.qkv = nn.Linear(spec.embed_dim, 3 * spec.embed_dim, bias=True)
        self.proj = nn.Linear(spec.embed_dim, spec.embed_dim, bias=True)

    def forward(self, x: Rows, cos: torch.Tensor, sin: torch.Tensor, attend: FrameAttention) -> torch.Tensor:
        """``x``: the normalised rows, or the same quantized by the norm for an FP8 ``qkv`` (`QuantizedRows`)."""
        out = attend(linear_on(self.qkv, x), cos, sin, self.num_heads)  # SDPA's kernel: the tower's `backends`
        return self.proj(out.reshape(x.shape[0], -1))


class VisionMlp(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        if spec.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {spec.hidden_act!r}; known: {sorted(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[spec.hidden_act]
        self.fc1 = nn.Linear(spec.embed_dim, spec.mlp_hidden_dim, bias=True)
        self.fc2 = nn.Linear(spec.mlp_hidden_dim, spec.embed_dim, bias=True)

    @property
    def first(self) -> nn.Module:
        """The linear the block's second norm feeds."""
        return self.fc1

    def forward(self, x: Rows) -> torch.Tensor:
        hidden = linear_on(self.fc1, x)
        fused = self.act is quick_gelu and hidden.shape[-1] <= fp8_act.MAX_COLUMNS
        if fused and quantizes_for(fp8_weight_of(self.fc2), hidden):
            # (one kernel writes fc2's FP8 rows: the widest activation is neither written in bf16 nor read back)
            data, scale = fp8_act.quick_gelu_quantize(hidden)
            return linear_on(self.fc2, QuantizedRows(data, scale, hidden.dtype))
        return self.fc2(self.act(hidden))


def add_and_norm(
    update: torch.Tensor, stream: torch.Tensor, norm: nn.LayerNorm, consumer: nn.Module | None = None
) -> tuple[torch.Tensor, Rows]:
    """(stream + update, norm of it): one Triton kernel on CUDA, torch's add and LayerNorm elsewhere. Where the norm
    feeds ``consumer``, an FP8 per-channel linear that would quantize its rows per token (`quantizes_for`), the kernel
    writes them quantized (`QuantizedRows`) instead."""
    if quantizes_for(fp8_weight_of(consumer), stream):
        q, scale, summed = norm_quantize(update, stream, norm.weight, norm.eps, norm.bias)
        return summed, QuantizedRows(q, scale, stream.dtype)
    normed, summed = fused_add_layer_norm(update, stream, norm.weight, norm.bias, norm.eps)
    return summed, normed


class VisionBlock(nn.Module):
    """``x + attn(norm1(x))``, then ``+ mlp(norm2(x))``. Each residual add is fused with the LayerNorm after
    it, so a block takes its input already normalised by norm1 and hands on the next LayerNorm's output."""

    def __init__(self, spec: VisionSpec, mlp: Callable[[Any], nn.Module] = VisionMlp) -> None:
        """``mlp``: the family's (Qwen3-VL's is GELU-tanh under other names)."""
        super().__init__()
        self.norm1 = nn.LayerNorm(spec.embed_dim, eps=LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(spec.embed_dim, eps=LAYER_NORM_EPS)
        self.attn = VisionAttention(spec)
        self.mlp = mlp(spec)

    def forward(
        self,
        x: torch.Tensor,
        normed: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: FrameAttention,
        next_norm: nn.LayerNorm,
        next_linear: nn.Module | None = None,
    ) -> tuple[torch.Tensor, Rows]:
        """(x, norm1(x)) -> (the block's output, next_norm of it); ``next_linear``: what next_norm feeds (the next
        block's ``qkv``), None where its rows go elsewhere (the merger's concatenation)."""
        x, normed = add_and_norm(self.attn(normed, cos, sin, attend), x, self.norm2, self.mlp.first)
        return add_and_norm(self.mlp(normed), x, next_norm, next_linear)


class PatchMerger(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.merged_dim = spec.merged_dim
        self.ln_q = nn.LayerNorm(spec.embed_dim, eps=LAYER_NORM_EPS)
        # Sequential only to keep the checkpoint's `mlp.0` / `mlp.2` key names.
        self.mlp = nn.Sequential(
            nn.Linear(spec.merged_dim, spec.merged_dim),
            nn.GELU(),
            nn.Linear(spec.merged_dim, spec.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.ln_q(x))

    def project(self, normed: torch.Tensor) -> torch.Tensor:
        """The merger after its LayerNorm: every merge**2 consecutive rows concatenated, then the MLP."""
        return self.mlp(normed.view(-1, self.merged_dim))


def warm_up_forward(tower: Any, frames: Sequence[tuple[int, int]]) -> None:
    """On CUDA, one forward of ``tower`` over blank frames of (rows, columns) merge units each; a no-op elsewhere.
    Every family's tower warms up this way, each over the frame sizes its own kernels need."""
    if tower.device.type != "cuda":
        return
    unit = tower.spec.spatial_merge_size
    grid = torch.tensor([[1, rows * unit, cols * unit] for rows, cols in frames])
    pixels = torch.zeros(int(grid.prod(dim=1).sum()), tower.spec.patch_dim, device=tower.device, dtype=tower.dtype)
    tower(pixels, grid)
    torch.cuda.synchronize(tower.device)


class VisionTower(nn.Module):
    """Qwen2-VL vision encoder: pixel patches -> one embedding per merged ``merge x merge`` window."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.patch_embed = PatchEmbed(spec)
        self.blocks = nn.ModuleList([VisionBlock(spec) for _ in range(spec.depth)])
        self.merger = PatchMerger(spec)
        # SDPA's kernels for the blocks' attention, in order (empty: torch's choice); see tune_attention.
        self.backends: tuple[SDPBackend, ...] = ()

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path | CheckpointWeights,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        spec: ModelSpec | None = None,
    ) -> VisionTower:
        """Build the tower and load ``visual.*`` from a checkpoint directory (dtype defaults to the file's)."""
        spec = spec or ModelSpec.from_dir(checkpoint_root(path))
        vision = spec.vision
        return built_and_loaded(lambda: cls(vision), load_vision_state(path, device, dtype or spec.dtype))

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load weights keyed relative to ``visual.``; raises ValueError on missing/extra/misshapen keys."""
        assign_state(self, state, "vision tower")

    def tune_attention(self, tokens: int = 4096) -> dict[str, float]:
        """On CUDA, the SDPA kernel whose whole forward is fastest on three frames of about ``tokens``
        patches, falling back to torch's order if that kernel cannot take an input. Sets ``backends``;
        returns each candidate's milliseconds per forward (inf: it cannot run); a no-op elsewhere.

        The forward is timed, not attention alone: cuDNN's faster kernel comes with more host work per call,
        which a forward hides behind its matmuls and a lone attention call does not. The timed frames are
        new sizes that share their `frame_bucket` with a warm-up's, as cuDNN's plans are per bucket."""
        if self.device.type != "cuda":
            return {}
        unit = self.spec.spatial_merge_size
        width = max(2, tokens // (64 * unit)) * unit
        warm = torch.tensor([[1, 64, width - unit]] * 3)
        timed = torch.tensor([[1, 64, width], [1, 64, width - unit], [1, 64, width]])
        times = {name: self._time_forward(backend, warm, timed) for name, backend in ATTENTION_CANDIDATES.items()}
        best = min(times, key=lambda name: times[name])
        self.backends = ()
        if times[best] == float("inf"):
            return times
        fallbacks = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
        self.backends = tuple(dict.fromkeys((ATTENTION_CANDIDATES[best], *fallbacks)))
        log.info("vision attention: %s (ms per forward of three %d-patch frames: %s)", best, 64 * width, times)
        return times

    def _time_forward(self, backend: SDPBackend, warm: torch.Tensor, timed: torch.Tensor) -> float:
        self.backends = (backend,)
        try:
            for grid, repeats in ((warm, 1), (timed, 2)):
                rows = int(grid.prod(dim=1).sum())
                pixels = torch.zeros(rows, self.spec.patch_dim, device=self.device, dtype=self.dtype)
                torch.cuda.synchronize(self.device)
                started = time.perf_counter()
                for _ in range(repeats):
                    self(pixels, grid)
                torch.cuda.synchronize(self.device)
        except RuntimeError:
            return float("inf")
        return 1e3 * (time.perf_counter() - started) / 2

    def warm_up(self) -> None:
        """On CUDA, one forward over two frames of different sizes, so that the first request does not
        pay for compiling the Triton kernels, cuBLAS's set-up and the allocator's growth (the first
        requests' images were several times slower without it). A no-op elsewhere."""
        warm_up_forward(self, [(16, 12), (10, 14)])

    @property
    def device(self) -> torch.device:
        return self.merger.ln_q.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.merger.ln_q.weight.dtype

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [num_patches, patch_dim], grid_thw [num_items, 3] -> [num_patches // merge**2, out_hidden]."""
        grid_thw = self._validate(pixel_values, grid_thw)
        pixel_values = upload(pixel_values, self.device)
        order = grouped_item_order(grid_thw)
        if order is None:
            return self._forward(pixel_values, grid_thw)
        # Items of one frame length side by side, so attention batches their frames (`frame_runs`); every
        # other step is per row or per frame, so only the rows' order changes, and it is undone at the end.
        patches = grid_thw.prod(dim=1).tolist()
        merged = [n // self.spec.spatial_merge_size**2 for n in patches]
        back = sorted(range(len(order)), key=order.__getitem__)
        embeds = self._forward(pixel_values[rows_in_order(patches, order, self.device)], grid_thw[order])
        return embeds[rows_in_order([merged[item] for item in order], back, self.device)]

    def _forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        positions = upload(vision_rotary_positions(grid_thw, self.spec.spatial_merge_size), self.device)
        cos, sin = vision_rotary_cos_sin(positions, self.spec.head_dim, self.spec.rope_theta)
        x = self.patch_embed(pixel_values)
        attend = attention_for(self.backends, grid_thw, self.spec.num_heads, self.spec.head_dim, x)
        normed: Rows = self.blocks[0].norm1(x)  # (torch's: the first norm has no residual add to fuse with)
        next_norms = [*(block.norm1 for block in self.blocks[1:]), self.merger.ln_q]
        next_linears = [*(block.attn.qkv for block in self.blocks[1:]), None]
        with sdpa_choice(self.backends):  # set once per forward, around every block
            for block, next_norm, next_linear in zip(self.blocks, next_norms, next_linears, strict=True):
                x, normed = block(x, normed, cos, sin, attend, next_norm, next_linear)
        return self.merger.project(normed)

    def _validate(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        if pixel_values.ndim != 2 or pixel_values.shape[1] != self.spec.patch_dim:
            raise ValueError(
                f"pixel_values must be [num_patches, {self.spec.patch_dim}], got {tuple(pixel_values.shape)}"
            )
        grid = torch.as_tensor(grid_thw).to(device="cpu", dtype=torch.int64)
        if grid.ndim != 2 or grid.shape[1] != 3 or grid.shape[0] == 0:
            raise ValueError(f"grid_thw must be [num_items, 3] with num_items >= 1, got {tuple(grid.shape)}")
        merge = self.spec.spatial_merge_size
        if (grid <= 0).any() or (grid[:, 1:] % merge).any():
            raise ValueError(f"grid_thw rows must be positive with h, w divisible by {merge}, got {grid.tolist()}")
        total = int(grid.prod(dim=1).sum())
        if total != pixel_values.shape[0]:
            raise ValueError(f"grid_thw covers {total} patches but pixel_values has {pixel_values.shape[0]} rows")
        return grid
