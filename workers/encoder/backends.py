"""Which engine runs the vision tower in an encoder: ``[encoder] backend``.

- ``torch`` (default): `VisionTower` on the encoder's device, in the model dtype, its linear layers as
  ``[encoder] quantization`` serves them (`workers.models.vision_fp8`).
- ``onnxruntime``: the tower exported to ONNX once (`onnx_backend`), cached under ``engine_dir``, run by
  onnxruntime (CUDA execution provider where the installed build has it, else CPU).
- ``tensorrt``: a TensorRT engine built from that ONNX export, cached on disk (`tensorrt_backend`).

Every backend is called like `VisionTower.forward` and exposes ``spec``, ``device`` and ``dtype``.
Exports are keyed by what changes them (the checkpoint's files, torch, the opset), written to a
temporary directory and renamed into place, so encoders of one host starting together never read a
half-written file: whichever finishes first wins, the others use its copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol

import torch

from common.config import Config
from workers.models.registry import checkpoint_family, read_spec
from workers.models.spec import VisionSpec
from workers.models.vision_fp8 import fp8_linear_names, serve_linears

log = logging.getLogger(__name__)


class VisionBackend(Protocol):
    spec: VisionSpec

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor: ...


def load_vision_backend(cfg: Config, device: torch.device, dtype: torch.dtype) -> VisionBackend:
    if cfg.encoder.backend == "torch":
        tower = load_torch_tower(cfg, device, dtype)
        tower.tune_attention()
        tower.warm_up()
        return tower
    spec = read_spec(cfg.model_path()).vision
    check_backend(cfg, spec)
    onnx_path = exported_onnx(cfg.model_path(), engine_dir(cfg))
    if cfg.encoder.backend == "onnxruntime":
        from workers.encoder.onnx_backend import OnnxVisionEncoder

        return OnnxVisionEncoder(onnx_path, spec)
    from workers.encoder.tensorrt_backend import TensorRTVisionEncoder

    return TensorRTVisionEncoder(onnx_path, engine_dir(cfg), spec, device, max_patches=cfg.encoder.max_batch_patches)


def load_torch_tower(cfg: Config, device: torch.device, dtype: torch.dtype) -> Any:
    """The family's tower as the checkpoint stores it, its linear layers then as ``[encoder] quantization`` serves
    them (`workers.models.vision_fp8`)."""
    tower = checkpoint_family(cfg.model_path()).vision_tower(cfg.model_path(), device=device, dtype=dtype)
    serve_linears(tower, cfg.encoder.quantization, dtype)
    fp8 = fp8_linear_names(tower)
    log.info("vision tower: %d linear layers in FP8 ([encoder] quantization = %r)", len(fp8), cfg.encoder.quantization)
    return tower


def check_backend(cfg: Config, spec: VisionSpec) -> None:
    """ValueError where the configured backend cannot run this tower: onnxruntime runs every family's export;
    the TensorRT engine is built for Qwen2-VL's graph only (its inputs and one output). The launcher's preflight
    asks too, before any worker starts."""
    if cfg.encoder.backend == "tensorrt" and (spec.windowed or spec.num_position_embeddings):
        kind = "windowed Qwen2.5-VL" if spec.windowed else "Qwen3-VL (DeepStack)"
        raise ValueError(
            f"[encoder] backend = 'tensorrt' builds only Qwen2-VL's vision tower, not this checkpoint's {kind} one: "
            "its ONNX export has more inputs (the window index, or the position-table taps) and Qwen3-VL's its "
            "DeepStack sets in the output, which the engine's optimisation profile and bindings do not cover yet; "
            'set [encoder] backend = "onnxruntime" or "torch"'
        )


def engine_dir(cfg: Config) -> Path:
    return Path(cfg.encoder.engine_dir).expanduser() if cfg.encoder.engine_dir else cfg.run_path / "engines"


def checkpoint_fingerprint(model_dir: Path) -> str:
    """What identifies a checkpoint's weights without reading them: each file's name, size and mtime."""
    files = sorted(p for p in model_dir.iterdir() if p.is_file())
    listing = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha256(json.dumps([str(model_dir.resolve()), listing]).encode()).hexdigest()


def exported_onnx(model_dir: Path, cache_dir: Path) -> Path:
    """The vision tower's ONNX export for this checkpoint and toolchain, exporting it first if missing
    (the family's tower is then read on the host in fp32, as the export takes it; a cached export reads nothing)."""
    from workers.encoder.onnx_backend import OPSET, export_vision_onnx

    key = hashlib.sha256(
        json.dumps([checkpoint_fingerprint(model_dir), torch.__version__, OPSET]).encode()
    ).hexdigest()[:16]
    final = cache_dir / f"vision-{key}"
    if not (final / "model.onnx").exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".vision-{key}-", dir=cache_dir))
        try:
            tower = checkpoint_family(model_dir).vision_tower(model_dir, dtype=torch.float32)
            export_vision_onnx(tower, staging / "model.onnx", spec=read_spec(model_dir).vision)
            publish(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final / "model.onnx"


def publish(staging: Path, final: Path) -> None:
    """Rename a finished directory into place; if another process got there first, keep theirs."""
    try:
        os.rename(staging, final)
    except OSError:
        if not (final / "model.onnx").exists():
            raise
