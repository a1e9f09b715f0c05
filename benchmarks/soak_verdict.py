"""A soak's verdict, from its records and samples alone (no I/O, so that it is tested on made-up series).

Requests. Each record gets one outcome:

- ``ok``: the answer the request asked for (2xx and complete; a client that hung up on purpose counts here once its
  connection closed), or a bad input answered with the 4xx it deserved;
- ``refused``: the gateway's own refusal at its limits (503, code ``server_busy``, with Retry-After): the overload
  run counts these, a soak reports them;
- ``chaos``: failed (5xx, an error inside the stream, a cut stream, a refused or reset connection) while a chaos
  event was near: one at most ``recovery_s`` before the request started or during it. Counted by the stage hit;
  they fail the run only with ``strict``;
- ``lost``: no answer by its deadline (the client gave up), or an answer that ended after it;
- ``unexpected``: any other failure (a 5xx far from any chaos, a 2xx to a bad input, a bad input's 5xx).

The run fails on any ``lost`` or ``unexpected``, and on ``chaos`` with ``strict``.

Resources. Every sampled series (each process's RSS and open fds, the stack's /dev/shm bytes, the decoder's KV
blocks in use, the cache daemon's leases and pending entries, each GPU's memory) is judged on its samples after the
warm-up and in the run's second half (a process may grow while its pools, caches and allocator arenas fill, then
plateau: only the later half says whether it keeps growing). A least-squares line through them gives a slope; the
growth it means over the whole run, ``slope x duration``, must stay within the series' tolerance:
``max(absolute, relative x the window's median)``. A process restarted by chaos starts a new series (its pid
changes); its first ``warmup_s`` seconds are left out like the run's. Fewer than ``MIN_POINTS`` samples in a window,
or a window under ``MIN_WINDOW_SHARE`` of the run (a process restarted late): not judged (said so). A process's RSS
is judged through its anonymous part where that is sampled (RSS also grows as the shared pool's pages are first
touched, bounded by /dev/shm's bytes, judged themselves). Load gauges (KV blocks, leases, pending entries) swing
with traffic: a leak shows also in what is left once traffic stops, so the run drains and they must come back to
zero (``idle``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

MIN_POINTS = 4
MIN_WINDOW_SHARE = 0.25  # of the run: the shortest window a series is judged on


@dataclass(frozen=True)
class Tolerance:
    absolute: float
    relative: float = 0.1


# By series kind (the part of its name before ":"): what growth over a whole run is still noise.
TOLERANCES: dict[str, Tolerance] = {
    "rss_mib": Tolerance(64.0, 0.1),
    "anon_mib": Tolerance(64.0, 0.1),  # (RSS less the shared pool's pages: what a leak would grow)
    "fds": Tolerance(16.0, 0.1),
    "shm_bytes": Tolerance(0.0, 0.05),
    "kv_blocks_used": Tolerance(16.0, 0.25),
    "cache_leased_requests": Tolerance(8.0, 0.25),
    "cache_pending_entries": Tolerance(8.0, 0.25),
    "gpu_mib": Tolerance(512.0, 0.05),
}
# Gauges that must read 0 once traffic has stopped and the stack has drained.
IDLE_ZERO = ("kv_blocks_used", "cache_leased_requests", "cache_pending_entries", "gateway_requests_in_flight")

Point = tuple[float, float]  # (run time in s, value)


def series(samples: list[dict[str, Any]]) -> dict[str, list[Point]]:
    """Every judged series by name (``rss_mib:decoder#1234``: a process's series is per pid, since a restarted
    process starts afresh)."""
    out: dict[str, list[Point]] = {}

    def add(name: str, t: float, value: float) -> None:
        out.setdefault(name, []).append((t, float(value)))

    for s in samples:
        t = s["t"]
        for name, p in s["processes"].items():
            add(f"rss_mib:{name}#{p['pid']}", t, p["rss_mib"])
            if "anon_mib" in p:  # (samples of runs before it was sampled have none)
                add(f"anon_mib:{name}#{p['pid']}", t, p["anon_mib"])
            add(f"fds:{name}#{p['pid']}", t, p["fds"])
        if s.get("shm_bytes") is not None:  # (None: the deployment's /dev/shm names are not known)
            add("shm_bytes", t, s["shm_bytes"])
        for key in ("kv_blocks_used", "cache_leased_requests", "cache_pending_entries"):
            if key in s["metrics"]:
                add(key, t, s["metrics"][key])
        for gpu, mib in s.get("gpu_mib", {}).items():
            add(f"gpu_mib:{gpu}", t, mib)
    return out


def growth(points: list[Point], window_start: float, duration_s: float, tolerance: Tolerance) -> dict[str, Any]:
    """Whether ``points`` grow without bound: the fitted slope over those at or after ``window_start``, the growth it
    means over ``duration_s``, and the allowance it is held to. A window shorter than ``MIN_WINDOW_SHARE`` of the
    run is not judged: a slope fitted over a minute of a young process is its warm-up's tail, and multiplied by
    the whole run it would call that a leak."""
    window = [(t, v) for t, v in points if t >= window_start]
    span = window[-1][0] - window[0][0] if window else 0.0
    if len(window) < MIN_POINTS or span <= 0 or span < MIN_WINDOW_SHARE * duration_s:
        return {"judged": False, "points": len(window), "window_s": span, "ok": True}
    times = np.array([t for t, _ in window])
    values = np.array([v for _, v in window])
    slope = float(np.polyfit(times, values, 1)[0])
    allowed = max(tolerance.absolute, tolerance.relative * float(np.median(np.abs(values))))
    projected = slope * duration_s
    return {
        "judged": True,
        "points": len(window),
        "slope_per_s": slope,
        "growth_over_run": projected,
        "allowed": allowed,
        "ok": projected <= allowed,
    }


def judge_resources(
    samples: list[dict[str, Any]], duration_s: float, warmup_s: float, tolerances: dict[str, Tolerance] | None = None
) -> dict[str, dict[str, Any]]:
    """``growth`` of every series: over the run's second half, after its warm-up, and after a restarted process's
    own warm-up."""
    tolerances = tolerances or TOLERANCES
    second_half = max(warmup_s, duration_s / 2)
    out = {}
    every = series(samples)
    for name, points in every.items():
        if name.startswith("rss_mib:") and "anon_mib:" + name.removeprefix("rss_mib:") in every:
            # RSS also counts the shared pool's and mapped files' pages as they are first touched: bounded by
            # /dev/shm (judged as shm_bytes) and by the files. The anonymous part is what a leak grows.
            out[name] = {"judged": False, "points": len(points), "why": "its anon_mib is judged", "ok": True}
            continue
        born = points[0][0]
        # A series that began after the first samples is a restarted process: it warms up again.
        start = max(second_half, born + warmup_s) if born > (samples[0]["t"] if samples else 0.0) else second_half
        out[name] = growth(points, start, duration_s, tolerances[name.split(":")[0]])
    return out


def near_event(record: dict[str, Any], events: list[dict[str, Any]], recovery_s: float) -> dict[str, Any] | None:
    """The latest chaos event that may explain a failure of ``record``: one during it, or at most ``recovery_s``
    before it started (the stage was still coming back)."""
    near = [e for e in events if record["start_s"] - recovery_s <= e["at_s"] <= record["end_s"]]
    return max(near, key=lambda e: e["at_s"]) if near else None


def outcome(record: dict[str, Any], events: list[dict[str, Any]], recovery_s: float, deadline_s: float) -> str:
    """The record's outcome (module docstring)."""
    status, error = record["status"], record["error"]
    if record.get("timed_out") or record["end_s"] - record["start_s"] > deadline_s:
        return "lost"
    if record["expect"] == "4xx":
        if status is not None and 400 <= status < 500:
            return "ok"
        if status is None or status >= 500:
            return "chaos" if near_event(record, events, recovery_s) else "unexpected"
        return "unexpected"  # a bad input accepted
    if error is None or (record.get("hang_up") and record.get("hung_up")):
        return "ok"
    if status == 503 and record.get("retry_after") and record.get("error_code") == "server_busy":
        return "refused"  # (a stage's failure is a 503 with Retry-After too, but not server_busy: below)
    if status is not None and 400 <= status < 500:
        return "unexpected"  # a good request refused as bad
    return "chaos" if near_event(record, events, recovery_s) else "unexpected"


def judge(
    records: list[dict[str, Any]],
    events: list[dict[str, Any]],
    resources: dict[str, dict[str, Any]],
    idle: dict[str, float],
    *,
    recovery_s: float,
    deadline_s: float,
    strict: bool,
) -> dict[str, Any]:
    """Outcomes counted (chaos failures by the stage hit), the growth verdicts, the idle gauges, and the run's
    verdict with every reason it failed."""
    counts: dict[str, int] = {}
    by_stage: dict[str, int] = {}
    for r in records:
        r["outcome"] = outcome(r, events, recovery_s, deadline_s)
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
        if r["outcome"] == "chaos":
            event = near_event(r, events, recovery_s)
            key = f"{event['stage']} ({event['action']})" if event else "?"
            by_stage[key] = by_stage.get(key, 0) + 1
    reasons = []
    for bad in ("lost", "unexpected"):
        if counts.get(bad):
            reasons.append(f"{counts[bad]} requests {bad}")
    if strict and counts.get("chaos"):
        reasons.append(f"{counts['chaos']} requests failed with chaos (--strict): {by_stage}")
    grown = sorted(name for name, g in resources.items() if not g["ok"])
    for name in grown:
        g = resources[name]
        reasons.append(
            f"{name} grows without bound: {g['slope_per_s']:.3g}/s, {g['growth_over_run']:.3g} over the run "
            f"(allowed {g['allowed']:.3g})"
        )
    left = {k: v for k, v in idle.items() if k in IDLE_ZERO and v > 0}
    if left:
        reasons.append(f"not back to zero after the traffic stopped: {left}")
    return {
        "ok": not reasons,
        "reasons": reasons,
        "outcomes": counts,
        "chaos_failures_by_stage": by_stage,
        "series_judged": sum(g["judged"] for g in resources.values()),
        "series_grown": grown,
        "idle": idle,
    }
