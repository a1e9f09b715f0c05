"""One engine step replayed from its CUDA graph, as the server captures it: how long it takes and, with
``--profile``, where the time goes by kernel.

    python -m benchmarks.mixed_step --model DIR --step 32x1100 32x1100+1000:1000+1000:1000 [--profile]

A step is ``+``-joined groups: ``COUNTxCONTEXT`` sequences decoding one token each with CONTEXT keys before
it, and ``NEW:CONTEXT`` a prompt chunk of NEW tokens whose sequence has CONTEXT keys once it is written
(``1352:3400``: an image prompt's last chunk after a 2,048-token first one). A step of decodes alone runs
the decode graph; any other the mixed graph of its token count, as `workers.decoder.runner` picks them.
`benchmarks.engine_mixed` fits what a step's prompt tokens cost under mixed's load; this says which kernels
that is.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks.engine import cuda_time_ms
from common.config import DecoderConfig
from workers.decoder.graphs import StepGraphs, StepInputs
from workers.kernels import paged_attention
from workers.models.language import LanguageModel
from workers.models.paged import PagedKVCache, fuse_layers

Step = list[tuple[int, int]]  # (new tokens, context after them) per sequence


def parse_step(text: str) -> Step:
    """``COUNTxCONTEXT`` and ``NEW:CONTEXT`` groups joined by ``+``, in that order in the batch."""
    step: Step = []
    for group in text.split("+"):
        try:
            if "x" in group:
                count, _, context = group.partition("x")
                step += [(1, int(context) + 1)] * int(count)
            else:
                new, _, context = group.partition(":")
                step.append((int(new), int(context)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected COUNTxCONTEXT or NEW:CONTEXT groups, got {group!r}") from None
    if not step or any(not 1 <= new <= context for new, context in step):
        raise argparse.ArgumentTypeError(f"every group needs 1 <= NEW <= CONTEXT: {text!r}")
    return step


def step_inputs(step: Step, block_size: int) -> StepInputs:
    """Each sequence on blocks of its own (consecutive numbers), its new tokens at the end of its context."""
    tables, positions, slots, next_block = [], [], [], 0
    for new, context in step:
        blocks = -(-context // block_size)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        tables.append(table)
        at = np.arange(context - new, context)
        positions.append(at)
        slots.append(np.asarray(table, dtype=np.int64)[at // block_size] * block_size + at % block_size)
    flat = np.concatenate(positions)
    return StepInputs(
        positions=np.stack([flat] * 3),
        slots=np.concatenate(slots),
        query_lens=[new for new, _ in step],
        context_lens=[context for _, context in step],
        block_tables=tables,
        rows=[int(end) - 1 for end in np.cumsum([new for new, _ in step])],
    )


def blocks_needed(steps: list[Step], block_size: int) -> int:
    return max(sum(-(-context // block_size) for _, context in step) for step in steps)


def run(model: LanguageModel, steps: list[Step], names: list[str], block_size: int, profile: bool) -> None:
    cfg = DecoderConfig()
    blocks = blocks_needed(steps, block_size)
    kv = PagedKVCache.for_model(model, blocks + 1, block_size)
    graphs = StepGraphs(
        model,
        kv,
        max_seqs=max(cfg.max_running, *(len(step) for step in steps)),
        max_tokens=cfg.graph_tokens,
        max_context=32768,  # as a server of the 2b's max_model_len captures: it fixes decode's split count
        scratch_block=blocks,
        attention=paged_attention,
        fused=fuse_layers(model),
        capture=True,
    )
    for step, name in zip(steps, names, strict=True):
        inputs = step_inputs(step, block_size)
        tokens = inputs.num_tokens
        if all(new == 1 for new, _ in step):
            kind = "decode graph"

            def replay(inputs: StepInputs = inputs) -> torch.Tensor:
                return graphs.decode(inputs, [17] * len(inputs.query_lens))
        else:
            if not graphs.fits_mixed(tokens, len(step), max(context for _, context in step)):
                print(f"step {name}: {tokens} tokens, past the mixed graphs ({cfg.graph_tokens}); skipped", flush=True)
                continue
            kind = "mixed graph"
            embeds = torch.randn((tokens, model.spec.hidden_size), dtype=model.dtype, device=model.device)

            def replay(inputs: StepInputs = inputs, embeds: torch.Tensor = embeds) -> torch.Tensor:
                return graphs.mixed(inputs, embeds)

        ms = cuda_time_ms(replay, 30)
        print(f"step {name}: {tokens} tokens, {len(step)} sequences, {kind}, block size {block_size}: {ms:.3f} ms")
        if profile:
            print_kernels(replay)
        sys.stdout.flush()


def print_kernels(replay: Callable[[], object]) -> None:
    """The kernels that ``replay`` launches (torch.profiler sees those of a graph), over 20 replays."""
    from torch.profiler import ProfilerActivity, profile

    replays = 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    print(f"kernels over {replays} replays (divide totals by {replays} for one step):")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--step", nargs="+", required=True, metavar="GROUP[+GROUP...]")
    parser.add_argument("--block-size", type=int, default=DecoderConfig().block_size)
    parser.add_argument("--profile", action="store_true", help="the kernels of each step too")
    args = parser.parse_args(argv)
    try:
        steps = [parse_step(text) for text in args.step]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if not torch.cuda.is_available():
        print("benchmarks.mixed_step needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    model = LanguageModel.from_checkpoint(args.model, device="cuda", dtype=torch.bfloat16)
    run(model, steps, args.step, args.block_size, args.profile)


if __name__ == "__main__":
    main()
