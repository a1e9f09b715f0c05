"""ONNX backend of the vision tower: export `VisionTower` to ONNX, run it with onnxruntime.

An exported graph cannot loop over ``grid_thw``'s Python values, so everything that depends on them is
computed on the host, in torch, with the tower's own functions, and fed to the graph as inputs:

* ``cos``, ``sin`` [N, head_dim]: the 2-D rotary tables (`vision_rotary_positions`, `vision_rotary_cos_sin`);
* ``segment_ids`` [N] int64: which attention segment (frame of an item, from `cu_seqlens_from_grid`) each
  patch row belongs to. The graph turns it into the block-diagonal mask ``ids[:, None] == ids[None, :]``,
  which is exact (masked scores get probability 0) and ships N integers instead of an [N, N] float mask.

N (the patch count) is the one dynamic axis, so any number of images, videos and grids go through one
session call. The graph is fp32 (onnxruntime's CPU kernels have no bf16 for most ops); the output is a CPU
fp32 tensor [N / merge**2, out_hidden], the same contract as `VisionTower.forward` otherwise.

The newer towers take the same route, with the inputs their grids add (`TOWER_INPUTS`):

* Qwen2.5-VL (windowed): the window index too is the host's (`qwen2_5_vl.window_index`, a Python walk over
  each frame's windows that export could only unroll for the example grid). It arrives as ``window_rows`` [N]
  (the patch rows in window order, merge units kept whole), ``restore_rows`` [N] (its inverse) and
  ``window_ids`` [N] (each reordered row's window); cos/sin and ``segment_ids`` come in window order. The graph
  gathers the embedded patches into window order, masks attention by window (by frame in
  ``fullatt_block_indexes``), and restores the processor's order before the merger, which maps each merge unit on
  its own, so restoring before it or after it gives the same rows.
* Qwen3-VL: the learned position table's bilinear taps and weights (``position_taps``, ``position_weights`` [N, 4],
  `qwen3_vl_vision.position_interpolation`) are the host's; the graph gathers the table and sums. Its output is
  [1 + K, N / merge**2, out_hidden], the merged embeddings then each DeepStack set, as the torch tower hands
  them to the cache (one entry).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels.vision import apply_vision_rotary
from workers.models.qwen2_5_vl import window_index
from workers.models.qwen3_vl_vision import position_interpolation
from workers.models.spec import VisionSpec
from workers.models.vision import (
    VisionAttention,
    VisionTower,
    cu_seqlens_from_grid,
    vision_rotary_cos_sin,
    vision_rotary_positions,
)

# Opset 18 is what torch's ONNX function library targets, and onnxruntime >= 1.18 runs it everywhere.
OPSET = 18
INPUT_NAMES = ("pixel_values", "cos", "sin", "segment_ids")  # Qwen2-VL's tower (and the TensorRT engine's)
PLAIN, WINDOWED, DEEPSTACK = "plain", "windowed", "deepstack"
TOWER_INPUTS = {
    PLAIN: INPUT_NAMES,
    WINDOWED: (*INPUT_NAMES, "window_ids", "window_rows", "restore_rows"),
    DEEPSTACK: (*INPUT_NAMES, "position_taps", "position_weights"),
}
OUTPUT_NAME = "embeddings"
# The spec travels inside the .onnx file, so the encoder can validate inputs without the checkpoint.
SPEC_METADATA_KEY = "vlm_serve.vision_spec"
# Two items, one of them video-like (t=2), so the traced graph has several segments and N = 64.
DEFAULT_EXAMPLE_GRID: tuple[tuple[int, int, int], ...] = ((1, 4, 4), (2, 4, 6))


def _require(module: str, install: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise RuntimeError(f"the ONNX vision backend needs {module!r}: pip install {install}") from exc


# --- export -----------------------------------------------------------------------------------------


def _masked_attention(
    attn: VisionAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor
) -> torch.Tensor:
    """`VisionAttention.forward` with a block-diagonal mask in place of its loop over grid_thw.

    The tower's loop runs one SDPA call per item, which export would unroll for the example grid only;
    one masked SDPA over all N rows is the same attention with N dynamic (masked scores get weight 0).
    """
    n = x.shape[0]
    q, k, v = attn.qkv(x).view(n, 3, attn.num_heads, -1).unbind(1)
    q, k = apply_vision_rotary(q, cos, sin), apply_vision_rotary(k, cos, sin)
    # [1, heads, N, head_dim]: the exporter translates only 4-D SDPA.
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=q.shape[-1] ** -0.5)
    return attn.proj(out[0].transpose(0, 1).reshape(n, -1))


class HostInputsVisionTower(nn.Module):
    """The tower's own modules and weights, taking the host-computed inputs instead of grid_thw."""

    def __init__(self, tower: VisionTower) -> None:
        super().__init__()
        self.tower = tower

    def forward(
        self, pixel_values: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segment_ids: torch.Tensor
    ) -> torch.Tensor:
        allowed = segment_ids[:, None] == segment_ids[None, :]
        x = self.tower.patch_embed(pixel_values)
        for block in self.tower.blocks:
            x = _block(block, x, cos, sin, allowed)
        return self.tower.merger(x)


def _block(
    block: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor
) -> torch.Tensor:
    """The residual structure of a pre-norm ViT block (any family's: its norms and MLP are its own modules; unfused,
    as the exporter traces torch ops), only the attention call differs: masked."""
    x = x + _masked_attention(block.attn, block.norm1(x), cos, sin, allowed)
    return x + block.mlp(block.norm2(x))


class WindowedHostInputsTower(nn.Module):
    """Qwen2.5-VL's `WindowVisionTower` with the window index given (see the module's docstring)."""

    def __init__(self, tower: nn.Module) -> None:
        super().__init__()
        self.tower = tower

    def forward(
        self,
        pixel_values: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        segment_ids: torch.Tensor,
        window_ids: torch.Tensor,
        window_rows: torch.Tensor,
        restore_rows: torch.Tensor,
    ) -> torch.Tensor:
        frames = segment_ids[:, None] == segment_ids[None, :]
        windows = window_ids[:, None] == window_ids[None, :]
        x = self.tower.patch_embed(pixel_values).index_select(0, window_rows)
        for index, block in enumerate(self.tower.blocks):
            x = _block(block, x, cos, sin, frames if index in self.tower.spec.fullatt_block_indexes else windows)
        return self.tower.merger(x.index_select(0, restore_rows))


class DeepStackHostInputsTower(nn.Module):
    """Qwen3-VL's tower with its position-table taps given; returns [1 + K, rows, out_hidden] (merged, then each
    DeepStack set)."""

    def __init__(self, tower: nn.Module) -> None:
        super().__init__()
        self.tower = tower

    def forward(
        self,
        pixel_values: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        segment_ids: torch.Tensor,
        position_taps: torch.Tensor,
        position_weights: torch.Tensor,
    ) -> torch.Tensor:
        tower = self.tower
        allowed = segment_ids[:, None] == segment_ids[None, :]
        x = tower.patch_embed(pixel_values)
        x = x + (tower.pos_embed(position_taps) * position_weights[:, :, None]).sum(1)
        indexes = list(tower.spec.deepstack_visual_indexes)
        sets = []
        for index, block in enumerate(tower.blocks):
            x = _block(block, x, cos, sin, allowed)
            if index in indexes:
                sets.append(tower.deepstack_merger_list[indexes.index(index)](x))
        return torch.stack([tower.merger(x), *sets])


def tower_kind(spec: VisionSpec) -> str:
    """Which of the exported graphs a tower of ``spec`` is: Qwen2-VL's, Qwen2.5-VL's windowed, Qwen3-VL's."""
    if spec.windowed:
        return WINDOWED
    return DEEPSTACK if spec.num_position_embeddings else PLAIN


def graph_inputs(spec: VisionSpec, grid_thw: torch.Tensor, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every input of ``spec``'s graph, by name, for a validated CPU int64 grid and its CPU fp32 pixels."""
    cos, sin, segment_ids = host_inputs(spec, grid_thw)
    feeds = {"pixel_values": pixel_values, "cos": cos, "sin": sin, "segment_ids": segment_ids}
    kind = tower_kind(spec)
    merge = spec.spatial_merge_size
    if kind == WINDOWED:
        order, lengths = window_index(grid_thw, merge, spec.window_size, spec.patch_size)
        rows = (order[:, None] * merge**2 + torch.arange(merge**2)).flatten()
        window_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        feeds.update(cos=cos[rows], sin=sin[rows], segment_ids=segment_ids[rows], window_ids=window_ids)
        feeds.update(window_rows=rows, restore_rows=torch.argsort(rows))
    elif kind == DEEPSTACK:
        side = math.isqrt(spec.num_position_embeddings)
        feeds["position_taps"], feeds["position_weights"] = position_interpolation(grid_thw, side, merge)
    return feeds


def host_inputs(spec: VisionSpec, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cos, sin, segment_ids) for a validated CPU int64 grid: everything that depends on its values."""
    positions = vision_rotary_positions(grid_thw, spec.spatial_merge_size)
    cos, sin = vision_rotary_cos_sin(positions, spec.head_dim, spec.rope_theta)
    lengths = cu_seqlens_from_grid(grid_thw).diff()
    segment_ids = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    return cos, sin, segment_ids


def _fp32_cpu(tower: nn.Module) -> nn.Module:
    # Copy only when a conversion is needed: Module.to() works in place and would change the caller's tower.
    if tower.dtype == torch.float32 and tower.device.type == "cpu":
        return tower
    return copy.deepcopy(tower).to(device="cpu", dtype=torch.float32)


def export_vision_onnx(
    tower: nn.Module,
    path: Path,
    *,
    example_grid: Sequence[tuple[int, int, int]] = DEFAULT_EXAMPLE_GRID,
    spec: VisionSpec | None = None,
) -> Path:
    """Write ``tower`` as an fp32 ONNX graph (opset 18) with a dynamic patch count; returns ``path``.

    Inputs (`TOWER_INPUTS`): pixel_values [N, patch_dim] fp32, cos/sin [N, head_dim] fp32, segment_ids [N] int64,
    and the windowed or Qwen3-VL tower's own; output: embeddings [N / merge**2, out_hidden] fp32 (Qwen3-VL's:
    [1 + K, N / merge**2, out_hidden]). ``spec``: the served `VisionSpec` stored in the file (default: the tower's,
    which Qwen3-VL's tower, with a spec class of its own, does not have). ``example_grid`` only shapes the traced
    example; h and w of each row must be multiples of the merge size. Towers over 2 GB get their weights written
    to ``<path>.data`` next to it (onnxruntime finds it there; keep the two files together).
    """
    _require("onnxscript", "onnxscript")  # torch's default (dynamo) exporter translates through it
    _require("onnx", "onnx")
    spec = spec if spec is not None else tower.spec
    if not isinstance(spec, VisionSpec):
        raise TypeError(f"export_vision_onnx needs the served VisionSpec of a {type(tower).__name__}: pass spec=")
    tower = _fp32_cpu(tower)
    grid = torch.tensor(example_grid, dtype=torch.int64)
    kind = tower_kind(spec)
    wrapper = {PLAIN: HostInputsVisionTower, WINDOWED: WindowedHostInputsTower, DEEPSTACK: DeepStackHostInputsTower}
    example = graph_inputs(spec, grid, torch.randn(int(grid.prod(dim=1).sum()), spec.patch_dim))
    patches = torch.export.Dim("patches")
    dynamic = {name: {0: patches} for name in TOWER_INPUTS[kind]}
    # All four inputs share one Dim on purpose; torch warns that it will not rename the shared axis twice.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*axis name: patches will not be used", category=UserWarning)
        program = torch.onnx.export(
            wrapper[kind](tower).eval(),  # type: ignore[arg-type]
            tuple(example[name] for name in TOWER_INPUTS[kind]),
            input_names=list(TOWER_INPUTS[kind]),
            output_names=[OUTPUT_NAME],
            opset_version=OPSET,
            dynamo=True,
            dynamic_shapes=dynamic,
            verbose=False,
        )
    program.model.metadata_props[SPEC_METADATA_KEY] = json.dumps(dataclasses.asdict(spec))
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(path)
    return path


# --- inference --------------------------------------------------------------------------------------


def default_providers(ort: Any) -> list[str]:
    """CUDA when this onnxruntime build has it (onnxruntime-gpu on a GPU host), always CPU as the fallback."""
    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


class OnnxVisionEncoder:
    """Runs an exported vision tower with onnxruntime; called like `VisionTower.forward`.

    ``spec`` defaults to the one stored in the file at export; when given, it must match that one.
    """

    def __init__(self, onnx_path: Path, spec: VisionSpec | None = None, providers: list[str] | None = None) -> None:
        ort = _require("onnxruntime", "onnxruntime (or onnxruntime-gpu for CUDA)")
        self.session = ort.InferenceSession(str(onnx_path), providers=providers or default_providers(ort))
        stored = self.session.get_modelmeta().custom_metadata_map.get(SPEC_METADATA_KEY)
        if stored is None:
            raise ValueError(f"{onnx_path} has no {SPEC_METADATA_KEY!r} metadata: export it with export_vision_onnx")
        embedded = VisionSpec(**json.loads(stored))
        if spec is not None and spec != embedded:
            raise ValueError(f"{onnx_path} was exported for {embedded}, not {spec}")
        self.spec = embedded

    @property
    def providers(self) -> list[str]:
        return self.session.get_providers()

    @property
    def device(self) -> torch.device:
        """Where inputs are read from: onnxruntime is fed host arrays, whatever provider runs them."""
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [num_patches, patch_dim], grid_thw [num_items, 3] -> CPU fp32 [num_patches // merge**2, out]
        (Qwen3-VL's: [1 + K, num_patches // merge**2, out], the merged embeddings then the DeepStack sets)."""
        grid = self._validate(pixel_values, grid_thw)
        pixels = pixel_values.detach().to(device="cpu", dtype=torch.float32)
        feeds = graph_inputs(self.spec, grid, pixels)
        (out,) = self.session.run([OUTPUT_NAME], {name: t.contiguous().numpy() for name, t in feeds.items()})
        return torch.from_numpy(out)

    def _validate(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        # The tower's checks take only `spec` from it, so they are reused on this encoder as is.
        return VisionTower._validate(self, pixel_values, grid_thw)  # type: ignore[arg-type]
