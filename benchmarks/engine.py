"""Engine-level timings without HTTP: decode steps, prefills and the whole engine loop, beside
transformers on the same checkpoint and the H200's roofline.

    python -m benchmarks.engine --model DIR --out engine.json [--quick] [--device cpu]

The checkpoint's family (`workers.models.registry`) gives the language model, and `EngineConfig.from_settings`
(the decoder's own choice for that model on that device) whether its steps run fused and from CUDA graphs; the
decode and prefill timings need both, so a model the server runs eagerly gets ``engine_tpot`` alone.

- ``decode``: one decode step (the model forward, no sampling) for batch x context, through the CUDA
  graphs the engine replays and eagerly with the same kernels; timed with CUDA events over many steps.
- ``prefill``: one prompt of N text tokens through ``paged_forward`` (fused layers, Triton attention).
- ``engine_tpot``: the real `Engine` (scheduling, sampling, host work) generating 256 greedy tokens after
  an 820-token prompt, batch 1 and 32: wall time per step, which is what a client sees as TPOT.
- ``hf``: transformers' forward on the same checkpoint: one decode step over a cache of the same context,
  and the same prefills.
- ``roofline``: weight bytes (+ KV bytes read) / 4.8 TB/s for decode; 2 * params * tokens / 790 TFLOP/s
  (+ attention) for prefill — the ANCHORS.md figures.
Needs a CUDA GPU (it says so and exits 2 otherwise); ``--device cpu`` is a smoke run of ``engine_tpot`` alone
(a few tokens, float32), for the CPU tests.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.config import DecoderConfig
from common.protocol import PreparedRequest, SamplingParams
from common.quantization import QUANTIZATION_SETTINGS
from workers.decoder.config import EngineConfig
from workers.decoder.engine import Engine
from workers.decoder.graphs import StepGraphs, StepInputs
from workers.kernels import attention_triton, paged_attention
from workers.models.language import LanguageModel
from workers.models.paged import BatchLayout, FusedLayer, PagedKVCache, fuse_layers, paged_forward
from workers.models.registry import checkpoint_family, read_spec
from workers.models.spec import ModelSpec

HBM_BYTES_PER_S = 4.8e12
BF16_FLOPS = 790e12


def cuda_time_ms(fn: Callable[[], object], repeats: int) -> float:
    """Mean milliseconds per call, CUDA events around ``repeats`` calls after two warm-ups."""
    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def language_bytes(model: LanguageModel) -> int:
    """Bytes a decode step must read: every weight but the embedding table (one row per token)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen or name.startswith("embed_tokens"):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    if model.lm_head.weight is model.embed_tokens.weight:
        total += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    return total


def decode_roofline_ms(model: LanguageModel, batch: int, context: int) -> float:
    spec = model.spec
    kv = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2 * batch * context
    return (language_bytes(model) + kv) / HBM_BYTES_PER_S * 1e3


def prefill_roofline_ms(model: LanguageModel, tokens: int) -> float:
    spec = model.spec
    params = language_bytes(model) / 2
    attention = 2 * 2 * spec.num_layers * spec.num_heads * spec.head_dim * tokens * tokens / 2
    return (2 * params * tokens + attention) / BF16_FLOPS * 1e3


def fake_tables(batch: int, context: int, block_size: int) -> list[list[int]]:
    per = -(-(context + 1) // block_size)
    return [list(range(s * per, (s + 1) * per)) for s in range(batch)]


def bench_decode(
    model: LanguageModel, fused: list[FusedLayer], grid: list[tuple[int, int]], repeats: int
) -> list[dict[str, Any]]:
    block_size = 16
    max_batch = max(b for b, _ in grid)
    max_context = max(c for _, c in grid) + 1
    num_blocks = max(b * -(-(c + 1) // block_size) for b, c in grid) + 1
    kv = PagedKVCache.for_model(model, num_blocks, block_size)
    common = {"max_seqs": max_batch, "max_tokens": 0, "max_context": max_context, "scratch_block": num_blocks - 1}
    graphs = StepGraphs(model, kv, attention=paged_attention, fused=fused, capture=True, **common)
    eager = StepGraphs(model, kv, attention=paged_attention, fused=fused, capture=False, **common)
    rows = []
    for batch, context in grid:
        tables = fake_tables(batch, context, block_size)
        inputs = StepInputs(
            positions=np.full((3, batch), context, dtype=np.int64),
            slots=np.asarray([t[context // block_size] * block_size + context % block_size for t in tables]),
            query_lens=[1] * batch,
            context_lens=[context + 1] * batch,
            block_tables=tables,
            rows=[],
        )
        graph_ms = cuda_time_ms(functools.partial(graphs.decode, inputs, [17] * batch), repeats)
        eager_ms = cuda_time_ms(functools.partial(eager.decode, inputs, [17] * batch), max(3, repeats // 10))
        roof = decode_roofline_ms(model, batch, context)
        rows.append(
            {"batch": batch, "context": context, "graph_ms": graph_ms, "eager_ms": eager_ms, "roofline_ms": roof}
        )
        print(
            f"decode b={batch:3d} ctx={context:5d}: graph {graph_ms:.3f} ms, eager {eager_ms:.3f} ms, "
            f"roofline {roof:.3f} ms",
            flush=True,
        )
    return rows


def prefill_call(model: LanguageModel, tokens: int, layers: list[FusedLayer] | None) -> Callable[[], object]:
    """One sequence's prefill of ``tokens`` text tokens into a cache of its own, ready to call repeatedly."""
    blocks, block_size = -(-tokens // 16), 16
    kv = PagedKVCache.for_model(model, blocks + 1, block_size)
    layout = BatchLayout.build([tokens], [tokens], [list(range(blocks))], block_size, model.device)
    embeds, positions = model.embed(torch.arange(tokens) % 1000 + 10), torch.arange(tokens).expand(3, -1)
    return functools.partial(paged_forward, model, embeds, positions, layout, kv, None, paged_attention, layers)


def prefill_graph_call(model: LanguageModel, graphs: StepGraphs, tokens: int) -> Callable[[], object]:
    """One sequence's prefill of ``tokens`` text tokens replayed from the mixed graphs, as the engine runs
    a step of up to ``graph_tokens`` tokens (embedding lookup and staging included)."""
    block_size = graphs.kv.block_size
    blocks = -(-tokens // block_size)
    ids = torch.arange(tokens) % 1000 + 10
    inputs = StepInputs(
        positions=np.broadcast_to(np.arange(tokens, dtype=np.int64), (3, tokens)),
        slots=np.arange(tokens, dtype=np.int64),
        query_lens=[tokens],
        context_lens=[tokens],
        block_tables=[list(range(blocks))],
        rows=[tokens - 1],
    )
    return lambda: graphs.mixed(inputs, model.embed(ids))


def bench_prefill(model: LanguageModel, lengths: list[int], layers: list[FusedLayer] | None) -> list[dict[str, Any]]:
    """Eager (``paged_forward``) and, with fused layers, replayed from mixed graphs sized to the longest."""
    graphs = None
    if layers is not None:
        blocks = -(-max(lengths) // 16)
        kv = PagedKVCache.for_model(model, blocks + 1, 16)
        graphs = StepGraphs(
            model,
            kv,
            max_seqs=1,
            max_tokens=max(lengths),
            max_context=max(lengths),
            scratch_block=blocks,
            attention=paged_attention,
            fused=layers,
            capture=True,
        )
    rows = []
    for n in lengths:
        ms = cuda_time_ms(prefill_call(model, n, layers), 5)
        roof = prefill_roofline_ms(model, n)
        row: dict[str, Any] = {"tokens": n, "ms": ms, "roofline_ms": roof}
        line = f"prefill {n:5d} tokens: {ms:.2f} ms"
        if graphs is not None:
            row["graph_ms"] = cuda_time_ms(prefill_graph_call(model, graphs, n), 10)
            row["graph_tokens"] = next(t for t in graphs.token_sizes if t >= n)
            line += f", graph {row['graph_ms']:.2f} ms (padded to {row['graph_tokens']})"
        rows.append(row)
        print(f"{line} (roofline {roof:.2f} ms)", flush=True)
    del graphs
    torch.cuda.empty_cache()
    return rows


def bench_engine(
    model: LanguageModel,
    spec: ModelSpec,
    batch: int,
    prompt: int,
    new: int,
    overlap: bool = True,
    server: EngineConfig | None = None,
) -> dict[str, Any]:
    """The real engine's wall time per decode step; its kernels, fusion and graphs are ``server``'s (the
    decoder's choice for this model, `EngineConfig.from_settings`), Triton with fused layers and graphs if None."""
    block_size = 16
    blocks = batch * (-(-(prompt + new) // block_size) + 1) + 1
    config = EngineConfig(
        max_model_len=prompt + new + 1,
        max_running=max(batch, 1),
        prefill_budget=8192,
        num_blocks=blocks,
        block_size=block_size,
        prefix_cache=False,
        attention=server.attention if server else paged_attention,
        fuse=server.fuse if server else True,
        graphs=server.graphs if server else "cuda",
        graph_tokens=2048,
        overlap=overlap,
    )
    engine = Engine(model, spec, config)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        ids = [(7 * j + i) % 5000 + 10 for j in range(prompt)]
        engine.add(engine.prepare(PreparedRequest(f"r{i}", ids, [], params)))
    times = []
    while engine.has_work():
        engine.step()
        times.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(times[1:])]  # decode steps only (step 0 is the prefill)
    gaps.sort()
    result = {
        "batch": batch,
        "prompt": prompt,
        "new_tokens": new,
        "steps": len(times),
        "graph_steps": engine.counters["graph_steps"],
        "overlap": overlap,
        "overlapped_steps": engine.counters["overlapped_steps"],
        "fused": config.fuse,
        "mean_step_ms": 1e3 * sum(gaps) / len(gaps),
        "p50_step_ms": 1e3 * gaps[len(gaps) // 2],
        "p99_step_ms": 1e3 * gaps[int(len(gaps) * 0.99)],
    }
    print(
        f"engine b={batch}: {result['mean_step_ms']:.3f} ms per decode step (p50 {result['p50_step_ms']:.3f}, "
        f"p99 {result['p99_step_ms']:.3f}), {result['graph_steps']:.0f}/{len(times)} steps in graphs, "
        f"{result['overlapped_steps']:.0f} overlapped",
        flush=True,
    )
    return result


def bench_hf(model_dir: Path, decode_grid: list[tuple[int, int]], prefills: list[int]) -> dict[str, Any]:
    from transformers import AutoModelForImageTextToText, DynamicCache

    # The class of the checkpoint's model_type (Qwen2VL..., Qwen2_5_VL..., Qwen3VLForConditionalGeneration).
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda().eval()
    out: dict[str, Any] = {"decode": [], "prefill": []}
    with torch.inference_mode():
        for batch, context in decode_grid:
            ids = (torch.arange(batch * context, device="cuda") % 1000 + 10).view(batch, context)
            cache = DynamicCache()
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            step = torch.full((batch, 1), 17, device="cuda")
            ms = cuda_time_ms(functools.partial(_hf_decode_step, model, step, cache, context), 10)
            out["decode"].append({"batch": batch, "context": context, "ms": ms})
            print(f"hf decode b={batch:3d} ctx={context:5d}: {ms:.2f} ms", flush=True)
        for n in prefills:
            ids = (torch.arange(n, device="cuda") % 1000 + 10).view(1, n)
            ms = cuda_time_ms(functools.partial(model, input_ids=ids, use_cache=False), 5)
            out["prefill"].append({"tokens": n, "ms": ms})
            print(f"hf prefill {n:5d} tokens: {ms:.2f} ms", flush=True)
    return out


def _hf_decode_step(model: Any, step: torch.Tensor, cache: Any, context: int) -> None:
    model(input_ids=step, past_key_values=cache, use_cache=True)
    cache.crop(context)  # back to the same context for the next step


def profile_prefill(model: LanguageModel, tokens: int) -> None:
    """Where the host time of an eager fused prefill goes (the GPU waits on it when launches dominate)."""
    import cProfile
    import pstats

    forward = prefill_call(model, tokens, fuse_layers(model))
    print(f"eager fused prefill of {tokens} tokens: {cuda_time_ms(forward, 5):.2f} ms", flush=True)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        forward()
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def time_decode_graph(
    model: LanguageModel, mix: list[tuple[int, int]], max_context: int, profile_kernels: bool, block_size: int = 16
) -> None:
    """GPU time of one decode-graph replay whose sequences are ``mix``'s (count, context) groups, in graphs
    captured for ``max_context`` (the server captures for max_model_len, which fixes the split count);
    with ``profile_kernels``, the time per kernel too (torch.profiler sees the kernels a graph launches)."""
    from benchmarks.mixed_step import blocks_needed, print_kernels, step_inputs  # (it imports this module)

    step = [(1, context + 1) for count, context in mix for _ in range(count)]
    batch, blocks = len(step), blocks_needed([step], block_size)
    kv = PagedKVCache.for_model(model, blocks + 1, block_size)
    graphs = StepGraphs(
        model,
        kv,
        max_seqs=batch,
        max_tokens=0,
        max_context=max(max_context, max(context for _, context in step)),
        scratch_block=blocks,
        attention=paged_attention,
        fused=fuse_layers(model),
        capture=True,
    )
    inputs = step_inputs(step, block_size)
    shape = " + ".join(f"{count}x{context}" for count, context in mix)
    ms = cuda_time_ms(lambda: graphs.decode(inputs, [17] * batch), 50)
    print(f"decode {shape} (graph max context {graphs.max_context}, block size {block_size}): {ms:.3f} ms", flush=True)
    if profile_kernels:
        print_kernels(lambda: graphs.decode(inputs, [17] * batch))


def parse_mix(text: str) -> list[tuple[int, int]]:
    """``COUNTxCONTEXT[+COUNTxCONTEXT...]``: that many sequences of that context length, group by group."""
    mix = []
    for group in text.split("+"):
        count, _, context = group.partition("x")
        try:
            mix.append((int(count), int(context)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected COUNTxCONTEXT[+COUNTxCONTEXT...], got {text!r}") from None
    return mix


def add_decode_kernel_options(parser: argparse.ArgumentParser) -> None:
    """The decode kernels' settings a benchmark can compare (this and engine_mixed)."""
    parser.add_argument(
        "--decode-tiles", type=Path, help="decode attention's tile shape: the best of a benchmarks.kernels sweep"
    )


def use_decode_kernel_options(args: argparse.Namespace) -> None:
    """Set them process-wide, as the server's module settings would be."""
    if args.decode_tiles:
        attention_triton.DECODE_TILES = attention_triton.Tiles(**json.loads(args.decode_tiles.read_text())["best"])
        print(f"decode tiles: {attention_triton.DECODE_TILES}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="fewer shapes and steps")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--profile", action="store_true", help="only: cProfile of one eager 820-token prefill")
    parser.add_argument("--profile-decode", action="store_true", help="only: kernels of one decode graph")
    parser.add_argument("--time-decode", action="store_true", help="only: time one decode graph (no profile)")
    parser.add_argument(
        "--decode-mix",
        type=parse_mix,
        nargs="+",
        default=[[(1, 1000)]],
        metavar="COUNTxCONTEXT[+...]",
        help="decode graphs for --profile-decode/--time-decode, one per argument, e.g. 32x1100 32x1100+3x3100",
    )
    parser.add_argument(
        "--split-programs-per-sm",
        type=int,
        nargs="+",
        default=[attention_triton.SPLIT_PROGRAMS_PER_SM],
        help="decode attention's split target (programs per SM), each tried on each --decode-mix",
    )
    parser.add_argument("--graph-max-context", type=int, default=0, help="captured for this context (the split count)")
    parser.add_argument(
        "--block-size", type=int, default=DecoderConfig().block_size, help="KV block size of --time/profile-decode"
    )
    parser.add_argument("--device", default="cuda", help="cuda; cpu: a smoke run of engine_tpot alone (tests)")
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATION_SETTINGS,
        help="the language model's weights as [model] quantization serves them (fp8: quantized at load)",
    )
    add_decode_kernel_options(parser)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("benchmarks.engine needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    use_decode_kernel_options(args)
    spec = read_spec(args.model, args.quantization)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    family = checkpoint_family(args.model, args.quantization)
    model = family.language_model(args.model, device=device, dtype=dtype, spec=spec)
    # What the decoder process would run this model with on this device (fused layers, graphs, attention).
    server = EngineConfig.from_settings(DecoderConfig(), device, 1, 1)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    results: dict[str, Any] = {"model": str(args.model), "model_type": spec.model_type, "device": name}
    quantization = spec.quantization
    results["quantization"] = (
        None
        if quantization is None
        else f"{quantization.method}" + ("" if quantization.in_checkpoint else " (quantized at load)")
    )
    results["server_kernels"] = {"fuse": server.fuse, "graphs": server.graphs}
    if device.type != "cuda":
        results["engine_tpot"] = [bench_engine(model, spec, b, 24, 4, True, server) for b in (1, 2)]
        args.out.write_text(json.dumps(results, indent=1))
        print(f"wrote {args.out}")
        return
    if args.profile:
        profile_prefill(model, 820)
        return
    if args.profile_decode or args.time_decode:
        for per_sm, mix in itertools.product(args.split_programs_per_sm, args.decode_mix):
            attention_triton.SPLIT_PROGRAMS_PER_SM = per_sm
            print(f"split target: {per_sm} programs per SM", flush=True)
            time_decode_graph(model, mix, args.graph_max_context, args.profile_decode, args.block_size)
        return
    grid = (
        [(1, 1000), (32, 1000), (64, 3000)]
        if args.quick
        else [(1, 1000), (1, 3000), (8, 1000), (32, 1000), (32, 3000), (64, 1000), (64, 3000)]
    )
    prefills = [820, 2800]
    results["language_weight_bytes"] = language_bytes(model)
    if server.fuse and server.graphs == "cuda":
        results["prefill_unfused"] = bench_prefill(model, prefills, None)
        fused = fuse_layers(model)
        results["prefill"] = bench_prefill(model, prefills, fused)
        results["decode"] = bench_decode(model, fused, grid, repeats=20 if args.quick else 50)
    else:
        results["skipped"] = f"decode graphs and prefills: the decoder runs {spec.model_type} unfused, without graphs"
        print(results["skipped"], flush=True)
    new = 64 if args.quick else 256
    runs = [(1, True), (32, True), (1, False), (32, False)]
    results["engine_tpot"] = [bench_engine(model, spec, b, 820, new, overlap, server) for b, overlap in runs]
    del model
    torch.cuda.empty_cache()
    if not args.skip_hf:
        try:
            results["hf"] = bench_hf(args.model, [(1, 1000), (32, 1000)], prefills)
        except Exception as exc:  # the baseline failing must not lose our own figures
            results["hf_error"] = repr(exc)
            print(f"transformers baseline failed: {exc!r}", flush=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
