"""The encoder's vision backends: config, the cached ONNX export, the TensorRT engine key (TensorRT
itself cannot be installed here, see `workers/encoder/tensorrt_backend.py`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from common.config import Config, load_config
from workers.encoder.backends import exported_onnx, load_vision_backend
from workers.encoder.tensorrt_backend import engine_key, patch_profile
from workers.models.synth import generate_checkpoint
from workers.models.vision import VisionTower

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None
NO_TENSORRT = (
    "tensorrt cannot be installed on these machines (NVIDIA's wheels need a CUDA host and are not on the "
    "reachable index): the backend is written against TensorRT 10's documented API and has never run"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_checkpoint(tmp_path_factory.mktemp("backends") / "tiny", "tiny", seed=9)


def config(checkpoint: Path, tmp_path: Path, backend: str) -> Config:
    cfg = Config()
    cfg.model.path, cfg.run_dir, cfg.encoder.backend = str(checkpoint), str(tmp_path), backend
    return cfg


def test_onnxruntime_backend_matches_the_torch_tower_and_exports_once(checkpoint: Path, tmp_path: Path) -> None:
    tower = load_vision_backend(config(checkpoint, tmp_path, "torch"), torch.device("cpu"), torch.float32)
    onnx = load_vision_backend(config(checkpoint, tmp_path, "onnxruntime"), torch.device("cpu"), torch.float32)
    assert isinstance(tower, VisionTower) and onnx.spec == tower.spec
    grid = torch.tensor([[1, 4, 6], [2, 2, 4]])
    pixels = torch.randn(int(grid.prod(dim=1).sum()), tower.spec.patch_dim, generator=torch.Generator().manual_seed(0))
    expected = tower(pixels, grid)
    assert (onnx(pixels, grid) - expected).abs().max() <= 1e-5 * expected.abs().max()
    exports = list((tmp_path / "engines").glob("vision-*/model.onnx"))
    assert len(exports) == 1 and not list((tmp_path / "engines").glob(".vision-*"))  # no staging left behind
    before = exports[0].stat().st_mtime_ns
    assert exported_onnx(checkpoint, tmp_path / "engines") == exports[0]
    assert exports[0].stat().st_mtime_ns == before  # cached: not exported again


def test_unknown_backend_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "vlm.toml"
    path.write_text('[encoder]\nbackend = "openvino"\n')
    with pytest.raises(ValueError, match="backend: expected 'torch', 'onnxruntime' or 'tensorrt'"):
        load_config(path, env={})


def test_engine_key_changes_with_what_changes_the_engine(tmp_path: Path) -> None:
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"graph v1")
    key = engine_key(onnx, "10.9.0", "NVIDIA H200", "bf16", (4, 1600, 16384))
    assert key == engine_key(onnx, "10.9.0", "NVIDIA H200", "bf16", (4, 1600, 16384))
    others = [
        engine_key(onnx, "10.10.0", "NVIDIA H200", "bf16", (4, 1600, 16384)),
        engine_key(onnx, "10.9.0", "NVIDIA H100", "bf16", (4, 1600, 16384)),
        engine_key(onnx, "10.9.0", "NVIDIA H200", "fp16", (4, 1600, 16384)),
        engine_key(onnx, "10.9.0", "NVIDIA H200", "bf16", (4, 1600, 32768)),
    ]
    onnx.write_bytes(b"graph v2")
    others.append(engine_key(onnx, "10.9.0", "NVIDIA H200", "bf16", (4, 1600, 16384)))
    assert key not in others and len(set(others)) == len(others)


def test_patch_profile_spans_one_window_to_the_batch_budget(checkpoint: Path) -> None:
    spec = VisionTower.from_checkpoint(checkpoint, dtype=torch.float32).spec
    assert patch_profile(spec, 16384) == (4, 1600, 16384)
    assert patch_profile(spec, 100) == (4, 100, 100)


@pytest.mark.skipif(not HAS_TENSORRT or not torch.cuda.is_available(), reason=NO_TENSORRT)
def test_tensorrt_backend_matches_the_torch_tower(checkpoint: Path, tmp_path: Path) -> None:
    cuda = torch.device("cuda")
    tower = load_vision_backend(config(checkpoint, tmp_path, "torch"), cuda, torch.float32)
    engine = load_vision_backend(config(checkpoint, tmp_path, "tensorrt"), cuda, torch.float32)
    grid = torch.tensor([[1, 4, 6], [2, 2, 4]])
    pixels = torch.randn(int(grid.prod(dim=1).sum()), tower.spec.patch_dim, device=cuda)
    expected = tower(pixels, grid).float()
    assert (engine(pixels, grid) - expected).abs().max() <= 2e-2 * expected.abs().max()  # bf16 inside
