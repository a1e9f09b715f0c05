"""Where a decoder's host memory goes under traffic: the real engine in this process (the decoder's settings for
the device, prefix cache on), fed requests of random prompt lengths and output lengths for ``--seconds``, with the
process's anonymous memory sampled beside what Python's allocator holds (`sys.getallocatedblocks`) and what
glibc's malloc has handed out (``mallinfo2``). A leak in Python objects grows the first two together; one in a
native library (CUDA, cuBLAS, Triton's launcher) grows malloc's bytes or, mapped past malloc, the anonymous memory
alone. An H200 soak's decoder grew without bound where the CPU's did not; this tells which kind it is.

    python -m benchmarks.decoder_memory --model CKPT --seconds 90 --out decoder-memory.json
    python -m benchmarks.decoder_memory --model CKPT --seconds 60 --tracemalloc 8 --out traced.json  # which lines
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import random
import sys
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from common.config import DecoderConfig
from common.protocol import PreparedRequest, SamplingParams
from workers.decoder.config import EngineConfig
from workers.decoder.engine import Engine
from workers.models.registry import checkpoint_family, read_spec

MIB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


@functools.cache
def _mallinfo2() -> Any:
    """glibc's ``mallinfo2``, loaded once (each load makes ctypes classes of its own); None off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    return libc.mallinfo2


def malloc_mib() -> tuple[float, float] | None:
    """(bytes glibc's malloc has handed out and not had back, small blocks plus mmapped ones; bytes it holds free in
    its arenas, which RSS counts once touched) in MiB; None off glibc."""
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        return None
    info = mallinfo2()
    return (info.uordblks + info.hblkhd) / MIB, info.fordblks / MIB


def anon_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def sample(t: float, requests: int, tokens: int) -> dict[str, Any]:
    malloc = malloc_mib()
    return {
        "t": round(t, 2),
        "requests": requests,
        "tokens": tokens,
        "anon_mib": anon_mib(),
        "python_blocks": sys.getallocatedblocks(),
        "malloc_mib": None if malloc is None else malloc[0],
        "malloc_free_mib": None if malloc is None else malloc[1],
        "gc_objects": len(gc.get_objects()),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    spec = read_spec(args.model, "auto")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = checkpoint_family(args.model, "auto").language_model(args.model, device=device, dtype=dtype, spec=spec)
    settings = DecoderConfig()
    config = EngineConfig.from_settings(settings, device, args.blocks, args.max_prompt + args.max_tokens + 1)
    if args.no_prefix_cache:
        config = replace(config, prefix_cache=False)
    if args.graphs != "auto":  # ("static": the graphs' staging and static buffers without capture, as on the GPU)
        config = replace(config, graphs=args.graphs, fuse=args.graphs != "off" or config.fuse)
    engine = Engine(model, spec, config)
    rng = random.Random(0)
    vocab = min(spec.vocab_size, 30000)
    samples, made, tokens, t0 = [], 0, 0, time.perf_counter()
    next_sample, traced, growth = 0.0, None, []
    while (now := time.perf_counter() - t0) < args.seconds:
        if args.tracemalloc and traced is None and now >= args.warmup:
            tracemalloc.start(args.tracemalloc)
            traced = tracemalloc.take_snapshot()
        while len(engine.scheduler.running) + len(engine.scheduler.waiting) < args.concurrency:
            length = args.fixed_prompt or rng.randint(args.min_prompt, args.max_prompt)
            ids = [rng.randrange(10, vocab) for _ in range(length)]
            params = SamplingParams(max_tokens=rng.randint(1, args.max_tokens), temperature=0.0, ignore_eos=True)
            engine.add(engine.prepare(PreparedRequest(f"r{made}", ids, [], params)))
            made += 1
        tokens += sum(len(delta.token_ids) for delta in engine.step())
        if now >= next_sample:
            samples.append(sample(now, made, tokens))
            print(json.dumps(samples[-1]), flush=True)
            next_sample += args.sample_every
    if traced is not None:
        diff = tracemalloc.take_snapshot().compare_to(traced, "traceback")
        growth = [{"kib": d.size_diff / 1024, "count": d.count_diff, "where": d.traceback.format()} for d in diff[:20]]
        for g in growth[:10]:
            print(f"{g['kib']:10.1f} KiB {g['count']:+7d}  {g['where'][-2:]}", flush=True)
    config_out = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    return {"device": str(device), "config": config_out, "samples": samples, "python_growth": growth}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seconds", type=float, default=90.0)
    p.add_argument("--sample-every", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--min-prompt", type=int, default=100)
    p.add_argument("--max-prompt", type=int, default=3000)
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--blocks", type=int, default=20000, help="KV blocks of the engine's cache")
    p.add_argument("--fixed-prompt", type=int, default=0, help="every prompt this long (0: uniform in min..max)")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument(
        "--graphs",
        choices=("auto", "off", "static"),
        default="auto",
        help="the engine's step graphs: the device's default, none, or staged uncaptured (the GPU's path on a CPU)",
    )
    p.add_argument(
        "--tracemalloc",
        type=int,
        default=0,
        metavar="FRAMES",
        help="trace Python's allocations (this many frames) from --warmup on; the 20 lines grown most: in the JSON",
    )
    p.add_argument("--warmup", type=float, default=10.0, help="seconds before --tracemalloc starts")
    args = p.parse_args(argv)
    result = run(args)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
