"""Summary statistics and the PNG plot of a run's per-request records.

Records are the plain dicts ``serve`` writes (times in seconds, relative to the run start), so a
saved results file can be re-summarised or re-plotted: ``python -m benchmarks.report results.json``
(or ``.json.gz``, as results are committed). With ``--control CONTROL.json`` it compares instead: how
the text streams of a ``mixed`` run fared against the same streams alone.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

Record = dict[str, Any]

# The metrics every summary block reports, each as mean/p50/p99 in milliseconds.
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default, as vLLM and SGLang report); None when empty."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def mean(values: Sequence[float]) -> float | None:
    return float(np.mean(np.asarray(values, dtype=float))) if len(values) else None


def time_per_output_token(ttft_s: float | None, e2e_s: float | None, output_tokens: int | None) -> float | None:
    """Decode time per token after the first: chunks may carry several tokens, so divide by tokens."""
    if ttft_s is None or e2e_s is None or not output_tokens or output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


def _ms(values: Iterable[float]) -> list[float]:
    return [v * 1000.0 for v in values]


def latency_block(name: str, values_s: Iterable[float]) -> dict[str, float | None]:
    values = _ms(values_s)
    return {
        f"mean_{name}_ms": mean(values),
        f"p50_{name}_ms": percentile(values, 50),
        f"p99_{name}_ms": percentile(values, 99),
    }


def _span(records: Sequence[Record]) -> float:
    if not records:
        return 0.0
    return max(r["end_s"] for r in records) - min(r["start_s"] for r in records)


def _status_label(record: Record) -> str:
    if not record.get("sent", True):
        return "not_sent"  # a later turn of a session whose earlier turn failed
    # No status: the connection failed or timed out before the server answered.
    return str(record["status"] or "no_response")


def summarize(records: Sequence[Record], duration_s: float | None = None) -> dict[str, Any]:
    """The headline numbers; throughputs are over ``duration_s`` (default: the records' own span)."""
    ok = [r for r in records if r["error"] is None]
    failed = [r for r in records if r["error"] is not None]
    duration = _span(records) if duration_s is None else duration_s
    output_tokens = sum(r["output_tokens"] or 0 for r in ok)
    summary: dict[str, Any] = {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(failed),
        "error_statuses": dict(Counter(_status_label(r) for r in failed)),
        "duration_s": duration,
        "requests_per_s": len(ok) / duration if duration > 0 else None,
        "output_tokens_per_s": output_tokens / duration if duration > 0 else None,
        "total_prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "total_output_tokens": output_tokens,
    }
    summary.update(latency_block("ttft", [r["ttft_s"] for r in ok if r["ttft_s"] is not None]))
    summary.update(latency_block("tpot", [r["tpot_s"] for r in ok if r["tpot_s"] is not None]))
    summary.update(latency_block("itl", [gap for r in ok for gap in r["itl_s"]]))
    summary.update(latency_block("e2e", [r["e2e_s"] for r in ok if r["e2e_s"] is not None]))
    return summary


def group_records(records: Sequence[Record], key: str) -> dict[str, list[Record]]:
    """Records by the value of tag ``key`` (as a string, JSON's only key type), in sorted order."""
    groups: dict[str, list[Record]] = {}
    for record in records:
        if key in record["tags"]:
            groups.setdefault(str(record["tags"][key]), []).append(record)
    return dict(sorted(groups.items()))


def summarize_run(records: Sequence[Record], duration_s: float, group_by: Sequence[str] = ()) -> dict[str, Any]:
    """The whole run's summary plus one block per value of each tag in ``group_by``."""
    summary = summarize(records, duration_s)
    if group_by:
        summary["groups"] = {
            key: {value: summarize(group) for value, group in group_records(records, key).items()} for key in group_by
        }
    return summary


def token_timeline(records: Sequence[Record], bin_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens/s in bins of ``bin_s``: each content chunk's tokens land at its arrival time.

    A chunk's token count is not on the wire, so a request's tokens are spread evenly over its chunks.
    """
    times: list[float] = []
    weights: list[float] = []
    for r in records:
        if r["error"] is not None or r["ttft_s"] is None or not r["output_tokens"]:
            continue
        arrivals = r["start_s"] + r["ttft_s"] + np.concatenate([[0.0], np.cumsum(r["itl_s"])])
        times.extend(arrivals.tolist())
        weights.extend([r["output_tokens"] / len(arrivals)] * len(arrivals))
    if not times:
        return np.zeros(0), np.zeros(0)
    edges = np.arange(0.0, max(times) + bin_s, bin_s)
    counts, edges = np.histogram(times, bins=edges, weights=weights)
    return edges[:-1] + bin_s / 2, counts / bin_s


def _cdf(ax: Any, series: dict[str, list[float]], title: str, log: bool = False) -> None:
    for label, values in series.items():
        if values:
            xs = np.sort(values)
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), drawstyle="steps-post", label=f"{label} (n={len(xs)})")
    if log:  # stalls are orders of magnitude above the median: a linear axis hides the body
        ax.set_xscale("symlog", linthresh=1.0)
    ax.set_title(title)
    ax.set_xlabel("ms (log above 1 ms)" if log else "ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)
    if any(series.values()):
        ax.legend(fontsize=7)


def plot(records: Sequence[Record], path: Path, title: str, group_by: str | None = None) -> None:
    """TTFT, ITL and e2e CDFs, and output tokens/s over time; one line per group when grouped."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    import matplotlib.pyplot as plt

    groups = group_records(records, group_by) if group_by else {}
    groups = groups or {"all": list(records)}
    ok = {name: [r for r in group if r["error"] is None] for name, group in groups.items()}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    _cdf(axes[0][0], {n: _ms(r["ttft_s"] for r in g if r["ttft_s"] is not None) for n, g in ok.items()}, "TTFT CDF")
    _cdf(
        axes[0][1],
        {n: _ms(x for r in g for x in r["itl_s"]) for n, g in ok.items()},
        "inter-chunk latency CDF",
        log=True,
    )
    _cdf(axes[1][0], {n: _ms(r["e2e_s"] for r in g if r["e2e_s"] is not None) for n, g in ok.items()}, "e2e CDF")
    ax = axes[1][1]
    end = max((r["end_s"] for r in records), default=1.0)
    bin_s = max(0.25, end / 60)  # ~60 points whatever the run length
    # Groups keep the CDFs' colours (the default cycle, same order); the total is drawn apart in black.
    for name, group in groups.items() if len(groups) > 1 else ():
        ax.plot(*token_timeline(group, bin_s), label=name)
    ax.plot(*token_timeline(records, bin_s), color="black", linestyle="--", label="all")
    ax.set_title(f"output tokens/s over time ({bin_s:.2g}s bins)")
    ax.set_xlabel("s since start")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def load_results(path: Path) -> dict[str, Any]:
    """A results file as ``serve`` wrote it, or gzipped (``.json.gz``)."""
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)


def isolation(mixed: dict[str, Any], control: dict[str, Any], kind: str = "text") -> dict[str, float | None]:
    """The ``kind`` streams of a mixed run against a control run of such streams alone (issue 5's
    acceptance 6: the share of throughput they keep, and how much their ITL p99 grows)."""

    def streams(run: dict[str, Any]) -> dict[str, Any]:
        summary: dict[str, Any] = run["summary"]
        return summary.get("groups", {}).get("stream_kind", {}).get(kind, summary)

    m, c = streams(mixed), streams(control)

    def ratio(key: str) -> float | None:
        return m[key] / c[key] if m.get(key) is not None and c.get(key) else None

    return {
        "throughput_share": ratio("output_tokens_per_s"),
        "itl_p99_ratio": ratio("p99_itl_ms"),
        "ttft_mean_ratio": ratio("mean_ttft_ms"),
        **{f"mixed_{k}": m.get(k) for k in ("output_tokens_per_s", "p99_itl_ms", "mean_ttft_ms")},
        **{f"control_{k}": c.get(k) for k in ("output_tokens_per_s", "p99_itl_ms", "mean_ttft_ms")},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Re-summarise and re-plot a benchmarks.serve results file.")
    parser.add_argument("results", type=Path)
    parser.add_argument("--group-by", default=None, help="a request tag to split by (e.g. stream_kind, turn)")
    parser.add_argument("--control", type=Path, default=None, help="compare a mixed run's text streams with this")
    args = parser.parse_args(argv)
    data = load_results(args.results)
    if args.control is not None:
        print(json.dumps(isolation(data, load_results(args.control)), indent=2))
        return
    records = data["requests"]
    group_by = [args.group_by] if args.group_by else data["config"].get("group_by", [])
    summary = summarize_run(records, data["summary"]["duration_s"], group_by)
    print(json.dumps(summary, indent=2))
    try:
        plot(records, args.results.with_name(args.results.name.split(".")[0] + ".png"), str(args.results),
             group_by[0] if group_by else None)  # fmt: skip
    except ImportError as exc:  # the figures above stand without the plot
        print(f"no plot: {exc} (pip install matplotlib)", file=sys.stderr)


if __name__ == "__main__":
    main()
