"""The ONNX vision backend against the torch `VisionTower` it was exported from (fp32, onnxruntime on CPU).

Tolerance: max |onnx - torch| <= REL_TOL * max |torch| over the whole output. Measured worst 1.1e-6 relative
(~1.4e-5 absolute on outputs of magnitude ~13) over seeds 0-3 and grids of 4 to 1024 patches: the two differ
only in summation order (one masked attention over all rows vs one SDPA call per item, Gemm vs Linear).
REL_TOL leaves a 10x margin; a wrong mask, rotary table or patch order gives errors of order 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from workers.encoder.onnx_backend import DEFAULT_EXAMPLE_GRID, OnnxVisionEncoder, export_vision_onnx
from workers.models.synth import generate_checkpoint
from workers.models.vision import VisionTower

REL_TOL = 1e-5
EXAMPLE_PATCHES = sum(t * h * w for t, h, w in DEFAULT_EXAMPLE_GRID)


@pytest.fixture(scope="module")
def tower(tmp_path_factory: pytest.TempPathFactory) -> VisionTower:
    path = generate_checkpoint(tmp_path_factory.mktemp("onnx") / "tiny", "tiny", seed=7)
    return VisionTower.from_checkpoint(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def onnx_path(tower: VisionTower, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_vision_onnx(tower, tmp_path_factory.mktemp("onnx") / "vision.onnx")


@pytest.fixture(scope="module")
def encoder(onnx_path: Path) -> OnnxVisionEncoder:
    return OnnxVisionEncoder(onnx_path, providers=["CPUExecutionProvider"])


def _assert_matches(tower: VisionTower, encoder: OnnxVisionEncoder, grids: list[list[int]]) -> None:
    grid_thw = torch.tensor(grids)
    patches = int(grid_thw.prod(dim=1).sum())
    pixel_values = torch.randn(patches, tower.spec.patch_dim, generator=torch.Generator().manual_seed(patches))
    expected = tower(pixel_values, grid_thw)
    got = encoder(pixel_values, grid_thw)
    assert got.shape == expected.shape == (patches // tower.spec.spatial_merge_size**2, tower.spec.out_hidden_size)
    assert got.dtype == torch.float32
    error = (got - expected).abs().max().item()
    assert error <= REL_TOL * expected.abs().max().item(), f"max abs error {error:.3g}"


@pytest.mark.parametrize(
    "grids",
    [
        pytest.param([[1, 4, 4]], id="one-image"),
        # Different grids and a video-like item (t=2: two frames that must not attend to each other).
        pytest.param([[1, 4, 4], [1, 6, 8], [2, 4, 4]], id="mixed-grids"),
        # Patch counts other than the export example's: the patch axis is dynamic, not traced in.
        pytest.param([[1, 2, 2]], id="smallest"),
        pytest.param([[3, 10, 12], [1, 2, 2], [1, 16, 8]], id="larger"),
    ],
)
def test_onnx_matches_torch_tower(tower: VisionTower, encoder: OnnxVisionEncoder, grids: list[list[int]]) -> None:
    _assert_matches(tower, encoder, grids)


def test_patch_axis_is_dynamic(tower: VisionTower, encoder: OnnxVisionEncoder) -> None:
    # A symbolic first dim on every input, and a patch count the exporter never saw still matches.
    assert all(isinstance(node.shape[0], str) for node in encoder.session.get_inputs())
    grids = [[1, 6, 6], [2, 2, 4]]
    assert sum(t * h * w for t, h, w in grids) != EXAMPLE_PATCHES
    _assert_matches(tower, encoder, grids)


def test_spec_comes_from_the_file(tower: VisionTower, onnx_path: Path, encoder: OnnxVisionEncoder) -> None:
    assert encoder.spec == tower.spec
    with pytest.raises(ValueError, match="exported for"):
        OnnxVisionEncoder(onnx_path, spec=type(tower.spec)(**{**vars(tower.spec), "depth": 3}))


def test_rejects_inconsistent_inputs(encoder: OnnxVisionEncoder) -> None:
    with pytest.raises(ValueError, match="covers 16 patches"):
        encoder(torch.zeros(20, encoder.spec.patch_dim), torch.tensor([[1, 4, 4]]))


def test_missing_onnxruntime_says_what_to_install(onnx_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # makes `import onnxruntime` raise ImportError
    with pytest.raises(RuntimeError, match="pip install onnxruntime"):
        OnnxVisionEncoder(onnx_path)
