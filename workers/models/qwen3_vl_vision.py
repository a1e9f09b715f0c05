"""Qwen3-VL vision tower: patch embedding (patch 16, with bias), learned position embeddings bilinearly resampled to
each grid, ViT blocks (LayerNorm, 2-D rotary attention, GELU-tanh MLP), the patch merger, and the DeepStack mergers.

Rows are patches in the processor's order (per item, per temporal patch, merge-window by merge-window), as for
Qwen2-VL, whose rotary tables and frame attention are reused. The forward returns the merged embeddings and one
feature set per ``deepstack_visual_indexes`` entry: the output of that block through its own merger (LayerNorm
after the 2x2 concatenation), each with the merged embeddings' rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.fp8_rows import Rows, linear_on
from workers.models.frame_attention import attention_for, grouped_item_order
from workers.models.qwen3_vl_spec import VISION_LAYER_NORM_EPS, Qwen3VisionSpec, Qwen3VLSpec
from workers.models.runtime import upload
from workers.models.vision import (
    VisionBlock,
    rows_in_order,
    vision_rotary_cos_sin,
    vision_rotary_positions,
)
from workers.models.weights import CheckpointWeights, assign_state, built_and_loaded, checkpoint_root, load_vision_state


@dataclass
class VisionFeatures:
    """A forward's output: ``merged`` [N / merge**2, out_hidden] and the DeepStack sets, each of that shape."""

    merged: torch.Tensor
    deepstack: list[torch.Tensor]

    def stacked(self) -> torch.Tensor:
        """[1 + len(deepstack), rows, out_hidden]: every set of an item in one tensor (one cache entry)."""
        return torch.stack([self.merged, *self.deepstack])


# --- pure functions ---------------------------------------------------------------------------------


def patch_coordinates(grid_thw: torch.Tensor, merge: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, col, grid h, grid w) of every patch row in merge-window order, as int64 [N] each (h, w: [N, 2])."""
    positions = vision_rotary_positions(grid_thw.cpu(), merge)  # [N, 2] (row, col)
    sizes = torch.repeat_interleave(grid_thw[:, 1:].cpu(), grid_thw.prod(dim=1).cpu(), dim=0)  # [N, 2] (h, w)
    return positions[:, 0], positions[:, 1], sizes


def _axis_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    # align_corners=True: target index i of `size` samples source point i * (side - 1) / (size - 1).
    src = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1).to(torch.float32)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_interpolation(grid_thw: torch.Tensor, side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather indices into the flattened ``side x side`` table and their bilinear weights, [N, 4] each.

    The same sampling as transformers' Qwen3-VL (`get_vision_interpolation_indices_and_weights`, bilinear,
    align_corners): the tap order (h0 w0, h0 w1, h1 w0, h1 w1) and fp32 weights match, so the weighted sum
    rounds as the reference's does."""
    row, col, sizes = patch_coordinates(grid_thw, merge)
    h_taps, h_weights = _axis_taps(row, sizes[:, 0], side)
    w_taps, w_weights = _axis_taps(col, sizes[:, 1], side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return indices, weights


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# --- modules (attribute names match the checkpoint's `model.visual.*` keys) --------------------------


class PatchEmbed(nn.Module):
    def __init__(self, spec: Qwen3VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        kernel = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        self.proj = nn.Conv3d(spec.in_chans, spec.embed_dim, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        # A linear layer over each flattened patch; the CPU keeps the reference's conv (see vision.PatchEmbed).
        rows = rows.to(self.proj.weight.dtype)
        if rows.is_cuda:
            return F.linear(rows, self.proj.weight.view(self.spec.embed_dim, -1), self.proj.bias)
        spec = self.spec
        patches = rows.view(-1, spec.in_chans, spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        return self.proj(patches).view(-1, spec.embed_dim)


class VisionMlp(nn.Module):
    def __init__(self, spec: Qwen3VisionSpec) -> None:
        super().__init__()
        if spec.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported Qwen3-VL vision hidden_act {spec.hidden_act!r}")
        self.linear_fc1 = nn.Linear(spec.embed_dim, spec.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(spec.intermediate_size, spec.embed_dim, bias=True)

    @property
    def first(self) -> nn.Module:
        """The linear the block's second norm feeds."""
        return self.linear_fc1

    def forward(self, x: Rows) -> torch.Tensor:
        return self.linear_fc2(gelu_tanh(linear_on(self.linear_fc1, x)))


class PatchMerger(nn.Module):
    """LayerNorm, every merge**2 consecutive rows concatenated, Linear-GELU-Linear. The DeepStack mergers
    (``postshuffle``) normalise after the concatenation, over the merged width."""

    def __init__(self, spec: Qwen3VisionSpec, postshuffle: bool) -> None:
        super().__init__()
        self.merged_dim = spec.merged_dim
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(spec.merged_dim if postshuffle else spec.embed_dim, eps=VISION_LAYER_NORM_EPS)
        self.linear_fc1 = nn.Linear(spec.merged_dim, spec.merged_dim)
        self.linear_fc2 = nn.Linear(spec.merged_dim, spec.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle:
            return self.project(self.norm(x.view(-1, self.merged_dim)))
        return self.project(self.norm(x))

    def project(self, normed: torch.Tensor) -> torch.Tensor:
        """The merger after its LayerNorm (exact GELU here, as the reference's nn.GELU())."""
        return self.linear_fc2(F.gelu(self.linear_fc1(normed.view(-1, self.merged_dim))))


class Qwen3VisionTower(nn.Module):
    """pixel patches -> `VisionFeatures` (merged embeddings and the DeepStack feature sets)."""

    def __init__(self, spec: Qwen3VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.patch_embed = PatchEmbed(spec)
        self.pos_embed = nn.Embedding(spec.num_position_embeddings, spec.embed_dim)
        self.blocks = nn.ModuleList([VisionBlock(spec, VisionMlp) for _ in range(spec.depth)])
        self.merger = PatchMerger(spec, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            [PatchMerger(spec, postshuffle=True) for _ in spec.deepstack_visual_indexes]
        )

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path | CheckpointWeights,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        spec: Qwen3VLSpec | None = None,
    ) -> Qwen3VisionTower:
        spec = spec or Qwen3VLSpec.from_dir(checkpoint_root(path))
        vision = spec.vision
        return built_and_loaded(lambda: cls(vision), load_vision_state(path, device, dtype or spec.dtype))

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        assign_state(self, state, "Qwen3-VL vision tower")

    @property
    def device(self) -> torch.device:
        return self.merger.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.merger.norm.weight.dtype

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionFeatures:
        """pixel_values [num_patches, patch_dim], grid_thw [num_items, 3]."""
        grid_thw = self._validate(pixel_values, grid_thw)
        pixel_values = upload(pixel_values, self.device)
        order = grouped_item_order(grid_thw)
        if order is None:
            return self._forward(pixel_values, grid_thw)
        # Items of one frame length side by side, so that attention batches their frames; undone at the end.
        patches = grid_thw.prod(dim=1).tolist()
        merged = [n // self.spec.spatial_merge_size**2 for n in patches]
        back = sorted(range(len(order)), key=order.__getitem__)
        out = self._forward(pixel_values[rows_in_order(patches, order, self.device)], grid_thw[order])
        restore = rows_in_order([merged[item] for item in order], back, self.device)
        return VisionFeatures(out.merged[restore], [feature[restore] for feature in out.deepstack])

    def position_embeddings(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """The learned position table resampled to every patch row: [N, embed_dim]."""
        indices, weights = position_interpolation(grid_thw, self.spec.grid_side, self.spec.spatial_merge_size)
        indices, weights = upload(indices, self.device), upload(weights, self.device)
        # fp32 weights, so a bf16 table is summed in fp32 as the reference's is; cast by the caller's add.
        return (self.pos_embed(indices) * weights[:, :, None]).sum(1)

    def _forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionFeatures:
        spec = self.spec
        positions = upload(vision_rotary_positions(grid_thw, spec.spatial_merge_size), self.device)
        cos, sin = vision_rotary_cos_sin(positions, spec.head_dim, spec.rope_theta)
        x = self.patch_embed(pixel_values)
        x = x + self.position_embeddings(grid_thw).to(x.dtype)
        attend = attention_for((), grid_thw, spec.num_heads, spec.head_dim, x)
        normed: Rows = self.blocks[0].norm1(x)  # (torch's: the first norm has no residual add to fuse with)
        next_norms = [*(block.norm1 for block in self.blocks[1:]), self.merger.norm]
        next_linears = [*(block.attn.qkv for block in self.blocks[1:]), None]
        deepstack: list[torch.Tensor] = []
        for index, block in enumerate(self.blocks):
            x, normed = block(x, normed, cos, sin, attend, next_norms[index], next_linears[index])
            if index in spec.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[spec.deepstack_visual_indexes.index(index)]
                deepstack.append(merger(x))
        return VisionFeatures(self.merger.project(normed), deepstack)

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
        if int(grid.prod(dim=1).sum()) != pixel_values.shape[0]:
            raise ValueError(
                f"grid_thw covers {int(grid.prod(dim=1).sum())} patches, pixel_values has {pixel_values.shape[0]}"
            )
        return grid
