"""Where the vision tower's GPU time goes, and what faster kernels would buy: the measurements behind the
next ViT speed-up (figures: docs/performance.md).

    python -m benchmarks.vit_profile --model DIR --out vit_profile.json

- ``tower``: our tower on 3 and 8 images of 768x1024 (the seed3img anchor's size), ms per image;
- ``kernels``: torch.profiler's device time of one 3-image forward, by category and top kernels;
- ``attention``: each SDPA kernel on three 768x1024 frames at a steady length (no per-shape set-up),
  at the checkpoint's head size and zero-padded to 96 and 128 (same answer, other kernels), and
  FlexAttention where it compiles;
- ``gemm``: the block's four projections at the 3-image row count, bf16 against FP8 (e4m3, per-row
  activation and per-column weight scales, ``torch._scaled_mm``), with the activation's quantisation
  timed apart and the FP8 result's error against bf16.
Needs a CUDA GPU (it says so and exits 2 otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.engine import cuda_time_ms
from benchmarks.vision import jpeg, profile_kernels
from workers.encoder.worker import encode_images
from workers.fetcher.image import ImageProcessorSpec, decode_image, preprocess_image
from workers.models.frame_attention import (
    ATTENTION_CANDIDATES,
    PaddedFrames,
    SegmentFrames,
    sdpa_choice,
    segment_attention,
)
from workers.models.vision import VisionTower

ANCHOR = (768, 1024)


def attention_rows(heads: int, head_dim: int, frame: int, frames: int) -> list[dict[str, Any]]:
    """ms for `frames` frames of `frame` patches, each SDPA kernel alone, head size as is and padded."""
    useful = 4 * frame * frame * head_dim * heads * frames
    rows = []
    for padded in sorted({head_dim, 96, 128}):
        if padded < head_dim:
            continue
        q, k, v = (torch.randn(frame * frames, heads, padded, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        grid = torch.tensor([[1, 1, frame]] * frames)
        for name, backend in ATTENTION_CANDIDATES.items():
            try:
                with sdpa_choice((backend,)):
                    ms = cuda_time_ms(lambda q=q, k=k, v=v: segment_attention(q, k, v, grid), 10)  # noqa: B023 - called here
            except RuntimeError as err:
                rows.append({"kernel": name, "head_dim": padded, "error": str(err)[:200]})
                continue
            rows.append({"kernel": name, "head_dim": padded, "ms": ms, "useful_tflops": useful / ms / 1e9})
    # As the tower runs them, from the qkv projection, rotary included: padded cuDNN against FlashAttention-2.
    qkv = torch.randn(frame * frames, 3 * heads * head_dim, device="cuda", dtype=torch.bfloat16)
    cos = torch.ones(frame * frames, head_dim, device="cuda")
    sin = torch.zeros_like(cos)
    grid = torch.tensor([[1, 1, frame]] * frames)
    for name, backend, attend in (
        ("cudnn-padded+rotary", "cudnn", PaddedFrames.plan(grid, heads, head_dim, qkv)),
        ("flash+rotary", "flash", SegmentFrames(grid)),
    ):
        with sdpa_choice((ATTENTION_CANDIDATES[backend],)):
            ms = cuda_time_ms(lambda a=attend: a(qkv, cos, sin, heads), 10)
        rows.append({"kernel": name, "head_dim": head_dim, "ms": ms, "useful_tflops": useful / ms / 1e9})
    rows.append(flex_row(heads, head_dim, frame, frames, useful))
    return rows


def flex_row(heads: int, head_dim: int, frame: int, frames: int, useful: float) -> dict[str, Any]:
    try:
        from torch.nn.attention.flex_attention import flex_attention

        compiled = torch.compile(flex_attention, dynamic=False)
        q, k, v = (torch.randn(frames, heads, frame, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ms = cuda_time_ms(lambda: compiled(q, k, v, scale=head_dim**-0.5), 10)
    except Exception as err:  # any failure to compile is the finding
        return {"kernel": "flex", "head_dim": head_dim, "error": f"{type(err).__name__}: {str(err)[:300]}"}
    return {"kernel": "flex", "head_dim": head_dim, "ms": ms, "useful_tflops": useful / ms / 1e9}


def layout_check(heads: int, head_dim: int, frame: int) -> dict[str, str]:
    """Whether cuDNN's attention takes v as a strided view of the qkv projection (as the tower passed it
    before its rotary kernel copied v out) and as a contiguous tensor; only cuDNN allowed, no fallback."""
    qkv = torch.randn(frame, 3, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q, k = qkv[:, 0].contiguous(), qkv[:, 1].contiguous()
    grid = torch.tensor([[1, 1, frame]])
    verdicts = {}
    for name, v in (("strided_v", qkv[:, 2]), ("contiguous_v", qkv[:, 2].contiguous())):
        try:
            with sdpa_choice((ATTENTION_CANDIDATES["cudnn"],)):
                segment_attention(q, k, v, grid)
            verdicts[name] = "ok"
        except RuntimeError as err:
            verdicts[name] = str(err).splitlines()[0][:200]
    return verdicts


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """The padded cuDNN path on q, k, v (rotary by identity tables), planned per call as a forward does."""
    n, heads, dim = q.shape
    qkv = torch.cat([q, k, v], dim=1).view(n, 3 * heads * dim)
    cos = torch.ones(n, dim, device=q.device)
    return PaddedFrames.plan(grid, heads, dim, qkv)(qkv, cos, torch.zeros_like(cos), heads)


def new_shape_ms(heads: int, head_dim: int, frame: int) -> dict[str, list[float]]:
    """Each kernel's first call on each of five frame lengths it has not seen (cuDNN builds a plan per
    shape), then the same lengths again: what images of every size cost against a repeated size. The
    padded cuDNN path (the tower's when cuDNN is picked) builds one per bucket: two here."""
    out = {}
    kernels = [(name, backend, segment_attention) for name, backend in ATTENTION_CANDIDATES.items()]
    kernels.append(("cudnn-padded", ATTENTION_CANDIDATES["cudnn"], padded_attention))
    for name, backend, attend in kernels:
        times = []
        for length in [frame + 28 * (i + 1) for i in range(5)] * 2:
            q, k, v = (torch.randn(length, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            grid = torch.tensor([[1, 1, length]])
            torch.cuda.synchronize()
            started = time.perf_counter()
            try:
                with sdpa_choice((backend,)):
                    attend(q, k, v, grid)
                torch.cuda.synchronize()
            except RuntimeError:
                break
            times.append(round(1e3 * (time.perf_counter() - started), 3))
        out[name] = times
    return out


def fp8_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> e4m3 values and fp32 per-row scales [M, 1] with x ~= values * scales."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return (x / scale).to(torch.float8_e4m3fn), scale


def fp8_linear_row(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, flops: int) -> dict[str, Any]:
    w8, w_scale = fp8_rowwise(w)  # per output column, as the weight is stored [N, K]
    x8, x_scale = fp8_rowwise(x)

    def fp8() -> torch.Tensor:
        return torch._scaled_mm(
            x8, w8.t(), scale_a=x_scale, scale_b=w_scale.t(), bias=b, out_dtype=torch.bfloat16, use_fast_accum=True
        )

    row: dict[str, Any] = {"fp8_ms": cuda_time_ms(fp8, 20), "quantize_ms": cuda_time_ms(lambda: fp8_rowwise(x), 20)}
    row["fp8_tflops"] = flops / row["fp8_ms"] / 1e9
    ref = F.linear(x.float(), w.float(), b.float())
    row["fp8_rel_err"] = float((fp8().float() - ref).norm() / ref.norm())
    row["bf16_rel_err"] = float((F.linear(x, w, b).float() - ref).norm() / ref.norm())
    return row


def gemm_rows(rows_m: int, dims: list[tuple[str, int, int]]) -> list[dict[str, Any]]:
    out = []
    for name, k, n in dims:
        x = torch.randn(rows_m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        flops = 2 * rows_m * k * n
        bf16_ms = cuda_time_ms(lambda x=x, w=w, b=b: F.linear(x, w, b), 20)
        row: dict[str, Any] = {"name": name, "m": rows_m, "k": k, "n": n, "bf16_ms": bf16_ms}
        row["bf16_tflops"] = flops / bf16_ms / 1e9
        try:
            row |= fp8_linear_row(x, w, b, flops)
        except (RuntimeError, TypeError) as err:
            row["fp8_error"] = str(err)[:300]
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.vit_profile needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    spec = ImageProcessorSpec.from_dir(args.model)
    tower = VisionTower.from_checkpoint(args.model, device="cuda", dtype=torch.bfloat16)
    tuned = tower.tune_attention()
    print(f"tune_attention: {tuned}, backends {[b.name for b in tower.backends]}", flush=True)
    tower.warm_up()
    patches, grid = preprocess_image(decode_image(jpeg(*ANCHOR, seed=3), 10**9), spec)
    pixels = torch.from_numpy(patches).to("cuda", torch.bfloat16)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "grid": list(grid), "tower": []}
    result["tune_attention_ms"] = tuned
    result["backends"] = [b.name for b in tower.backends]
    for batch in (3, 8):
        ms = cuda_time_ms(lambda b=batch: encode_images(tower, [pixels] * b, [list(grid)] * b), 5)
        rate = 1e3 * batch / ms
        result["tower"].append({"images": batch, "ms": ms, "ms_per_image": ms / batch, "images_per_s": rate})
        print(f"tower, {batch} images {grid}: {ms:.2f} ms, {1e3 * batch / ms:.1f} images/s", flush=True)
    result["kernels"] = profile_kernels(lambda: encode_images(tower, [pixels] * 3, [list(grid)] * 3))
    print(json.dumps(result["kernels"]["by_category_ms"], indent=1), flush=True)
    for name, ms in result["kernels"]["top_ms"][:12]:
        print(f"  {ms:8.2f} ms  {name[:110]}")
    vs = tower.spec
    frame = grid[1] * grid[2]
    result["layout"] = layout_check(vs.num_heads, vs.head_dim, frame)
    result["new_shape_ms"] = new_shape_ms(vs.num_heads, vs.head_dim, frame)
    print("cuDNN and v's layout:", result["layout"], flush=True)
    print("first calls on new lengths, then again:", result["new_shape_ms"], flush=True)
    result["attention"] = attention_rows(vs.num_heads, vs.head_dim, frame, 3)
    for row in result["attention"]:
        print("attention", json.dumps(row), flush=True)
    dims = [("qkv", vs.embed_dim, 3 * vs.embed_dim), ("proj", vs.embed_dim, vs.embed_dim)]
    dims += [("fc1", vs.embed_dim, vs.mlp_hidden_dim), ("fc2", vs.mlp_hidden_dim, vs.embed_dim)]
    result["gemm"] = gemm_rows(3 * patches.shape[0], dims)
    for row in result["gemm"]:
        print("gemm", json.dumps(row), flush=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
