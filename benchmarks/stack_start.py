"""How long the whole stack takes to start, as the integration tests start it, and the CPU each process spends
on the way: what every test file that starts a stack pays. Runs anywhere (CPU stack, demo checkpoint).

    python -m benchmarks.stack_start [--runs 3] [--json OUT]

Each run starts ``./ops/serve`` on a free port with the integration tests' settings
(`tests/integration/conftest.py`: loopback media, short fetch timeouts), polls ``/health`` every 50 ms, and at
the first 200 reads each process's CPU time (user + system, from /proc; the launcher's is the supervisord
process's, which ``ops/serve`` and ``vlm-serve serve`` exec into) and each log's ready line. The processes start
at once, so on a machine of few cores the sum of their CPU times bounds the start more than any one of them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.gateway_load import free_port
from common.config import REPO_ROOT, load_config

TEST_SETTINGS = (
    "[server]\nport = {port}\nrequest_timeout_s = 120.0\n"
    "[fetcher]\nallow_private_addresses = true\nhttp_timeout_s = 5.0\nencode_timeout_s = 30.0\n"
    "[cache]\npending_ttl_s = 30.0\n"
)
READY = re.compile(r" ready|serving ")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> tuple[float, int]:
    """A process's user + system CPU seconds, and its parent's pid."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS, int(fields[1])


def children_cpu(parent: int) -> dict[str, float]:
    """CPU seconds of ``parent``'s children by their module (``gateway``, ``workers.decoder``...)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            seconds, ppid = cpu_seconds(int(entry))
            argv = Path(f"/proc/{entry}/cmdline").read_text().split("\0")
        except (OSError, IndexError):
            continue  # (gone meanwhile)
        if ppid == parent and "-m" in argv:
            out[argv[argv.index("-m") + 1]] = seconds
    return out


def log_time(line: str) -> float:
    return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as answer:
            return answer.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def one_start(timeout_s: float = 180.0) -> dict[str, Any]:
    """Start a stack, wait for /health, measure, stop it (SIGTERM, waited for)."""
    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix="stack-start-"))
    config = folder / "vlm.toml"
    config.write_text(TEST_SETTINGS.format(port=port))
    started_wall, started = time.time(), time.monotonic()
    with open(folder / "serve.log", "wb") as log:
        process = subprocess.Popen(
            [str(REPO_ROOT / "ops/serve")], env={**os.environ, "VLM_CONFIG": str(config)}, stdout=log, stderr=log
        )
    try:
        while not healthy(port):
            if process.poll() is not None or time.monotonic() - started > timeout_s:
                raise RuntimeError(f"the stack did not become healthy; see {folder / 'serve.log'}")
            time.sleep(0.05)
        result: dict[str, Any] = {"healthy_s": time.monotonic() - started}
        result["cpu_s"] = {"launcher": cpu_seconds(process.pid)[0], **children_cpu(process.pid)}
        result["cpu_s_total"] = sum(result["cpu_s"].values())
        logs = load_config(config).run_path
        supervisord = (logs / "supervisord.log").read_text().splitlines()
        spawned = [log_time(line) for line in supervisord if "spawned:" in line]
        result["supervisord_up_s"] = log_time(supervisord[0]) - started_wall
        result["first_spawn_s"] = min(spawned) - started_wall
        result["ready_s"] = {}
        for path in sorted((logs / "logs").glob("*.log")):
            ready = [line for line in path.read_text().splitlines() if READY.search(line)]
            if ready:
                result["ready_s"][path.stem] = log_time(ready[-1]) - started_wall
        return result
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    args = parser.parse_args()
    runs = []
    for _ in range(args.runs):
        runs.append(one_start())
        run = runs[-1]
        cpu = " ".join(f"{name}={seconds:.1f}" for name, seconds in sorted(run["cpu_s"].items()))
        print(f"healthy after {run['healthy_s']:.2f} s; CPU s: {cpu} (total {run['cpu_s_total']:.1f})", flush=True)
    for key in ("healthy_s", "cpu_s_total", "supervisord_up_s", "first_spawn_s"):
        print(f"median {key}: {statistics.median(run[key] for run in runs):.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
