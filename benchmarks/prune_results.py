"""Reduce a GPU run's folder to the record that is committed: README/summary, summary JSONs, no raw data.

`python -m benchmarks.prune_results benchmarks/results/RUN [...]` rewrites each run folder in place:

- `benchmarks.serve` results (`.json` or `.json.gz`) keep `config` and `summary`; per-request records
  (`requests`, `answers`, `batches`) are dropped from every JSON, which is written uncompressed.
- Logs that a README in the folder names, and the outputs of test and benchmark tools (pytest, kernel and engine
  benchmarks, parity comparisons, probes), are excerpted into `summary.md` beside the README.
- Everything else that is raw (process logs, `nvidia-smi dmon` and `top` traces, `/metrics` dumps, `raw/`) is deleted.

`benchmarks.gpu` calls `summarise_json` on the summary it keeps, and writes raw data under `raw/`, which is
git-ignored, so a new run needs no pruning.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
from collections import Counter
from pathlib import Path

# (with `vllm bench serve --save-result`'s per-request arrays)
PER_REQUEST_KEYS = frozenset(
    {"requests", "answers", "batches", "input_lens", "output_lens", "ttfts", "itls", "generated_texts"}
)
RAW_SUFFIXES = (".log", ".out", ".dmon", ".top", ".metrics", ".txt", ".jsonl", ".png")
KEPT_NAMES = frozenset({"README.md", "summary.md", "run.sh", "machine.txt"})
# Logs that hold a tool's printed table or verdict rather than a process's trace.
TOOL_OUTPUT = re.compile(
    r"(pytest|bench|engine|vision|vit|times|profile|parity|compare|probe|sweep|green|deaths|sigkill|gemms|"
    r"prefill|decode|host_path|gateway_load|topo|machine|mps)",
    re.IGNORECASE,
)
# Processes' own logs (supervisord's programs, the driver's progress log): only their notable lines are kept.
PROCESS_LOG = re.compile(r"^(cache|decoder|encoder|fetcher|gateway|mps|supervisord|gpu|synth|run)[\w-]*\.(log|out)$")
NOTABLE = re.compile(
    r"WARNING|ERROR|CRITICAL|Traceback| ready |dead|restart|kill|signal|re-issu|sent again|silent|"
    r"not healthy|ended with status|RUNNING|exit"
)
EXCERPT_CHARS = 3000
SUMMARY_CHARS = 60_000


def summarise_json(data: object) -> object:
    """The JSON without its per-request records (at any depth)."""
    if isinstance(data, dict):
        return {key: summarise_json(value) for key, value in data.items() if key not in PER_REQUEST_KEYS}
    if isinstance(data, list):
        return [summarise_json(item) for item in data]
    return data


def load_json(path: Path) -> object:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return json.load(handle)


def write_summary_json(path: Path, data: object) -> Path:
    """Writes the summarised JSON next to `path` as plain `.json` and returns where."""
    target = path.with_suffix("") if path.suffix == ".gz" else path
    target.write_text(json.dumps(summarise_json(data), separators=(",", ":")) + "\n")
    return target


def excerpt(path: Path) -> str:
    """A log's text, or its head and tail where it is long; pytest logs by their verdict lines."""
    text = path.read_text(errors="replace")
    if PROCESS_LOG.match(path.name):
        notable = [line[:300] for line in text.splitlines() if NOTABLE.search(line)]
        return "\n".join(notable[:12])
    if path.name.startswith("pytest"):
        verdicts = [
            line for line in text.splitlines() if re.search(r"passed|failed|error|skipped|exit", line, re.IGNORECASE)
        ]
        return "\n".join(verdicts[-20:])
    if len(text) <= EXCERPT_CHARS:
        return text.rstrip()
    lines = text.splitlines()
    head, tail = "\n".join(lines[:15]), "\n".join(lines[-30:])
    return f"{head[: EXCERPT_CHARS // 3]}\n[...]\n{tail[-2 * EXCERPT_CHARS // 3 :]}"


def cited_names(run: Path) -> set[str]:
    """File names that the folder's READMEs mention."""
    names: set[str] = set()
    for readme in run.rglob("README.md"):
        names.update(re.findall(r"[\w./+-]+\.(?:log|txt|out|metrics|jsonl)\b", readme.read_text()))
    return names


def is_cited(rel: Path, cited: set[str], copies: int) -> bool:
    """Named by its path's tail (`tp2/decoder.log`), or by its bare name when the run has at most two such files."""
    for name in cited:
        if "/" in name and str(rel).endswith(name.split("OUT/")[-1].lstrip("./")):
            return True
        if "/" not in name and name == rel.name and copies <= 2:
            return True
    return False


def wants_excerpt(path: Path, rel: Path, cited: set[str], copies: int) -> bool:
    """Cited by the README, or a tool's output whose figures no JSON beside it holds."""
    if path.name.endswith((".dmon", ".top", ".png")):
        return False
    if is_cited(rel, cited, copies):
        return True
    has_json = any(path.with_name(path.stem + ext).exists() for ext in (".json", ".json.gz"))
    tool_output = not PROCESS_LOG.match(path.name) and bool(TOOL_OUTPUT.search(path.name))
    return path.suffix in (".log", ".txt", ".jsonl") and not has_json and tool_output


def is_raw(path: Path) -> bool:
    return path.name not in KEPT_NAMES and (path.name.endswith(RAW_SUFFIXES) or "raw" in path.parts)


def prune(run: Path) -> None:
    cited = cited_names(run)
    copies = Counter(p.name for p in run.rglob("*") if p.is_file())
    sections = []
    for path in sorted(p for p in run.rglob("*") if p.is_file()):
        rel = path.relative_to(run)
        if path.name.endswith((".json", ".json.gz")):
            target = write_summary_json(path, load_json(path))
            if target != path:
                path.unlink()
        elif is_raw(path):
            wanted = wants_excerpt(path, rel, cited, copies[path.name])
            if wanted:
                body = excerpt(path)
                if body:
                    sections.append(f"## `{rel}`\n\n```text\n{body}\n```\n")
            path.unlink()
    if sections:
        header = (
            "# Excerpts of this run's raw logs\n\nThe raw logs were deleted when the results were pruned to "
            "one record per run (`benchmarks/prune_results.py`); these are the lines the README's figures "
            "come from: tool outputs whole or head and tail, pytest verdicts.\n\n"
        )
        (run / "summary.md").write_text((header + "\n".join(sections))[:SUMMARY_CHARS])
    for folder in sorted((p for p in run.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if folder.name == "raw":
            shutil.rmtree(folder)
        elif not any(folder.iterdir()):
            folder.rmdir()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders under benchmarks/results/")
    for run in parser.parse_args().runs:
        prune(run)


if __name__ == "__main__":
    main()
