"""Vision-path timings without HTTP: where an image's time goes between upload and embedding.

    python -m benchmarks.vision --model DIR --out vision.json [--skip-hf]

- ``preprocess``: the fetcher's host work per image (decode, resize, normalise, patchify), per size;
- ``tune_forward_ms``: the tower's forward of three ~4,096-patch frames with each SDPA kernel, as the encoder
  picks its kernel at start-up (`VisionTower.tune_attention`);
- ``tower``: our vision tower (`workers.encoder.worker.encode_images`, what the encoder runs) on
  batches of 1..16 images of 640x480 and 1280x720, images per second, CUDA-event timed;
- ``hf``: transformers' Qwen2-VL vision tower on the same pixels, same batches;
- ``roofline``: 2 * params * patches + attention FLOPs at 790 TFLOP/s (ANCHORS' bf16 dense figure).
Needs a CUDA GPU (it says so and exits 2 otherwise).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from benchmarks.engine import BF16_FLOPS, cuda_time_ms
from workers.encoder.worker import encode_images
from workers.fetcher.image import ImageProcessorSpec, decode_image, preprocess_image
from workers.models.vision import VisionTower

SIZES = {"640x480": (640, 480), "1280x720": (1280, 720)}
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


def tower_flops(tower: VisionTower, patches: int, grid: list[int]) -> float:
    params = sum(p.numel() for p in tower.parameters())
    spec = tower.spec
    frame = grid[1] * grid[2]
    attention = 4 * spec.depth * spec.embed_dim * frame * patches  # QK^T and PV over each frame
    return 2 * params * patches + attention


def bench_hf_tower(model_dir: Path, pixels: torch.Tensor, grid: torch.Tensor, batches: list[int]) -> list[float]:
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda().eval()
    visual = model.model.visual
    out = []
    with torch.inference_mode():
        for batch in batches:
            flat, grids = pixels.repeat(batch, 1).cuda().bfloat16(), grid.repeat(batch, 1).cuda()
            out.append(cuda_time_ms(lambda f=flat, g=grids: visual(f, grid_thw=g), 5))
    del model
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.vision needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    spec = ImageProcessorSpec.from_dir(args.model)
    tower = VisionTower.from_checkpoint(args.model, device="cuda", dtype=torch.bfloat16)
    tune_ms = tower.tune_attention()  # what the encoder does at start-up
    print("ms per forward of three ~4,096-patch frames: " + ", ".join(f"{k} {v:.1f}" for k, v in tune_ms.items()))
    results: dict[str, Any] = {
        "model": str(args.model),
        "device": torch.cuda.get_device_name(),
        "tune_forward_ms": tune_ms,
        "sizes": {},
    }
    for name, (width, height) in SIZES.items():
        host_ms, patches, grid = bench_preprocess(spec, width, height)
        pixels = torch.from_numpy(patches)
        row: dict[str, Any] = {"grid": grid, "patches": pixels.shape[0], "preprocess_ms": host_ms, "tower": []}
        on_gpu = pixels.to("cuda", torch.bfloat16)  # both towers are timed without the host-to-device copy
        print(f"{name}: grid {grid}, {pixels.shape[0]} patches, host preprocessing {host_ms:.1f} ms", flush=True)
        for batch in BATCHES:
            ms = cuda_time_ms(lambda b=batch, p=on_gpu, g=grid: encode_images(tower, [p] * b, [g] * b), 5)
            roof = tower_flops(tower, pixels.shape[0], grid) * batch / BF16_FLOPS * 1e3
            row["tower"].append({"batch": batch, "ms": ms, "images_per_s": 1e3 * batch / ms, "roofline_ms": roof})
            print(
                f"  tower batch {batch:2d}: {ms:7.2f} ms, {1e3 * batch / ms:6.1f} images/s, "
                f"{roof / ms:.0%} of the FLOP roofline ({roof:.2f} ms)",
                flush=True,
            )
        if not args.skip_hf:
            grid_t = torch.tensor([grid])
            hf_ms = bench_hf_tower(args.model, pixels, grid_t, BATCHES)
            pairs = list(zip(BATCHES, hf_ms, strict=True))
            row["hf"] = [{"batch": b, "ms": ms, "images_per_s": 1e3 * b / ms} for b, ms in pairs]
            print("  transformers: " + ", ".join(f"b{b} {1e3 * b / ms:.1f} img/s" for b, ms in pairs), flush=True)
        results["sizes"][name] = row
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
