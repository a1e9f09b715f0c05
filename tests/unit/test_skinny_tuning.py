"""Which decode projections `decode_linear` sends through the skinny kernel: those whose weight shape won a
`benchmarks.decode_gemms --triton` sweep against cuBLAS by a clear margin; every other call is F.linear."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from workers.kernels import skinny_gemm
from workers.kernels.skinny_gemm import SkinnyTiles, decode_linear, load_tuned


def row(library: str, n: int, k: int, us: float, **tiles: int) -> dict:
    out = {"library": library, "model": "2b", "projection": "p", "batch": 32, "k": k, "n": n, "us": us}
    return out | ({"tiles": SkinnyTiles(**tiles).__dict__} if tiles else {})


def test_load_tuned_keeps_the_fastest_tiles_that_beat_cublas_clearly(tmp_path: Path) -> None:
    rows = [
        row("cublas", 2048, 1536, 5.9),
        row("triton-skinny", 2048, 1536, 3.1, block_n=16, split_k=4),
        row("triton-skinny", 2048, 1536, 2.5, block_n=32, split_k=8),  # the fastest: kept
        row("cublas", 17920, 1536, 18.0),
        row("triton-skinny", 17920, 1536, 17.0, block_n=64),  # 6% faster: under the 10% margin
        row("triton-skinny", 1536, 8960, 7.0, block_n=32),  # no cuBLAS row at this shape: not trusted
    ]
    path = tmp_path / "gemms.json"
    path.write_text(json.dumps({"device": "test", "rows": rows}))
    assert load_tuned(path) == {(2048, 1536): SkinnyTiles(block_n=32, split_k=8)}
    assert load_tuned(path, min_gain=1.0) == {
        (2048, 1536): SkinnyTiles(block_n=32, split_k=8),
        (17920, 1536): SkinnyTiles(block_n=64),
    }


def test_decode_linear_is_f_linear_off_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tuned tiles apply to CUDA tensors only; the CPU (and a shape with no tiles) keeps F.linear, bit for bit."""
    monkeypatch.setattr(skinny_gemm, "TUNED_TILES", {(6, 8): SkinnyTiles(block_n=16, block_k=32, split_k=2)})
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(4, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(6, generator=g)
    assert torch.equal(decode_linear(x, w, b), F.linear(x, w, b))
