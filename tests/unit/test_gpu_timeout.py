"""`benchmarks.gpu`'s part timeouts: a tool past its limit gets SIGTERM first (the soak stops its stack then) and
SIGKILL only if it lingers; the soak and overload parts' limit is what their own plan needs
(`benchmarks.soak.time_bound_s`), not ``--timeout``."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu, soak
from benchmarks.soak_stack import START_WAIT_S

# A tool that notes SIGTERM in a file, then ends (or ignores it, with "ignore").
TOOL = """
import signal, sys, time
from pathlib import Path
def note(signum, frame):
    Path(sys.argv[1]).write_text("SIGTERM")
    if sys.argv[2] != "ignore":
        sys.exit(3)
signal.signal(signal.SIGTERM, note)
print("ready", flush=True)
time.sleep(60)
"""


def _tool(tmp_path: Path, mode: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", TOOL, str(tmp_path / "noted"), mode], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    return process


def test_a_tool_past_its_limit_gets_sigterm_and_may_end_itself(tmp_path: Path) -> None:
    process = _tool(tmp_path, "end")
    gpu.stop_gently(process)
    assert process.returncode == 3 and (tmp_path / "noted").read_text() == "SIGTERM"


def test_a_tool_that_ignores_sigterm_is_killed_after_the_grace(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(gpu, "STOP_GRACE_S", 1)
    process = _tool(tmp_path, "ignore")
    gpu.stop_gently(process)
    assert process.returncode == -9 and (tmp_path / "noted").read_text() == "SIGTERM"


def test_run_python_past_its_timeout_is_124_after_sigterm(tmp_path: Path) -> None:
    run = gpu.Run(Path.cwd(), tmp_path, argparse.Namespace())
    tool = tmp_path / "tool.py"
    tool.write_text(TOOL)
    code = run.python("sleeper", "tool", str(tmp_path / "noted"), "end", timeout=2, cwd=tmp_path)
    assert code == 124 and (tmp_path / "noted").read_text() == "SIGTERM"


def test_the_soak_time_bound_covers_its_plan() -> None:
    argv = ["--duration", "480", "--chaos-every", "45", "--out", "x.json"]
    bound = soak.time_bound_s(soak.parse_args(argv))
    longer = soak.time_bound_s(soak.parse_args([*argv, "--duration", "600"]))
    assert longer - bound == 120  # (one for one with the traffic's length)
    assert bound >= START_WAIT_S + 480 + 150  # the start's wait, the traffic, the drain's wait at least
    burst = soak.parse_args(["--burst", "--out", "x.json"])
    assert soak.time_bound_s(burst) >= START_WAIT_S + burst.measure_s + burst.burst_s + burst.tail_s
    given_rate = soak.time_bound_s(soak.parse_args(["--burst", "--sustainable-rate", "3", "--out", "x.json"]))
    assert given_rate < soak.time_bound_s(burst)  # (no measuring phase)


def test_gpu_soak_part_asks_the_soak_for_its_bound(tmp_path: Path) -> None:
    run = gpu.Run(Path(__file__).resolve().parents[2], tmp_path, argparse.Namespace())
    argv = ["--duration", "480", "--out", str(tmp_path / "soak.json")]
    assert gpu.soak_time_bound(run, argv) == round(soak.time_bound_s(soak.parse_args(argv)))
