"""The new families' vision towers on CUDA in bf16 against the same tower in fp32 on the CPU: Qwen2.5-VL's (window
attention, full attention in `fullatt_block_indexes`) and Qwen3-VL's (learned positions, every DeepStack set).

The bound is test_vision_gpu.py's for Qwen2-VL, measured rather than guessed: against the fp32 output, ours in
bf16 may be off by at most 1.25x what transformers' own tower in bf16 on the same GPU is off by. The towers have
the 7B/8B checkpoints' widths (Qwen2.5-VL-7B: 1280 wide, 16 heads, MLP 3420, window 112; Qwen3-VL-8B: 1152 wide,
16 heads, MLP 4304) with 4 blocks instead of 32/27, transformers' random initialisation, the same (bf16-valued)
weights in all three; images of a 720p-like and a small grid, each alone and both in one batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.gpu.test_kernels_gpu import _SKIP_REASON

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")]
CUDA = torch.device("cuda")
BOUND = 1.25  # test_vision_gpu.py's

QWEN2_5_VISION = {
    "depth": 4,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "out_hidden_size": 3584,
    "window_size": 112,
    "fullatt_block_indexes": [1, 3],  # windowed blocks before and after each full one
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "in_channels": 3,
    "hidden_act": "silu",
}
QWEN3_VISION = {
    "depth": 4,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "out_hidden_size": 4096,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [0, 2],  # two sets, as the real ones have three of 27
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "in_channels": 3,
    "hidden_act": "gelu_pytorch_tanh",
}
# (a 720p-like image, a small one (windows cut short at its edges), both in one batch) per patch size
GRIDS = {
    14: [[[1, 52, 92]], [[1, 16, 22]], [[1, 52, 92], [1, 16, 22]]],
    16: [[[1, 46, 80]], [[1, 16, 22]], [[1, 46, 80], [1, 16, 22]]],
}
GRID_IDS = ["720p", "small", "batch"]


def relative_error(got: torch.Tensor, truth: torch.Tensor) -> float:
    return float((got.detach().float().cpu() - truth).norm() / truth.norm())


def _state(reference: torch.nn.Module, ours: torch.nn.Module) -> dict[str, torch.Tensor]:
    """transformers' tensors under our tower's names (the same names; buffers of its own left out)."""
    wanted = set(ours.state_dict())
    return {k: v.detach().clone() for k, v in reference.state_dict().items() if k in wanted}


def _load(ours: torch.nn.Module, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> Any:
    ours.load_state({k: v.to(device, dtype) for k, v in state.items()})
    return ours.eval()


def _outputs(out: Any) -> list[torch.Tensor]:
    """[merged, *DeepStack sets] of either side's output (ours: a tensor or VisionFeatures; transformers': a
    BaseModelOutputWithPooling, or the (merged, deepstack) tuple of older releases)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, tuple):
        return [out[0], *(out[1] if len(out) > 1 and out[1] is not None else [])]
    if hasattr(out, "merged"):
        return [out.merged, *out.deepstack]
    return [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]


@pytest.fixture(scope="module")
def qwen2_5_towers() -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """Ours in bf16 on CUDA, ours in fp32 on the CPU, transformers' in bf16 on CUDA."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from workers.models.qwen2_5_vl import WindowVisionTower
    from workers.models.spec import VisionSpec

    config = Qwen2_5_VLVisionConfig(**QWEN2_5_VISION)
    torch.manual_seed(0)
    reference = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=torch.bfloat16)
    spec = VisionSpec.from_config(config.to_dict(), "qwen2_5_vl")
    assert spec.windowed and spec.fullatt_block_indexes == (1, 3)
    with torch.device("meta"):
        ours, ours32 = WindowVisionTower(spec), WindowVisionTower(spec)
    state = _state(reference, ours)
    return (
        _load(ours, state, CUDA, torch.bfloat16),
        _load(ours32, state, torch.device("cpu"), torch.float32),
        reference.to(CUDA).eval(),
    )


@pytest.fixture(scope="module")
def qwen3_towers() -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """Ours in bf16 on CUDA, ours in fp32 on the CPU, transformers' in bf16 on CUDA."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    from workers.models.qwen3_vl_spec import Qwen3VisionSpec
    from workers.models.qwen3_vl_vision import Qwen3VisionTower

    config = Qwen3VLVisionConfig(**QWEN3_VISION)
    torch.manual_seed(0)
    reference = Qwen3VLVisionModel._from_config(config, dtype=torch.bfloat16)
    spec = Qwen3VisionSpec.from_config(config.to_dict())
    assert spec.deepstack_visual_indexes == (0, 2)
    with torch.device("meta"):
        ours, ours32 = Qwen3VisionTower(spec), Qwen3VisionTower(spec)
    state = _state(reference, ours)
    return (
        _load(ours, state, CUDA, torch.bfloat16),
        _load(ours32, state, torch.device("cpu"), torch.float32),
        reference.to(CUDA).eval(),
    )


def check_tower(towers: tuple[torch.nn.Module, ...], grids: list[list[int]], patch_dim: int, outputs: int) -> None:
    ours, ours32, reference = towers
    grid = torch.tensor(grids)
    generator = torch.Generator().manual_seed(1)
    pixels = torch.randn(int(grid.prod(dim=1).sum()), patch_dim, generator=generator).bfloat16()
    with torch.inference_mode():
        truth = _outputs(ours32(pixels.float(), grid))
        got = _outputs(ours(pixels.to(CUDA), grid))
        theirs = _outputs(reference(pixels.to(CUDA), grid_thw=grid.to(CUDA)))
    assert len(truth) == len(got) == len(theirs) == outputs  # the merged output and each DeepStack set
    for index, (mine, yard, exact) in enumerate(zip(got, theirs, truth, strict=True)):
        assert mine.shape == exact.shape == yard.shape
        error, yardstick = relative_error(mine, exact), relative_error(yard, exact)
        print(f"output {index}: ours bf16 {error:.3e}, transformers bf16 {yardstick:.3e} (relative to fp32)")
        assert error <= BOUND * yardstick, f"output {index}: {error:.3e} vs transformers' {yardstick:.3e}"


@pytest.mark.parametrize("grids", GRIDS[14], ids=GRID_IDS)
def test_qwen2_5_vl_window_tower_in_bf16_on_cuda(
    qwen2_5_towers: tuple[torch.nn.Module, ...], grids: list[list[int]]
) -> None:
    check_tower(qwen2_5_towers, grids, 3 * 2 * 14 * 14, outputs=1)


@pytest.mark.parametrize("grids", GRIDS[16], ids=GRID_IDS)
def test_qwen3_vl_tower_and_deepstack_sets_in_bf16_on_cuda(
    qwen3_towers: tuple[torch.nn.Module, ...], grids: list[list[int]]
) -> None:
    check_tower(qwen3_towers, grids, 3 * 2 * 16 * 16, outputs=1 + len(QWEN3_VISION["deepstack_visual_indexes"]))


# Qwen2.5-VL's fast path (variable-length FlashAttention, fused norms and MLP) on what stresses its boundaries:
# images of three sizes whose merged grids are no multiple of the window's side (short windows at the right and
# bottom edges), two of one size apart, and a video of three frames, all in one batch.
QWEN2_5_MIXED = [[1, 22, 30], [1, 52, 92], [3, 20, 28], [1, 16, 22], [1, 22, 30]]


def test_qwen2_5_vl_fast_path_on_mixed_images_and_a_video(qwen2_5_towers: tuple[torch.nn.Module, ...]) -> None:
    from workers.models.frame_attention import varlen_runs

    assert varlen_runs(torch.bfloat16, CUDA)  # the variable-length kernel is there: this is the path under test
    qwen2_5_towers[0].warm_up()
    check_tower(qwen2_5_towers, QWEN2_5_MIXED, 3 * 2 * 14 * 14, outputs=1)


@pytest.mark.parametrize("kind", ["windows", "frames"])
def test_varlen_attention_matches_the_masked_reference(kind: str) -> None:
    """One variable-length FlashAttention call over the window (or frame) boundaries of QWEN2_5_MIXED, against the
    block-diagonal reference in fp32 on the same bf16 inputs; attention over the wrong boundaries is far off, so
    the bound tells them apart."""
    from workers.models.frame_attention import VarlenSegments, segment_attention_reference, varlen_attention
    from workers.models.qwen2_5_vl import window_index

    grid = torch.tensor(QWEN2_5_MIXED)
    _, windows = window_index(grid, 2, QWEN2_5_VISION["window_size"], 14)
    frames = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]).tolist()
    lengths, other = (windows, frames) if kind == "windows" else (frames, windows)
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(sum(lengths), 16, 80, generator=generator).to(CUDA, torch.bfloat16) for _ in range(3))
    segments = VarlenSegments.of(lengths, CUDA)
    got = varlen_attention(q, k, v, segments.cu_seqlens, segments.longest)
    truth = segment_attention_reference(q.float(), k.float(), v.float(), segments.cu_seqlens.long())
    wrong = segment_attention_reference(q.float(), k.float(), v.float(), VarlenSegments.of(other, CUDA).cu_seqlens)
    error, off = relative_error(got, truth.cpu()), relative_error(wrong, truth.cpu())
    print(f"{kind}: varlen bf16 {error:.3e}, the other boundaries {off:.3e} (relative to fp32)")
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    assert error < 1e-2 < off
