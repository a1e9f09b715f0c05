"""The wiring of Qwen2.5-VL's CUDA path, checked on the CPU (fp32, the generator's tiny checkpoint): the fused
blocks (residual adds into the RMSNorms, gate and up as one GEMM) give the reference path's output, the fused
gate/up weight is what the two projections' parameters are views of, and the variable-length attention's
boundaries are the windows' and the frames'. The kernels themselves run on CUDA (tests/gpu/)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.models import synth
from workers.models.frame_attention import VarlenSegments, varlen_runs
from workers.models.qwen2_5_vl import WindowVisionTower, window_index
from workers.models.registry import checkpoint_family

# Images whose merged grids leave windows short at the right and bottom edges, side by side with a video.
GRIDS = [[1, 10, 14], [2, 6, 8], [1, 4, 4], [1, 10, 14]]


@pytest.fixture(scope="module")
def tower(tmp_path_factory: pytest.TempPathFactory) -> WindowVisionTower:
    path = synth.generate_checkpoint(tmp_path_factory.mktemp("q25f") / "tiny", "tiny", 0, family="qwen2_5_vl")
    vision = checkpoint_family(Path(path)).vision_tower(path, dtype=torch.float32)
    assert isinstance(vision, WindowVisionTower)
    return vision


def pixels_for(tower: WindowVisionTower, grid: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(int(grid.prod(dim=1).sum()), tower.spec.patch_dim, generator=generator)


def test_grids_leave_short_edge_windows(tower: WindowVisionTower) -> None:
    spec = tower.spec
    _, lengths = window_index(torch.tensor(GRIDS), spec.spatial_merge_size, spec.window_size, spec.patch_size)
    full = (spec.window_size // spec.patch_size) ** 2
    assert max(lengths) == full and min(lengths) < full  # windows of several lengths, as the fast path must take


def test_fused_blocks_give_the_reference_paths_output(tower: WindowVisionTower) -> None:
    grid = torch.tensor(GRIDS)
    pixels = pixels_for(tower, grid)
    reference = tower.encode(pixels, grid, fused=False)
    fused = tower.encode(pixels, grid, fused=True)
    assert torch.equal(tower(pixels, grid), reference)  # the CPU's forward is the reference path
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)


def test_fused_path_is_not_blind_to_a_changed_weight(tower: WindowVisionTower) -> None:
    """The fused GEMM reads the projections' own parameters (views of it), not a stale copy."""
    grid = torch.tensor(GRIDS[:1])
    pixels = pixels_for(tower, grid)
    before = tower.encode(pixels, grid, fused=True)
    mlp = tower.blocks[0].mlp
    with torch.no_grad():
        mlp.up_proj.bias.add_(0.5)
    try:
        after = tower.encode(pixels, grid, fused=True)
        torch.testing.assert_close(after, tower.encode(pixels, grid, fused=False), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(after, before)
    finally:
        with torch.no_grad():
            mlp.up_proj.bias.sub_(0.5)


def test_gate_and_up_parameters_are_views_of_the_fused_weight(tower: WindowVisionTower) -> None:
    mlp = tower.blocks[-1].mlp
    weight, bias = mlp.gate_up()
    rows = mlp.gate_proj.weight.shape[0]
    assert weight.shape == (2 * rows, tower.spec.embed_dim) and bias.shape == (2 * rows,)
    assert mlp.gate_proj.weight.data_ptr() == weight.data_ptr()
    assert mlp.up_proj.weight.data_ptr() == weight[rows:].data_ptr()
    assert mlp.up_proj.bias.data_ptr() == bias[rows:].data_ptr()
    assert mlp.gate_up()[0] is weight  # made once
    state = {k: v.clone() for k, v in tower.state_dict().items()}
    assert set(state) == {k for k, _ in tower.named_parameters()}  # no key of its own in the checkpoint's names
    tower.load_state(state)  # new tensors: the fused weight is made again from them
    assert mlp.gate_up()[0] is not weight and mlp.gate_proj.weight.data_ptr() == mlp.gate_up()[0].data_ptr()


def test_window_and_frame_boundaries(tower: WindowVisionTower) -> None:
    spec = tower.spec
    grid = torch.tensor(GRIDS)
    _, lengths = window_index(grid, spec.spatial_merge_size, spec.window_size, spec.patch_size)
    windows = VarlenSegments.of(lengths, torch.device("cpu"))
    assert windows.cu_seqlens.dtype == torch.int32 and windows.longest == max(lengths)
    assert windows.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    frames = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]).cumsum(0).tolist()
    assert set(frames) <= set(windows.cu_seqlens.tolist())  # windows never cross frames
    with pytest.raises(ValueError, match="segments"):
        VarlenSegments.of([], torch.device("cpu"))
    assert not varlen_runs(torch.bfloat16, torch.device("cpu"))
