"""What the decoder's sampler costs on the host's CPU for a batch of rows over Qwen's vocabulary.

    python -m benchmarks.sampling_cost [--rows 1,8,64] [--vocab 151936] [--repetitions 5]

Each case samples ``rows`` seeded rows at temperature 0.7 with a repetition penalty over 1,000 prompt and
output ids, under a top-p / top-k pair, from random logits of two shapes: ``peaked`` (normal * 8, a few
tokens hold most mass, as a trained model's do) and ``flat`` (normal * 1, top-p needs most of the
vocabulary). Prints the best of ``--repetitions`` for the whole draw (`_choose`) and its parts: the
penalties (`_adjust_`), the cutoffs (`_cutoffs`) and the Gumbel noise (`_gumbel`), in milliseconds.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable

import torch

from workers.decoder import sampling

CASES = [(0.8, 20), (0.95, 0), (0.8, 0), (1.0, 20)]  # (top_p, top_k)


def best_ms(run: Callable[[], object], repetitions: int) -> float:
    run()
    times = []
    for _ in range(repetitions):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def rows_of(n: int, vocab: int, top_p: float, top_k: int) -> list[sampling.SamplingRow]:
    rnd = random.Random(1)
    return [
        sampling.SamplingRow(
            0.7,
            top_p=top_p,
            top_k=top_k,
            repetition_penalty=1.1,
            seed=i,
            step=5,
            prompt_ids=[rnd.randrange(vocab) for _ in range(900)],
            output_ids=[rnd.randrange(vocab) for _ in range(100)],
        )
        for i in range(n)
    ]


def case(n: int, vocab: int, shape: str, top_p: float, top_k: int, repetitions: int) -> str:
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(n)) * (8.0 if shape == "peaked" else 1.0)
    rows = rows_of(n, vocab, top_p, top_k)
    params = torch.tensor(
        [[r.temperature, min(r.top_k, vocab), r.top_p if r.top_p < 1 else 2.0, -math.inf] for r in rows]
    )
    scaled = logits / params[:, :1]
    keys = [sampling.noise_key(r.seed or 0, r.step) for r in rows]
    figures = {
        "choose": best_ms(lambda: sampling._choose(logits, rows), repetitions),
        "adjust": best_ms(lambda: sampling._adjust_(logits.clone(), rows), repetitions),
        "cutoffs": best_ms(lambda: sampling._cutoffs(scaled, rows, params), repetitions),
        "gumbel": best_ms(lambda: sampling._gumbel(keys, 0, vocab, logits.device), repetitions),
    }
    parts = " ".join(f"{name} {ms:7.1f}" for name, ms in figures.items())
    return f"rows {n:3d} {shape:6s} top_p {top_p:4.2f} top_k {top_k:3d}: {parts}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repetitions", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for n in (int(r) for r in args.rows.split(",")):
        for shape in ("peaked", "flat"):
            for top_p, top_k in CASES:
                print(case(n, args.vocab, shape, top_p, top_k, args.repetitions), flush=True)


if __name__ == "__main__":
    main()
