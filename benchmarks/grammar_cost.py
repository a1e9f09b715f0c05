"""What a grammar library costs on the host: schema compile time and the per-step token bitmask fill.

    python -m benchmarks.grammar_cost --checkpoint CKPT [--repetitions 50] [--steps 200] [--rows 8,32] \\
        [--out grammar_cost.json]

On `benchmarks.schemas`' schemas with the checkpoint's tokenizer.json, for llguidance (what the server uses)
and, where ``import xgrammar`` works (vLLM's environment), xgrammar beside it:

- compile: a schema to a matcher ready to fill its first mask, ``--repetitions`` times per schema, each a
  fresh compile (a unique ``description`` per repetition, and xgrammar's cache off: nothing is reused). The
  first mask is timed apart: llguidance compiles lazily, so part of its cost lands there; xgrammar
  precomputes at compile. ``ready`` is the two together, the fair comparison.
- mask: ``--rows`` constrained rows (8 and 32) walking through the schemas' valid answers (a row that
  finishes starts again), each step filling an int32 bitmask of all rows as the decoder does it
  (llguidance's ``fill_next_token_bitmask_par`` on its thread pool; xgrammar one row after another, as
  vLLM's xgrammar backend does for small batches, and its batched matcher too where the version has one),
  then feeding every row its next token (``consume``, timed apart).

Both libraries generate compact JSON here (no free whitespace), as the server does. Writes the figures as
JSON and prints a table. Only llguidance, torch (and xgrammar, transformers for its tokenizer) are
imported, so vLLM's Python can run it too (`benchmarks.gpu grammar`).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llguidance
import llguidance.torch
import numpy as np
import torch

from benchmarks.schemas import CASES, SchemaCase

Stats = dict[str, float]


def stats_ms(seconds: list[float]) -> Stats:
    values = np.asarray(seconds) * 1e3
    return {
        "n": len(values),
        "mean": float(values.mean()),
        "p50": float(np.percentile(values, 50)),
        "p99": float(np.percentile(values, 99)),
        "max": float(values.max()),
    }


def unique_schema(case: SchemaCase, repetition: int) -> dict[str, Any]:
    """The schema with a description of its own: no compiled grammar of an earlier repetition can be reused."""
    return {**copy.deepcopy(case.schema), "description": f"{case.name} compile {repetition} {time.time_ns()}"}


# --------------------------------------------------------------------------------------- the checkpoint
def checkpoint_tokens(checkpoint: Path) -> tuple[Path, int, list[int]]:
    """(tokenizer.json, the model's vocabulary size, its end-of-sequence ids), as the decoder takes them."""
    tokenizer_json = checkpoint / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise SystemExit(f"{checkpoint} has no tokenizer.json")
    config = json.loads((checkpoint / "config.json").read_text())
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    eos: Any = None
    generation = checkpoint / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
    eos = eos if eos is not None else config.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if vocab is None:
        raise SystemExit(f"{checkpoint}/config.json names no vocab_size")
    return tokenizer_json, int(vocab), eos_ids


# --------------------------------------------------------------------------------------- llguidance
def llguidance_grammar(schema: dict[str, Any]) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def llguidance_cost(tokenizer_json: Path, vocab: int, eos: list[int], args: argparse.Namespace) -> dict[str, Any]:
    try:
        tokenizer = llguidance.LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab, eos_token=eos or None)
    except TypeError:  # (older versions, vLLM 0.22's among them maybe, take one EOS id only)
        tokenizer = llguidance.LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab, eos_token=eos[0])
    mask = torch.empty(llguidance.torch.get_bitmask_shape(1, vocab), dtype=torch.int32)
    compile_s: dict[str, list[float]] = {}
    first_s: dict[str, list[float]] = {}
    for case in CASES:
        for repetition in range(args.repetitions):
            schema = unique_schema(case, repetition)
            started = time.perf_counter()
            matcher = llguidance.LLMatcher(tokenizer, llguidance_grammar(schema), log_level=0)
            if matcher.is_error():
                raise RuntimeError(f"llguidance cannot compile {case.name}: {matcher.get_error()}")
            compiled = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
            compile_s.setdefault(case.name, []).append(compiled - started)
            first_s.setdefault(case.name, []).append(time.perf_counter() - compiled)
    fresh = {case.name: llguidance.LLMatcher(tokenizer, llguidance_grammar(case.schema), log_level=0) for case in CASES}
    answers = {case.name: tokenizer.tokenize_str(case.example_text()) for case in CASES}

    def parallel(executor: Any) -> Callable[[list[Any], torch.Tensor], None]:
        def fill(matchers: list[Any], bitmask: torch.Tensor) -> None:
            llguidance.torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

        return fill

    def serial(matchers: list[Any], bitmask: torch.Tensor) -> None:
        for i, matcher in enumerate(matchers):
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, i)

    fill = parallel(llguidance.LLExecutor())  # (the server's way: the executor's own thread count)

    def consume(matcher: Any, token: int) -> None:
        if not matcher.consume_token(token) or matcher.is_error():
            raise RuntimeError(f"llguidance refused token {token} of a valid answer: {matcher.get_error()}")

    def start(name: str) -> Any:
        return fresh[name].deep_copy()

    def walks(filler: Callable[[list[Any], torch.Tensor], None]) -> dict[str, Any]:
        return {str(rows): walk(rows, args.steps, vocab, answers, start, filler, consume) for rows in args.rows}

    # The same walks filled one row after another, and on executors of a set thread count: whether the
    # parallel fill spreads the rows over the cores at all.
    by_threads = {str(n): walks(parallel(llguidance.LLExecutor(num_threads=n))) for n in args.llguidance_threads}
    return {
        "version": _version("llguidance"),
        **compile_figures(compile_s, first_s),
        "steps": walks(fill),
        "steps_serial": walks(serial),
        "steps_by_threads": by_threads,
    }


# --------------------------------------------------------------------------------------- xgrammar
def xgrammar_cost(checkpoint: Path, vocab: int, eos: list[int], args: argparse.Namespace) -> dict[str, Any]:
    try:
        import xgrammar as xgr
    except ImportError as exc:
        return {"skipped": f"xgrammar is not installed in this Python ({exc})"}
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab, stop_token_ids=eos or None)
    compiler = xgr.GrammarCompiler(info, max_threads=args.xgrammar_threads, cache_enabled=False)

    def compile_schema(schema: dict[str, Any]) -> Any:
        return compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=True
        )

    mask = xgr.allocate_token_bitmask(1, vocab)
    compile_s: dict[str, list[float]] = {}
    first_s: dict[str, list[float]] = {}
    for case in CASES:
        for repetition in range(args.repetitions):
            started = time.perf_counter()
            matcher = xgr.GrammarMatcher(compile_schema(unique_schema(case, repetition)))
            compiled = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            compile_s.setdefault(case.name, []).append(compiled - started)
            first_s.setdefault(case.name, []).append(time.perf_counter() - compiled)
    grammars = {case.name: compile_schema(case.schema) for case in CASES}
    answers = {case.name: hf_tokenizer.encode(case.example_text(), add_special_tokens=False) for case in CASES}

    def consume(matcher: Any, token: int) -> None:
        if not matcher.accept_token(token):
            raise RuntimeError(f"xgrammar refused token {token} of a valid answer")

    def fill_serial(matchers: list[Any], bitmask: torch.Tensor) -> None:
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)

    def start(name: str) -> Any:
        return xgr.GrammarMatcher(grammars[name])

    result: dict[str, Any] = {
        "version": _version("xgrammar"),
        **compile_figures(compile_s, first_s),
        "steps": {str(rows): walk(rows, args.steps, vocab, answers, start, fill_serial, consume) for rows in args.rows},
    }
    batch = getattr(xgr, "BatchGrammarMatcher", None)
    if batch is not None:  # (newer versions: one call fills every row on its own threads)
        try:
            batched = batch(max_threads=args.xgrammar_threads)

            def fill_batched(matchers: list[Any], bitmask: torch.Tensor) -> None:
                batched.batch_fill_next_token_bitmask(matchers, bitmask)

            result["steps_batched"] = {
                str(rows): walk(rows, args.steps, vocab, answers, start, fill_batched, consume) for rows in args.rows
            }
        except (TypeError, AttributeError, RuntimeError) as exc:
            result["steps_batched"] = {"skipped": f"{type(exc).__name__}: {exc}"}
    return result


# --------------------------------------------------------------------------------------- shared
def compile_figures(compile_s: dict[str, list[float]], first_s: dict[str, list[float]]) -> dict[str, Any]:
    ready = {name: [a + b for a, b in zip(compile_s[name], first_s[name], strict=True)] for name in compile_s}
    every = {
        "compile_ms": stats_ms([t for times in compile_s.values() for t in times]),
        "first_mask_ms": stats_ms([t for times in first_s.values() for t in times]),
        "ready_ms": stats_ms([t for times in ready.values() for t in times]),
    }
    per_schema = {
        name: {"compile_ms": stats_ms(compile_s[name]), "ready_ms": stats_ms(ready[name])} for name in compile_s
    }
    return {**every, "per_schema": per_schema}


def walk(
    rows: int,
    steps: int,
    vocab: int,
    answers: dict[str, list[int]],
    start: Callable[[str], Any],
    fill: Callable[[list[Any], torch.Tensor], None],
    consume: Callable[[Any, int], None],
) -> dict[str, Any]:
    """``rows`` matchers, row i on schema ``CASES[i % len(CASES)]`` and started part way into its answer (rows at
    different places, as in a running batch), for ``steps`` steps: fill every row's mask, then feed each row its
    next token; a row at the end of its answer starts it again."""
    names = [CASES[i % len(CASES)].name for i in range(rows)]
    matchers = [start(name) for name in names]
    positions = []
    for i, (name, matcher) in enumerate(zip(names, matchers, strict=True)):
        offset = (7 * i) % len(answers[name])
        for token in answers[name][:offset]:
            consume(matcher, token)
        positions.append(offset)
    bitmask = torch.empty(llguidance.torch.get_bitmask_shape(rows, vocab), dtype=torch.int32)
    fill_s, consume_s = [], []
    for _ in range(steps):
        started = time.perf_counter()
        fill(matchers, bitmask)
        filled = time.perf_counter()
        for i, name in enumerate(names):
            consume(matchers[i], answers[name][positions[i]])
            positions[i] += 1
            if positions[i] == len(answers[name]):
                matchers[i], positions[i] = start(name), 0
        consume_s.append(time.perf_counter() - filled)
        fill_s.append(filled - started)
    return {"fill_ms": stats_ms(fill_s), "consume_ms": stats_ms(consume_s)}


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer_json, vocab, eos = checkpoint_tokens(args.checkpoint)
    results: dict[str, Any] = {
        "config": {
            "checkpoint": str(args.checkpoint),
            "vocab_size": vocab,
            "eos_token_ids": eos,
            "repetitions": args.repetitions,
            "steps": args.steps,
            "rows": args.rows,
            "schemas": [case.name for case in CASES],
            "torch": torch.__version__,
            "python": platform.python_version(),
            "hostname": socket.gethostname(),
        },
        "llguidance": llguidance_cost(tokenizer_json, vocab, eos, args),
    }
    if args.no_xgrammar:
        results["xgrammar"] = {"skipped": "--no-xgrammar"}
        return results
    try:
        results["xgrammar"] = xgrammar_cost(args.checkpoint, vocab, eos, args)
    except Exception as exc:  # (another version's API, say: llguidance's figures are kept, the failure named)
        results["xgrammar"] = {"skipped": f"xgrammar failed: {type(exc).__name__}: {exc}"}
    return results


def table(results: dict[str, Any]) -> list[str]:
    """One line per library: compile and ready p50/p99/max, the mask fill's p50/p99 per row count."""
    rows = results["config"]["rows"]
    head = "library      compile p50/p99/max ms   ready p50/p99/max ms  " + "".join(
        f"  fill {r} rows p50/p99 ms" for r in rows
    )
    lines = [head]
    for library in ("llguidance", "xgrammar"):
        figures = results[library]
        if "skipped" in figures:
            lines.append(f"{library:<12} skipped: {figures['skipped']}")
            continue
        line = f"{library:<12}"
        for key in ("compile_ms", "ready_ms"):
            line += "".join(f" {figures[key][stat]:7.2f}" for stat in ("p50", "p99", "max")) + " "
        for count in rows:
            fill = figures["steps"][str(count)]["fill_ms"]
            line += f"   {fill['p50']:9.3f} {fill['p99']:9.3f}"
        lines.append(line)
    variants = {"serial": results["llguidance"].get("steps_serial")}
    for threads, steps in results["llguidance"].get("steps_by_threads", {}).items():
        variants[f"{threads} threads"] = steps
    for name, steps in variants.items():
        if steps:
            fills = "".join(
                f"   {steps[str(c)]['fill_ms']['p50']:9.3f} {steps[str(c)]['fill_ms']['p99']:9.3f}" for c in rows
            )
            lines.append(f"  llguidance fill, {name:<10}{' ' * 35}{fills}")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grammar_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="a checkpoint directory with tokenizer.json")
    p.add_argument("--repetitions", type=int, default=50, help="fresh compiles per schema")
    p.add_argument("--steps", type=int, default=200, help="mask steps per row count")
    p.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[8, 32], help="a comma list")
    p.add_argument(
        "--llguidance-threads",
        type=lambda s: [int(n) for n in s.split(",") if n],
        default=[1, 4, 8],
        help="llguidance executors of these thread counts, beside its default one (a comma list; '' for none)",
    )
    p.add_argument("--xgrammar-threads", type=int, default=8, help="xgrammar's compiler and batch threads")
    p.add_argument("--no-xgrammar", action="store_true", help="measure llguidance only")
    p.add_argument("--out", type=Path, default=Path("grammar_cost.json"))
    args = p.parse_args(argv)
    if args.repetitions <= 0 or args.steps <= 0 or not args.rows or min(args.rows) <= 0:
        p.error("--repetitions, --steps and every --rows must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(table(results)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
