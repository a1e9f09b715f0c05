"""The soak's verdict on made-up samples and records: flat and rise-then-plateau series pass, steady growth fails,
a restarted process starts a new series, and each request gets the outcome it deserves."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.soak import recovered_at
from benchmarks.soak_stack import gauges
from benchmarks.soak_verdict import IDLE_ZERO, Tolerance, growth, judge, judge_resources, outcome

DURATION = 1200.0


def samples(rss: list[float], *, every_s: float = 3.0, pids: list[int] | None = None) -> list[dict[str, Any]]:
    """Samples of one process ("decoder") with these RSS values, every ``every_s`` seconds."""
    pids = pids or [100] * len(rss)
    return [
        {
            "t": i * every_s,
            "processes": {"decoder": {"pid": pid, "rss_mib": value, "fds": 40}},
            "shm_bytes": 1 << 26,
            "metrics": {"kv_blocks_used": 0.0, "cache_leased_requests": 0.0, "cache_pending_entries": 0.0},
            "gpu_mib": {},
        }
        for i, (value, pid) in enumerate(zip(rss, pids, strict=True))
    ]


def noisy(values: np.ndarray, seed: int = 0) -> list[float]:
    return (values + np.random.default_rng(seed).normal(0, 3, values.size)).tolist()


COUNT = int(DURATION / 3)


def rss_verdicts(result: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [g for name, g in result.items() if name.startswith("rss_mib:")]


def test_a_flat_series_passes() -> None:
    result = judge_resources(samples(noisy(np.full(COUNT, 900.0))), DURATION, warmup_s=60)
    assert all(g["judged"] and g["ok"] for g in result.values())


def test_a_steadily_growing_series_fails() -> None:
    # 0.1 MiB a second: 120 MiB over the run, on a 900 MiB process (the allowance is 90)
    rss = noisy(900.0 + 0.1 * 3.0 * np.arange(COUNT))
    (verdict,) = rss_verdicts(judge_resources(samples(rss), DURATION, warmup_s=60))
    assert verdict["judged"] and not verdict["ok"]
    assert 100 < verdict["growth_over_run"] < 140


def test_a_rise_then_plateau_passes() -> None:
    t = 3.0 * np.arange(COUNT)
    rss = noisy(500.0 + 400.0 * np.minimum(t / 300.0, 1.0))  # fills for 5 minutes, then flat
    (verdict,) = rss_verdicts(judge_resources(samples(rss), DURATION, warmup_s=60))
    assert verdict["judged"] and verdict["ok"]


def test_slow_growth_in_the_second_half_alone_fails() -> None:
    t = 3.0 * np.arange(COUNT)
    rss = noisy(900.0 + np.where(t > DURATION / 2, 0.3 * (t - DURATION / 2), 0.0))
    (verdict,) = rss_verdicts(judge_resources(samples(rss), DURATION, warmup_s=60))
    assert not verdict["ok"]


def test_a_restarted_process_is_a_new_series_with_its_own_warm_up() -> None:
    # killed at 80% of the run: the new process grows back to its level for its first 30 s, then stays flat
    t = 3.0 * np.arange(COUNT)
    restart = 0.8 * DURATION
    rss = np.where(t < restart, 900.0, 300.0 + 600.0 * np.minimum((t - restart) / 30.0, 1.0))
    pids = [100 if x < restart else 200 for x in t]
    result = judge_resources(samples(noisy(rss), pids=pids), DURATION, warmup_s=60)
    assert {name for name in result if name.startswith("rss_mib")} == {"rss_mib:decoder#100", "rss_mib:decoder#200"}
    assert all(g["ok"] for g in rss_verdicts(result))
    # the same values in one series would look like growth: the new process is what keeps it apart
    joined = judge_resources(samples(noisy(rss - 600.0 * (t < restart))), DURATION, warmup_s=60)
    assert not all(g["ok"] for g in rss_verdicts(joined))


def test_too_few_points_are_not_judged() -> None:
    assert growth([(0.0, 1.0), (700.0, 500.0)], 600.0, DURATION, Tolerance(1.0))["judged"] is False


def test_a_window_of_a_small_share_of_the_run_is_not_judged() -> None:
    """A gateway restarted late in an 8-minute soak, its window 50 s of its warm-up's tail (+10 MiB): the slope times
    the whole run would read as +96 MiB. Not judged; the same rise kept up over a long window is."""
    tail = [(240.0 + 5 * i, 160.0 + 1.0 * i) for i in range(11)]
    assert growth(tail, 240.0, 480.0, Tolerance(64.0))["judged"] is False
    steady = [(240.0 + 5 * i, 160.0 + 1.0 * i) for i in range(49)]
    verdict = growth(steady, 240.0, 480.0, Tolerance(64.0))
    assert verdict["judged"] and not verdict["ok"]


def record(start: float, end: float, status: int | None, error: str | None, expect: str = "2xx", **more: Any) -> dict:
    return {"start_s": start, "end_s": end, "status": status, "error": error, "expect": expect, **more}


KILL = {"at_s": 100.0, "stage": "fetcher", "action": "kill", "pid": 7}


def test_outcomes() -> None:
    def of(r: dict[str, Any]) -> str:
        return outcome(r, [KILL], recovery_s=20.0, deadline_s=75.0)

    assert of(record(10, 12, 200, None)) == "ok"
    assert of(record(10, 12, 400, "bad image", expect="4xx")) == "ok"
    assert of(record(10, 12, 200, None, expect="4xx")) == "unexpected"  # a bad input accepted
    assert of(record(95, 103, 503, "no fetcher", retry_after="1")) == "chaos"
    assert of(record(110, 112, None, "ServerDisconnectedError")) == "chaos"  # within the recovery window
    assert of(record(130, 132, None, "ServerDisconnectedError")) == "unexpected"  # far from any event
    assert of(record(10, 12, 503, "busy", retry_after="1", error_code="server_busy")) == "refused"
    assert of(record(10, 12, 503, "cache not answering", retry_after="1")) == "unexpected"  # a stage's, no chaos
    assert of(record(10, 90, 200, None)) == "lost"  # answered after its deadline
    assert of(record(95, 170, None, "no answer", timed_out=True)) == "lost"  # lost even beside a kill
    assert of(record(10, 11, 200, "the client hung up", hang_up=True, hung_up=True)) == "ok"


def test_the_verdict_counts_chaos_by_stage_and_fails_on_lost_growth_and_leftovers() -> None:
    records = [record(95, 103, 500, "fetcher died"), record(10, 12, 200, None)]
    flat = {"rss_mib:decoder#1": {"judged": True, "ok": True}}
    passed = judge(records, [KILL], flat, dict.fromkeys(IDLE_ZERO, 0.0), recovery_s=20, deadline_s=75, strict=False)
    assert passed["ok"] and passed["chaos_failures_by_stage"] == {"fetcher (kill)": 1}
    strict = judge(records, [KILL], flat, {}, recovery_s=20, deadline_s=75, strict=True)
    assert not strict["ok"]
    grown = {"fds:gateway#3": {"judged": True, "ok": False, "slope_per_s": 0.1, "growth_over_run": 120, "allowed": 16}}
    lost = [*records, record(10, 200, None, "no answer", timed_out=True)]
    failed = judge(lost, [KILL], grown, {"cache_leased_requests": 2.0}, recovery_s=20, deadline_s=75, strict=False)
    assert not failed["ok"] and len(failed["reasons"]) == 3
    assert failed["outcomes"] == {"chaos": 1, "ok": 1, "lost": 1}


def test_gauges_sum_over_labels() -> None:
    text = (
        "# HELP vlm_decoder_kv_blocks_used KV cache blocks in use.\n"
        'vlm_decoder_kv_blocks_used{replica="0"} 12.0\n'
        'vlm_decoder_kv_blocks_used{replica="1"} 3.0\n'
        "vlm_cache_leased_requests 2.0\n"
        "vlm_cache_leased_requests_total 9.0\n"
    )
    assert gauges(text) == {"kv_blocks_used": 15.0, "cache_leased_requests": 2.0}


def test_recovery_is_the_first_answer_from_which_on_every_one_is_fast() -> None:
    def alone(start: float, took: float, error: str | None = None) -> dict[str, Any]:
        return {"start_s": start, "end_s": start + took, "error": error}

    after = [alone(0, 5.0), alone(5, 0.2), alone(6, 3.0), alone(9, 0.2), alone(10, 0.3)]
    assert recovered_at(after, bound_s=0.5) == 9.2
    assert recovered_at([*after, alone(11, 0.1, "503")], bound_s=0.5) is None


def test_anonymous_memory_is_judged_apart_from_rss() -> None:
    """RSS rising as the process touches more of the shared pool, its own (anonymous) memory flat: passes, the RSS
    series not judged where its anonymous part is; a growing anonymous part fails on its own."""
    touched = np.linspace(300.0, 700.0, COUNT)  # (pool pages touched: counted in RSS)
    flat_anon = samples(touched.tolist())
    for s in flat_anon:
        s["processes"]["decoder"]["anon_mib"] = 250.0
    result = judge_resources(flat_anon, DURATION, warmup_s=60)
    assert result["anon_mib:decoder#100"]["judged"] and result["anon_mib:decoder#100"]["ok"]
    assert not result["rss_mib:decoder#100"]["judged"] and result["rss_mib:decoder#100"]["ok"]
    leaking = samples(np.full(COUNT, 900.0).tolist())
    for s, anon in zip(leaking, np.linspace(250.0, 650.0, COUNT), strict=True):
        s["processes"]["decoder"]["anon_mib"] = float(anon)
    assert not judge_resources(leaking, DURATION, warmup_s=60)["anon_mib:decoder#100"]["ok"]
