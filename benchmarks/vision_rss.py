"""Whether the vision tower alone holds on to memory: its forward over random grids, the process's RSS printed as
it goes (``--trim``: glibc's ``malloc_trim`` after each, to tell freed-but-kept memory from a leak).

    .venv/bin/python -m benchmarks.vision_rss --checkpoint DIR [--forwards 1200] [--trim]

A soak whose encoder's RSS keeps rising asks this first: a plateau here puts the growth in the worker around it.
"""

from __future__ import annotations

import argparse
import ctypes
import random
from pathlib import Path

import torch

from workers.models.vision import VisionTower


def rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vision_rss", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="a Qwen2-VL checkpoint directory")
    p.add_argument("--forwards", type=int, default=1200)
    p.add_argument("--trim", action="store_true", help="malloc_trim(0) after each forward")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tower = VisionTower.from_checkpoint(args.checkpoint)
    unit = tower.spec.spatial_merge_size
    libc = ctypes.CDLL("libc.so.6") if args.trim else None
    rng = random.Random(args.seed)
    with torch.inference_mode():
        for i in range(1, args.forwards + 1):
            grid = torch.tensor([[1, rng.randint(2, 24) * unit, rng.randint(2, 24) * unit]])
            tower(torch.randn(int(grid.prod()), tower.spec.patch_dim, dtype=tower.dtype), grid)
            if libc is not None:
                libc.malloc_trim(0)
            if i % 200 == 0:
                print(f"{i} forwards: {rss_mib():.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
