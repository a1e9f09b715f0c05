"""A soak stopped by SIGTERM (``benchmarks.gpu``'s timeout) stops the stack it started: supervisord and every
program of it are gone when it exits, and the stack's logs are in its --stack-dir."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from benchmarks.soak_stack import Stack

REPO = Path(__file__).resolve().parents[2]


def _cmdline(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None


def _wait_for_stack(stack_dir: Path, soak: subprocess.Popen[str], timeout_s: float) -> Stack:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and soak.poll() is None:
        config = stack_dir / "vlm.toml"
        if config.exists():
            port = tomllib.loads(config.read_text())["server"]["port"]
            stack = Stack.from_config(f"http://127.0.0.1:{port}", config)
            if stack.healthy():
                return stack
        time.sleep(0.1)
    soak.kill()
    raise AssertionError(f"the soak's stack did not become healthy: {soak.communicate()[1][-3000:]}")


def test_sigterm_stops_the_soak_and_its_whole_stack(tmp_path: Path) -> None:
    stack_dir = tmp_path / "stack"
    command = [sys.executable, "-m", "benchmarks.soak", "--duration", "300", "--concurrency", "2"]
    command += ["--stack-dir", str(stack_dir), "--out", str(tmp_path / "soak.json")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    soak = subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    stack = _wait_for_stack(stack_dir, soak, timeout_s=120)
    programs = [p.pid for p in stack.processes() if p.pid]
    pids = [int(stack.rpc().supervisor.getPID()), *programs]
    assert len(programs) >= 5, programs  # gateway, fetcher, encoder, cache, decoder
    cmdlines = {pid: _cmdline(pid) for pid in pids}
    time.sleep(3)  # (the soak's clients and sampler running: the signal comes inside its event loop)

    soak.send_signal(signal.SIGTERM)
    _, stderr = soak.communicate(timeout=90)
    assert soak.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    left = [pid for pid in pids if _cmdline(pid) is not None and _cmdline(pid) == cmdlines[pid]]
    assert not left, f"still running after the soak's exit: {left}"
    assert not stack.healthy()
    assert (stack_dir / "logs" / "gateway.log").stat().st_size > 0
    assert (stack_dir / "logs" / "supervisord.log").exists()
