"""A process whose loop stalls ends itself (every thread's stack logged, exit status 1) for supervisord to
restart it; one whose loop keeps turning, or that stops slowly, does not. Real processes, real loops."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

LOOP = """
import logging, sys, time
from common.transport import EventLoop
logging.basicConfig(level=logging.INFO)
loop = EventLoop()
loop.exit_if_stalled(1.0, "stalling-worker")
started = time.monotonic()

def tick() -> None:
    if time.monotonic() - started > 2.5:
        {after}

loop.every(0.05, tick)
loop.run()
{after_run}
"""


def run_loop(after: str, after_run: str = "") -> subprocess.CompletedProcess[str]:
    code = LOOP.replace("{after}", after).replace("{after_run}", after_run)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_a_loop_stuck_in_a_handler_ends_the_process_with_its_stack() -> None:
    # (2.5 s of turning first: re-arming every quarter second keeps a 1-s watchdog quiet meanwhile)
    started = time.monotonic()
    done = run_loop("time.sleep(30)  # stuck")
    assert done.returncode == 1, done.stderr
    assert 3.0 < time.monotonic() - started < 20
    assert "exits (for supervisord to restart it" in done.stderr and "stall_exit_s" in done.stderr
    assert "Timeout (0:00:01)!" in done.stderr and "in tick" in done.stderr  # the stuck frame, named


def test_a_loop_that_keeps_turning_and_then_stops_slowly_is_not_stalled() -> None:
    done = run_loop("loop.stop()", after_run="time.sleep(1.5)  # closing down slowly, past the limit")
    assert done.returncode == 0, done.stderr
    assert "Timeout" not in done.stderr
