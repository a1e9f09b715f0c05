"""Vision-path timings without HTTP: where an image's time goes between upload and embedding.

    python -m benchmarks.vision --model DIR --out vision.json [--skip-hf] [--batches 1,4,16] [--device cuda]
        [--sizes 640x480,1280x720] [--quantization auto|none|fp8]

Any family's checkpoint (the tower is the family's, loaded as the encoder loads it: `checkpoint_family`).

- ``preprocess``: the fetcher's host work per image (decode, resize, normalise, patchify), per size;
- ``tune_forward_ms``: the tower's forward of three ~4,096-patch frames with each SDPA kernel, as the encoder
  picks its kernel at start-up (`VisionTower.tune_attention`; empty for a tower with nothing to pick);
- ``tower``: our vision tower (`workers.encoder.worker.encode_images`, what the encoder runs) on
  batches of 1..16 images of 640x480 and 1280x720, images per second, CUDA-event timed;
- ``hf``: transformers' vision tower of the checkpoint's family on the same pixels, same batches;
- ``roofline``: 2 * params * patches + attention FLOPs (a windowed block's over its window) at 790 TFLOP/s
  (ANCHORS' bf16 dense figure).
- ``--quantization``: the tower's linear layers as ``[encoder] quantization`` serves them (`workers.models.vision_fp8`;
  default "auto", the checkpoint's own). Other than "auto", each size also reports ``embedding_distance`` (the
  relative L2 distance of one image's embeddings to the tower with ``quantization = "none"``, bf16 on a GPU, on the
  same pixels) and ``reference_tower``: that tower's images/s on the same batches, for the ratio.
Needs a CUDA GPU (it says so and exits 2 otherwise); ``--device cpu`` runs the same steps on the CPU in fp32, wall
-clock timed: a smoke test of the script, its figures meaningless.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from benchmarks.engine import BF16_FLOPS, cuda_time_ms
from common.quantization import QUANTIZATION_SETTINGS
from workers.encoder.worker import encode_images
from workers.fetcher.image import ImageProcessorSpec, decode_image, preprocess_image
from workers.models.registry import checkpoint_family
from workers.models.vision_fp8 import serve_linears

SIZES = {"640x480": (640, 480), "1280x720": (1280, 720)}
MORE_SIZES = {"768x1024": (768, 1024)}  # (the issue's FP8 target size; --sizes)
BATCHES = [1, 4, 16]


def jpeg(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height // 8, width // 8, 3), dtype=np.uint8)
    image = Image.fromarray(pixels).resize((width, height), Image.Resampling.BILINEAR)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue()


def bench_preprocess(spec: ImageProcessorSpec, width: int, height: int) -> tuple[float, np.ndarray, list[int]]:
    """Milliseconds per image of the fetcher's host work, and the patches it makes."""
    data = jpeg(width, height, seed=1)
    started, repeats = time.perf_counter(), 10
    for _ in range(repeats):
        pixels, grid = preprocess_image(decode_image(data, 10**9), spec)
    return 1e3 * (time.perf_counter() - started) / repeats, pixels, list(grid)


def tower_flops(tower: nn.Module, patches: int, grid: list[int]) -> float:
    params = sum(p.numel() for p in tower.parameters())
    spec = tower.spec
    frame = grid[1] * grid[2]
    # QK^T and PV over each frame; in Qwen2.5-VL's windowed blocks over a window at most.
    window = (spec.window_size // spec.patch_size) ** 2 if getattr(spec, "windowed", False) else frame
    full = len(spec.fullatt_block_indexes) if getattr(spec, "windowed", False) else spec.depth
    keys = full * frame + (spec.depth - full) * min(window, frame)
    return 2 * params * patches + 4 * spec.embed_dim * keys * patches


def tower_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_tower(model_dir: Path, device: torch.device, quantization: str = "auto") -> Any:
    """The checkpoint family's tower (bf16 on a GPU), its linear layers as ``[encoder] quantization`` serves them, as
    the encoder loads it (`load_vision_backend`)."""
    dtype = tower_dtype(device)
    tower = checkpoint_family(model_dir).vision_tower(model_dir, device=device, dtype=dtype)
    return serve_linears(tower, quantization, dtype)


def embedding_distance(tower: Any, reference: Any, pixels: torch.Tensor, grid: list[int]) -> float:
    """Relative L2 distance of ``tower``'s embeddings of one image to ``reference``'s, on the same pixels."""
    with torch.inference_mode():
        got, truth = (encode_images(t, [pixels], [grid])[0].float() for t in (tower, reference))
    return float((got - truth).norm() / truth.norm())


def bench_batches(
    tower: Any, pixels: torch.Tensor, grid: list[int], batches: list[int], device: torch.device
) -> list[tuple[int, float]]:
    """(batch, ms) of ``tower`` on each batch of copies of one image."""
    return [(b, time_ms(lambda b=b: encode_images(tower, [pixels] * b, [grid] * b), device)) for b in batches]


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    """Mean milliseconds per call: CUDA-event timed on a GPU, wall-clock elsewhere (after two warm-ups too)."""
    if device.type == "cuda":
        return cuda_time_ms(fn, repeats)
    for _ in range(2):
        fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1e3 * (time.perf_counter() - started) / repeats


def bench_hf_tower(
    model_dir: Path, pixels: torch.Tensor, grid: torch.Tensor, batches: list[int], device: torch.device
) -> list[float]:
    from transformers import AutoModelForImageTextToText

    # The class of the checkpoint's model_type (Qwen2VL..., Qwen2_5_VL..., Qwen3VLForConditionalGeneration).
    dtype = tower_dtype(device)
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    visual = model.model.visual
    out = []
    with torch.inference_mode():
        for batch in batches:
            flat, grids = pixels.repeat(batch, 1).to(device, dtype), grid.repeat(batch, 1).to(device)
            out.append(time_ms(lambda f=flat, g=grids: visual(f, grid_thw=g), device))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",")]
    if device.type == "cuda" and not torch.cuda.is_available():
        print("benchmarks.vision needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    spec = ImageProcessorSpec.from_dir(args.model)
    tower = load_tower(args.model, device, args.quantization)
    # the unquantized tower, for the embedding distance and the images/s ratio
    reference = load_tower(args.model, device, "none") if args.quantization != "auto" else None
    tune_ms = tower.tune_attention()  # what the encoder does at start-up
    if reference is not None and hasattr(tower, "backends"):  # (one attention kernel for both: the ratio is the GEMMs')
        reference.backends = tower.backends
    for loaded in (tower, reference):
        if loaded is not None:
            loaded.warm_up()
    print("ms per forward of three ~4,096-patch frames: " + ", ".join(f"{k} {v:.1f}" for k, v in tune_ms.items()))
    results: dict[str, Any] = {
        "model": str(args.model),
        "model_type": checkpoint_family(args.model).model_type,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "quantization": args.quantization,
        "tune_forward_ms": tune_ms,
        "sizes": {},
    }
    for name in args.sizes.split(","):
        width, height = {**SIZES, **MORE_SIZES}[name]
        host_ms, patches, grid = bench_preprocess(spec, width, height)
        pixels = torch.from_numpy(patches)
        row: dict[str, Any] = {"grid": grid, "patches": pixels.shape[0], "preprocess_ms": host_ms, "tower": []}
        on_gpu = pixels.to(device, tower_dtype(device))  # both towers are timed without the host-to-device copy
        print(f"{name}: grid {grid}, {pixels.shape[0]} patches, host preprocessing {host_ms:.1f} ms", flush=True)
        for batch, ms in bench_batches(tower, on_gpu, grid, batches, device):
            roof = tower_flops(tower, pixels.shape[0], grid) * batch / BF16_FLOPS * 1e3
            row["tower"].append({"batch": batch, "ms": ms, "images_per_s": 1e3 * batch / ms, "roofline_ms": roof})
            print(
                f"  tower batch {batch:2d}: {ms:7.2f} ms, {1e3 * batch / ms:6.1f} images/s, "
                f"{roof / ms:.0%} of the bf16 FLOP roofline ({roof:.2f} ms)",
                flush=True,
            )
        if args.profile and device.type == "cuda":
            row["profile"] = profile_batches(tower, on_gpu, grid, batches)
        if reference is not None:
            row.update(compare_reference(tower, reference, on_gpu, grid, batches, device))
        if not args.skip_hf:
            grid_t = torch.tensor([grid])
            hf_ms = bench_hf_tower(args.model, pixels, grid_t, batches, device)
            pairs = list(zip(batches, hf_ms, strict=True))
            row["hf"] = [{"batch": b, "ms": ms, "images_per_s": 1e3 * b / ms} for b, ms in pairs]
            print("  transformers: " + ", ".join(f"b{b} {1e3 * b / ms:.1f} img/s" for b, ms in pairs), flush=True)
        results["sizes"][name] = row
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


def compare_reference(
    tower: Any, reference: Any, pixels: torch.Tensor, grid: list[int], batches: list[int], device: torch.device
) -> dict[str, Any]:
    """The quantized tower against the unquantized one: embedding distance on one image, and its images/s."""
    distance = embedding_distance(tower, reference, pixels, grid)
    timed = [
        {"batch": b, "ms": ms, "images_per_s": 1e3 * b / ms}
        for b, ms in bench_batches(reference, pixels, grid, batches, device)
    ]
    print(
        f"  embedding distance to the unquantized tower {distance:.4f}; unquantized: "
        + ", ".join(f"b{t['batch']} {t['images_per_s']:.1f} img/s" for t in timed),
        flush=True,
    )
    return {"embedding_distance": distance, "reference_tower": timed}


CATEGORIES = (  # first match wins; names lower-cased
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa", "efficient")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "sm90")),
    ("rotary", ("rotary",)),
    ("gelu", ("gelu",)),
    ("layernorm", ("layer_norm", "layernorm", "_norm_kernel")),  # ours: LayerNorm fused with the residual add
    ("conv", ("conv", "implicit")),
    ("copy", ("copy", "cat", "memcpy", "memset")),
)


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in name for k in keys)), "other")


def profile_kernels(fn: Callable[[], object]) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
        if us > 0:
            kernels[evt.key] += us / 1e3
    by_category: dict[str, float] = defaultdict(float)
    for name, ms in kernels.items():
        by_category[category(name)] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {"total_ms": sum(kernels.values()), "by_category_ms": dict(by_category), "top_ms": top}


def profile_batches(tower: Any, pixels: torch.Tensor, grid: list[int], batches: list[int]) -> list[dict[str, Any]]:
    """`profile_kernels` of one forward at each batch: where a batch's time goes, by kernel category."""
    out = []
    for batch in batches:
        found = profile_kernels(lambda b=batch: encode_images(tower, [pixels] * b, [grid] * b))
        cats = ", ".join(f"{k} {v:.2f}" for k, v in sorted(found["by_category_ms"].items(), key=lambda kv: -kv[1]))
        print(f"  profile batch {batch}: {found['total_ms']:.2f} ms of kernels: {cats}", flush=True)
        for name, ms in found["top_ms"][:8]:
            print(f"    {ms:8.2f} ms  {name[:110]}", flush=True)
        out.append({"batch": batch, **found})
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--profile", action="store_true", help="also each batch's GPU time by kernel (torch.profiler)")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="images per forward, comma-separated")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test of the script")
    sizes = [*SIZES, *MORE_SIZES]
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"image sizes, comma-separated, of {sizes}")
    parser.add_argument(
        "--quantization", default="auto", choices=QUANTIZATION_SETTINGS, help="as [encoder] quantization"
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.sizes.split(",") if name not in sizes]
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; known: {sizes}")
    return args


if __name__ == "__main__":
    main()
