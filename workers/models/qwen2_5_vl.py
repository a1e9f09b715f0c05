"""Qwen2.5-VL (``model_type: qwen2_5_vl``; transformers' ``qwen2_5_vl`` is the reference).

The language model is Qwen2's, as Qwen2-VL's (`workers.models.language`); M-RoPE is Qwen2-VL's with videos in
absolute time (`workers.models.mrope`, ``vision.tokens_per_second``). The vision tower differs: RMSNorm, a gated
SiLU MLP, and attention within windows of ``window_size`` pixels except in ``fullatt_block_indexes``, where each
frame attends to itself. The patches are reordered so that each window's are consecutive (`window_index`), run
through the blocks and the merger in that order, and the merged rows put back in the processor's order.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.frame_attention import FrameAttention, SegmentFrames
from workers.models.language import LanguageModel, RMSNorm
from workers.models.mrope import rope_positions
from workers.models.registry import Family
from workers.models.runtime import upload
from workers.models.spec import ModelSpec, VisionSpec
from workers.models.synth_qwen2_5_vl import TABLES
from workers.models.vision import (
    PatchEmbed,
    VisionAttention,
    vision_rotary_cos_sin,
    vision_rotary_positions,
)
from workers.models.weights import CheckpointWeights, check_state, load_vision_state

# The reference's RMSNorms in the tower and the merger, fixed in code, not in the config.
NORM_EPS = 1e-6


def window_index(
    grid_thw: torch.Tensor, merge: int, window_size: int, patch_size: int
) -> tuple[torch.Tensor, list[int]]:
    """The merged tokens in window order, and each window's length in patches.

    Per item and frame, the (h/merge, w/merge) grid of merged tokens is cut into windows of
    ``window_size / merge / patch_size`` tokens a side, the last row and column of windows short where the grid
    is not a multiple; windows are walked row by row, and tokens row by row inside each (transformers'
    ``get_vision_window_index``). Indices count merged tokens over all items."""
    side = window_size // merge // patch_size
    order, lengths, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        tokens = torch.arange(t * gh * gw).view(t, gh, gw)
        rows, cols = -(-gh // side), -(-gw // side)
        for frame in range(t):
            for r in range(rows):
                for c in range(cols):
                    window = tokens[frame, r * side : (r + 1) * side, c * side : (c + 1) * side].flatten()
                    order.append(window + offset)
                    lengths.append(window.numel() * merge * merge)
        offset += t * gh * gw
    return torch.cat(order), lengths


class GatedMlp(nn.Module):
    """down(silu(gate(x)) * up(x)), with biases (the tower's; the text model's has none)."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        if spec.hidden_act != "silu":
            raise ValueError(f"unsupported Qwen2.5-VL vision hidden_act {spec.hidden_act!r}; expected 'silu'")
        self.gate_proj = nn.Linear(spec.embed_dim, spec.mlp_hidden_dim, bias=True)
        self.up_proj = nn.Linear(spec.embed_dim, spec.mlp_hidden_dim, bias=True)
        self.down_proj = nn.Linear(spec.mlp_hidden_dim, spec.embed_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class WindowBlock(nn.Module):
    """``x + attn(norm1(x))``, then ``+ mlp(norm2(x))``; which rows attend together is the caller's ``attend``."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.norm1 = RMSNorm(spec.embed_dim, NORM_EPS)
        self.norm2 = RMSNorm(spec.embed_dim, NORM_EPS)
        self.attn = VisionAttention(spec)
        self.mlp = GatedMlp(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: FrameAttention) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, attend)
        return x + self.mlp(self.norm2(x))


class RmsPatchMerger(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.merged_dim = spec.merged_dim
        self.ln_q = RMSNorm(spec.embed_dim, NORM_EPS)
        # Sequential only to keep the checkpoint's `mlp.0` / `mlp.2` key names.
        self.mlp = nn.Sequential(
            nn.Linear(spec.merged_dim, spec.merged_dim),
            nn.GELU(),
            nn.Linear(spec.merged_dim, spec.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))


class WindowVisionTower(nn.Module):
    """Qwen2.5-VL's vision encoder: pixel patches -> one embedding per merged ``merge x merge`` window, called
    like `workers.models.vision.VisionTower`."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        if not spec.windowed:
            raise ValueError("the Qwen2.5-VL vision tower needs a window_size")
        self.spec = spec
        self.patch_embed = PatchEmbed(spec)
        self.blocks = nn.ModuleList([WindowBlock(spec) for _ in range(spec.depth)])
        self.merger = RmsPatchMerger(spec)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path | CheckpointWeights,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        spec: ModelSpec | None = None,
    ) -> WindowVisionTower:
        """Build the tower and load ``visual.*`` from a checkpoint directory (dtype defaults to the file's)."""
        root = path.path if isinstance(path, CheckpointWeights) else Path(path)
        spec = spec or ModelSpec.from_dir(root)
        with torch.device("meta"):
            tower = cls(spec.vision)
        tower.load_state(load_vision_state(path, device, dtype or spec.dtype))
        return tower.eval()

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        check_state(self, state, "vision tower")
        self.load_state_dict(dict(state), strict=True, assign=True)

    def tune_attention(self) -> dict[str, float]:
        return {}  # SDPA's own choice: the CUDA path of window attention is a later step

    def warm_up(self) -> None:
        """No Triton kernels or graphs of its own to prepare yet."""

    @property
    def device(self) -> torch.device:
        return self.merger.ln_q.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.merger.ln_q.weight.dtype

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [num_patches, patch_dim], grid_thw [num_items, 3] -> [num_patches // merge**2, out_hidden]."""
        spec = self.spec
        from workers.models.vision import VisionTower  # (its input checks are the same)

        grid = VisionTower._validate(self, pixel_values, grid_thw)  # type: ignore[arg-type]
        unit = spec.spatial_merge_size**2
        order, lengths = window_index(grid, spec.spatial_merge_size, spec.window_size, spec.patch_size)
        rows = upload((order[:, None] * unit + torch.arange(unit)).flatten(), self.device)
        positions = upload(vision_rotary_positions(grid, spec.spatial_merge_size), self.device)
        cos, sin = vision_rotary_cos_sin(positions, spec.head_dim, spec.rope_theta)
        x = self.patch_embed(upload(pixel_values, self.device))[rows]
        cos, sin = cos[rows], sin[rows]
        # A window's rows are consecutive now, and so are a frame's (windows never cross frames): each is a
        # segment of its own, as `SegmentFrames` takes them (a "frame" of 1 x length).
        windows = SegmentFrames(torch.tensor([[1, 1, length] for length in lengths]))
        frames = SegmentFrames(grid)
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if index in spec.fullatt_block_indexes else windows)
        merged = self.merger(x)
        return merged[upload(torch.argsort(order), self.device)]


FAMILY = Family(
    model_type="qwen2_5_vl",
    read_spec=ModelSpec.from_config,
    vision_tower=WindowVisionTower.from_checkpoint,
    language_model=LanguageModel.from_checkpoint,
    rope_positions=rope_positions,
    synth=TABLES,
    tensor_parallel=True,
)
