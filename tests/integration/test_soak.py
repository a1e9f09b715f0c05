"""``benchmarks.soak`` end to end on the CPU stack it starts itself: a short run with a hang and a kill of random
stages among the fetcher and the encoder. Its JSON accounts for every request, holds the samples
and the chaos events, and its verdict is the one `benchmarks.soak_verdict` gives on the JSON's own records and
samples (and the exit status says the same)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.soak_verdict import judge, judge_resources

REPO = Path(__file__).resolve().parents[2]
# Seed 4 draws a SIGSTOP/SIGCONT at about 8 s, a kill -9 1 s after the hang ends, and more events may follow before
# the chaos stops at 37 s. (The cache daemon is left out: its kill is the recovery work's, in tests/integration/
# test_faults.py; here the harness is under test.)
SOAK = ["--duration", "40", "--seed", "4", "--chaos-every", "15", "--hang-s", "2", "3"]
SOAK += ["--chaos-stages", "fetcher", "encoder", "--concurrency", "3", "--warmup-s", "15", "--sample-every", "2"]
SOAK += ["--drain-s", "30"]


def test_a_short_soak_with_chaos_accounts_for_every_request(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    command = [
        sys.executable,
        "-m",
        "benchmarks.soak",
        *SOAK,
        "--stack-dir",
        str(tmp_path / "stack"),
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.exists(), run.stderr[-3000:]
    result = json.loads(out.read_text())
    records, samples, events, verdict = result["requests"], result["samples"], result["events"], result["verdict"]

    assert result["summary"]["sent"] == len(records) > 0
    assert all(
        r["end_s"] is not None and r["outcome"] in ("ok", "refused", "chaos", "lost", "unexpected") for r in records
    )
    assert {r["kind"].split(":")[0] for r in records} == {"text", "images", "video", "bad"}
    assert (
        any(r["stream"] for r in records) and any(r["n"] == 2 for r in records) and any(r["hung_up"] for r in records)
    )
    assert [e["action"] for e in events][:2] == ["hang", "kill"], events
    assert all(e["stage"].startswith(("fetcher", "encoder")) and e["back_s"] is not None for e in events)
    assert len(samples) >= 15 and all(s["processes"] and s["metrics"] for s in samples[:-1])
    assert {"gateway", "decoder", "cache", "fetcher-0", "encoder-0"} <= set(samples[0]["processes"])
    assert out.with_suffix(".png").stat().st_size > 0

    config = result["config"]
    resources = judge_resources(samples, result["traffic_end_s"], config["warmup_s"])
    deadline = config["request_timeout"] + config["deadline_grace"]
    again = judge(
        records, events, resources, verdict["idle"], recovery_s=config["recovery_s"], deadline_s=deadline, strict=False
    )
    assert again == verdict
    assert (run.returncode == 0) == verdict["ok"]
    assert verdict["ok"], verdict["reasons"]
