"""The ONNX vision backend against the torch tower it was exported from (fp32, onnxruntime on CPU): Qwen2-VL's
`VisionTower`, Qwen2.5-VL's windowed tower and Qwen3-VL's with its DeepStack sets.

Tolerance: max |onnx - torch| <= REL_TOL * max |torch| over the whole output. Measured worst 1.1e-6 relative
(~1.4e-5 absolute on outputs of magnitude ~13) over seeds 0-3 and grids of 4 to 1024 patches: the two differ
only in summation order (one masked attention over all rows vs one SDPA call per item, Gemm vs Linear).
REL_TOL leaves a 10x margin; a wrong mask, rotary table or patch order gives errors of order 1.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from workers.encoder.onnx_backend import DEFAULT_EXAMPLE_GRID, OnnxVisionEncoder, export_vision_onnx
from workers.models.qwen2_5_vl import window_index
from workers.models.registry import checkpoint_family, read_spec
from workers.models.spec import VisionSpec
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


# --- the newer towers: Qwen2.5-VL's windowed one, Qwen3-VL's with DeepStack sets ----------------------------------

# One image, one large enough for several windows a frame, a video (t > 1: frames attend only to themselves), and
# a batch of two items of different sizes, one of them a video.
FAMILY_GRIDS = [
    pytest.param([[1, 4, 4]], id="small-image"),
    pytest.param([[1, 16, 20]], id="large-image"),
    pytest.param([[4, 8, 12]], id="video"),
    pytest.param([[1, 8, 12], [2, 4, 6]], id="two-items"),
]


@dataclass
class FamilyExport:
    family: str
    tower: nn.Module
    spec: VisionSpec
    encoder: OnnxVisionEncoder


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def family_export(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> FamilyExport:
    family: str = request.param
    path = generate_checkpoint(tmp_path_factory.mktemp(family) / "tiny", "tiny", seed=7, family=family)
    tower = checkpoint_family(path).vision_tower(path, dtype=torch.float32)  # as the torch backend serves it
    spec = read_spec(path).vision
    onnx_path = export_vision_onnx(tower, tmp_path_factory.mktemp(family) / "vision.onnx", spec=spec)
    return FamilyExport(family, tower, spec, OnnxVisionEncoder(onnx_path, spec, providers=["CPUExecutionProvider"]))


@pytest.mark.parametrize("grids", FAMILY_GRIDS)
def test_newer_towers_onnx_matches_the_torch_tower(family_export: FamilyExport, grids: list[list[int]]) -> None:
    """The onnxruntime output equals the torch tower's, packed as the cache takes it: Qwen2.5-VL's merged rows in
    the processor's order (the window reordering undone), Qwen3-VL's [1 + K, rows, out] with every DeepStack set."""
    spec, grid_thw = family_export.spec, torch.tensor(grids)
    patches = int(grid_thw.prod(dim=1).sum())
    pixel_values = torch.randn(patches, spec.patch_dim, generator=torch.Generator().manual_seed(patches))
    expected = family_export.tower(pixel_values, grid_thw)
    got = family_export.encoder(pixel_values, grid_thw)
    rows = (patches // spec.spatial_merge_size**2, spec.out_hidden_size)
    sets = 1 + len(spec.deepstack_visual_indexes)
    assert got.shape == expected.shape == (rows if family_export.family == "qwen2_5_vl" else (sets, *rows))
    assert got.dtype == torch.float32
    for got_set, expected_set in zip(got.view(-1, *rows), expected.view(-1, *rows), strict=True):
        error = (got_set - expected_set).abs().max().item()
        assert error <= REL_TOL * expected_set.abs().max().item(), f"max abs error {error:.3g}"


def test_the_window_index_is_an_input_and_the_grids_cut_into_several_windows(family_export: FamilyExport) -> None:
    """Qwen2.5-VL's window order comes from the host (a grid the export never saw reorders as its own), and the
    test grids have windows smaller than a frame, so a wrong window mask or order could not pass unseen."""
    if family_export.family != "qwen2_5_vl":
        pytest.skip("Qwen3-VL's tower has no windows")
    spec = family_export.spec
    names = [node.name for node in family_export.encoder.session.get_inputs()]
    assert {"window_rows", "restore_rows", "window_ids"} <= set(names)
    _, lengths = window_index(torch.tensor([[1, 16, 20]]), spec.spatial_merge_size, spec.window_size, spec.patch_size)
    assert len(lengths) > 1


def test_qwen3_vl_export_takes_the_position_taps_and_stores_the_served_spec(family_export: FamilyExport) -> None:
    if family_export.family != "qwen3_vl":
        pytest.skip("Qwen2.5-VL's tower has no learned position table")
    encoder = family_export.encoder
    names = [node.name for node in encoder.session.get_inputs()]
    assert {"position_taps", "position_weights"} <= set(names)
    assert all(isinstance(node.shape[0], str) for node in encoder.session.get_inputs())  # the patch axis is dynamic
    assert encoder.spec == family_export.spec and encoder.spec.deepstack_visual_indexes == (0, 1)


def test_export_of_a_tower_without_a_vision_spec_asks_for_one(family_export: FamilyExport, tmp_path: Path) -> None:
    if family_export.family != "qwen3_vl":
        pytest.skip("Qwen2.5-VL's tower carries the served VisionSpec")
    with pytest.raises(TypeError, match="pass spec="):
        export_vision_onnx(family_export.tower, tmp_path / "vision.onnx")
