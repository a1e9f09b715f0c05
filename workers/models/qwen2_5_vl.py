"""Qwen2.5-VL (``model_type: qwen2_5_vl``; transformers' ``qwen2_5_vl`` is the reference).

The language model is Qwen2's, as Qwen2-VL's (`workers.models.language`); M-RoPE is Qwen2-VL's with videos in
absolute time (`workers.models.mrope`, ``vision.tokens_per_second``). The vision tower differs: RMSNorm, a gated
SiLU MLP, and attention within windows of ``window_size`` pixels except in ``fullatt_block_indexes``, where each
frame attends to itself. The patches are reordered so that each window's are consecutive (`window_index`), run
through the blocks and the merger in that order, and the merged rows put back in the processor's order.

On CUDA in bf16/fp16 the tower runs a path of its own (`WindowVisionTower.forward`'s ``fast``): every block's
attention, windowed or full, is one variable-length FlashAttention call over the window (or frame) boundaries;
each residual add is fused with the RMSNorm after it; the MLP's gate and up projections are one GEMM followed by
one silu-and-mul kernel. Elsewhere (the CPU, what the parity tests check) it runs the reference's ops one by one.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels.activation import silu_and_mul
from workers.models.fp8 import Fp8Linear, Fp8Weight, fp8_linear, fuse_weights
from workers.models.fp8_rows import QuantizedRows, Rows, add_and_rms_norm, fp8_weight_of, quantized_linear
from workers.models.frame_attention import FrameAttention, SegmentFrames, VarlenSegments, varlen_runs
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
    warm_up_forward,
)
from workers.models.weights import CheckpointWeights, assign_state, built_and_loaded, checkpoint_root, load_vision_state

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

        # (gate | up) weight and bias, concatenated for the fast path (`fused`), and the parameters' own data
        # pointers when it was made: the parameters are views of it then.
        self._gate_up: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fp8_gate_up: tuple[Fp8Weight, torch.Tensor] | None = None  # the same for FP8 layers (`fp8_gate_up`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def fused(self, x: Rows) -> torch.Tensor:
        """The same with gate and up as one GEMM and silu(gate) * up as one kernel (Triton on CUDA). FP8 layers (the
        checkpoint's, or `[encoder] quantization = "fp8"`'s) fuse their FP8 weights and scales the same way
        (`fuse_weights`: exact, per-row scales where a part does not end on a scale block) and run through
        `workers.models.fp8.fp8_linear`, or take rows the norm quantized for them (`QuantizedRows`, where
        `fused_fp8_weight` is one); a pair of which only one is FP8 runs unfused."""
        if isinstance(x, QuantizedRows):
            fp8_weight, bias = self.fp8_gate_up()
            return self._down(quantized_linear(x, fp8_weight, bias))
        fp8 = isinstance(self.gate_proj, Fp8Linear), isinstance(self.up_proj, Fp8Linear)
        if fp8[0] != fp8[1]:
            return self.forward(x)
        if fp8[0]:
            fp8_weight, bias = self.fp8_gate_up()
            gate_up = fp8_linear(x, fp8_weight, bias)
        else:
            weight, bias = self.gate_up()
            gate_up = F.linear(x, weight, bias)
        return self._down(gate_up)

    def _down(self, gate_up: torch.Tensor) -> torch.Tensor:
        hidden = gate_up.shape[-1] // 2
        return self.down_proj(silu_and_mul(gate_up[..., :hidden], gate_up[..., hidden:]))

    def fused_fp8_weight(self) -> Fp8Weight | None:
        """The (gate | up) FP8 weight `fused` multiplies, None where gate and up are not both FP8."""
        if isinstance(self.gate_proj, Fp8Linear) and isinstance(self.up_proj, Fp8Linear):
            return self.fp8_gate_up()[0]
        return None

    def fp8_gate_up(self) -> tuple[Fp8Weight, torch.Tensor]:
        """`gate_up` for FP8 layers: the fused FP8 weight and the (gate | up) bias, made on first use with the two
        layers' FP8 data pointed at views of it (the scales, a few floats a row, are copied); made again where a
        layer's weight was replaced since."""
        gate, up = self.gate_proj, self.up_proj
        if self._fp8_gate_up is not None:
            fused = self._fp8_gate_up[0].data
            if (
                gate.weight.data_ptr() == fused.data_ptr()
                and up.weight.data_ptr() == fused[gate.out_features :].data_ptr()
            ):
                return self._fp8_gate_up
        with torch.inference_mode(False), torch.no_grad():  # (as in `gate_up`)
            fused_weight = fuse_weights([gate.fp8_weight(), up.fp8_weight()])
            bias = torch.cat([gate.bias, up.bias])
        rows = gate.out_features
        gate.weight = nn.Parameter(fused_weight.data[:rows], requires_grad=False)
        up.weight = nn.Parameter(fused_weight.data[rows:], requires_grad=False)
        self._fp8_gate_up = (fused_weight, bias)
        return self._fp8_gate_up

    def gate_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate | up) weight and bias, concatenated on first use and the two projections' parameters pointed at
        views of them, so the memory does not grow; made again if a parameter was replaced since (a new load, a
        move to another device)."""
        gate, up = self.gate_proj, self.up_proj
        if self._gate_up is not None:
            weight, bias = self._gate_up
            views = (gate.weight, up.weight, gate.bias, up.bias)
            wholes = (weight, weight[gate.weight.shape[0] :], bias, bias[gate.bias.shape[0] :])
            if all(p.data_ptr() == w.data_ptr() and p.device == w.device for p, w in zip(views, wholes, strict=True)):
                return self._gate_up
        # Outside inference mode (the forward's): parameters made of inference tensors could not be used by a
        # later forward that is not in it.
        with torch.inference_mode(False), torch.no_grad():
            weight = torch.cat([gate.weight, up.weight])
            bias = torch.cat([gate.bias, up.bias])
        rows = gate.weight.shape[0]
        gate.weight = nn.Parameter(weight[:rows], requires_grad=False)
        up.weight = nn.Parameter(weight[rows:], requires_grad=False)
        gate.bias = nn.Parameter(bias[:rows], requires_grad=False)
        up.bias = nn.Parameter(bias[rows:], requires_grad=False)
        self._gate_up = (weight, bias)
        return self._gate_up


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

    def fused(
        self,
        x: torch.Tensor,
        normed: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: FrameAttention,
        next_norm: RMSNorm,
        next_linear: nn.Module | None = None,
    ) -> tuple[torch.Tensor, Rows]:
        """(x, norm1(x)) -> (the block's output, next_norm of it): each residual add fused with the RMSNorm after
        it (as `workers.models.vision.VisionBlock` does with its LayerNorms), the MLP's gate and up as one GEMM.
        ``next_linear``: what next_norm feeds (the next block's ``qkv``), None where its rows go elsewhere."""
        update = self.attn(normed, cos, sin, attend)
        x, normed = add_and_rms_norm(update, x, self.norm2, self.mlp.fused_fp8_weight())
        return add_and_rms_norm(self.mlp.fused(normed), x, next_norm, fp8_weight_of(next_linear))


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
        spec = spec or ModelSpec.from_dir(checkpoint_root(path))
        vision = spec.vision
        return built_and_loaded(lambda: cls(vision), load_vision_state(path, device, dtype or spec.dtype))

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        assign_state(self, state, "vision tower")

    def tune_attention(self) -> dict[str, float]:
        return {}  # nothing to choose: variable-length FlashAttention on CUDA (`varlen_runs`), SDPA elsewhere

    def warm_up(self) -> None:
        """On CUDA, one forward over two frames of different sizes, both cut into windows short at their edges, so
        that the first request does not pay for compiling the Triton kernels (norms, rotary, silu-and-mul),
        cuBLAS's set-up and the allocator's growth. A no-op elsewhere."""
        warm_up_forward(self, [(16, 11), (10, 14)])

    @property
    def device(self) -> torch.device:
        return self.merger.ln_q.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.merger.ln_q.weight.dtype

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [num_patches, patch_dim], grid_thw [num_items, 3] -> [num_patches // merge**2, out_hidden]."""
        return self.encode(pixel_values, grid_thw, fused=self.device.type == "cuda")

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, fused: bool) -> torch.Tensor:
        """The forward, through the fused blocks (`_fused_blocks`: CUDA's path, whose kernels fall back to the
        reference's ops elsewhere) or the reference's op by op (`_blocks`: the CPU's)."""
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
        blocks = self._fused_blocks if fused else self._blocks
        merged = blocks(x, cos, sin, grid, lengths)
        return merged[upload(torch.argsort(order), self.device)]

    def _blocks(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, grid: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        """The blocks and the merger as the reference runs them, op by op (the CPU's path)."""
        spec = self.spec
        # A window's rows are consecutive now, and so are a frame's (windows never cross frames): each is a
        # segment of its own, as `SegmentFrames` takes them (a "frame" of 1 x length).
        windows = SegmentFrames(torch.tensor([[1, 1, length] for length in lengths]))
        frames = SegmentFrames(grid)
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if index in spec.fullatt_block_indexes else windows)
        return self.merger(x)

    def _fused_blocks(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, grid: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        """The blocks and the merger on CUDA: residual adds fused into the RMSNorms, gate and up in one GEMM, and
        (in fp16/bf16) every block's attention one variable-length FlashAttention call. Windows never cross
        frames and a frame's windows are consecutive, so in window order each frame's rows are still one
        segment, at the same place as in the processor's order."""
        spec = self.spec
        if varlen_runs(x.dtype, x.device):
            frame_lengths = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]).tolist()
            windows: FrameAttention = VarlenSegments.of(lengths, x.device)
            frames: FrameAttention = VarlenSegments.of(frame_lengths, x.device)
        else:
            windows = SegmentFrames(torch.tensor([[1, 1, length] for length in lengths]))
            frames = SegmentFrames(grid)
        first = self.blocks[0]
        x, normed = add_and_rms_norm(None, x, first.norm1, fp8_weight_of(first.attn.qkv))
        next_norms = [*(block.norm1 for block in self.blocks[1:]), self.merger.ln_q]
        next_linears = [*(block.attn.qkv for block in self.blocks[1:]), None]
        for index, block in enumerate(self.blocks):
            attend = frames if index in spec.fullatt_block_indexes else windows
            x, normed = block.fused(x, normed, cos, sin, attend, next_norms[index], next_linears[index])
        return self.merger.mlp(normed.view(-1, self.merger.merged_dim))


FAMILY = Family(
    model_type="qwen2_5_vl",
    read_spec=ModelSpec.from_config,
    vision_tower=WindowVisionTower.from_checkpoint,
    language_model=LanguageModel.from_checkpoint,
    rope_positions=rope_positions,
    synth=TABLES,
    tensor_parallel=True,
)
