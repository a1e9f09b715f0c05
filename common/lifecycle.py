"""What every process does the same way: arguments, logging, clean SIGTERM, start-up banner."""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

from common.config import Config, load_config


def parse_args(role: str, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {role}", description=f"vlm-serve {role} process")
    parser.add_argument("--config", default=None, help="TOML config (default: $VLM_CONFIG or ops/vlm.toml)")
    parser.add_argument("--log-level", default="INFO")
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def start_process(role: str, args: argparse.Namespace) -> Config:
    """Configure logging and load the config; a bad config ends the process with a clear message."""
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    end_with_supervisord(role)
    try:
        return load_config(args.config)
    except (OSError, ValueError) as exc:
        logging.getLogger(role).error("cannot load config: %s", exc)
        raise SystemExit(2) from exc


_PR_SET_PDEATHSIG = 1


def end_with_supervisord(role: str) -> None:
    """Under supervisord, get SIGTERM (a clean stop) when it dies. A supervisord killed hard (SIGKILL, the OOM
    killer) otherwise leaves its children running, holding the deployment's port, sockets and GPU memory, and the
    next start cannot bind them. A process started by hand (no SUPERVISOR_ENABLED) lives as long as it likes."""
    if "SUPERVISOR_ENABLED" not in os.environ or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        logging.getLogger(role).warning("cannot ask for SIGTERM when supervisord dies: errno %d", ctypes.get_errno())


def on_terminate(stop: Callable[[], None]) -> None:
    """SIGTERM/SIGINT ask the main loop to finish its current step and exit."""

    def handler(signum: int, _frame: object) -> None:
        logging.getLogger("lifecycle").info("signal %d: stopping", signum)
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def freeze_startup_heap() -> None:
    """Exclude everything built at start-up (torch, transformers, weights' Python objects) from garbage
    collection. A full collection otherwise walks those millions of objects every so often and stalls the
    process tens of milliseconds mid-stream; what the serving loop allocates is collected as before."""
    gc.collect()
    gc.freeze()


REPORT_EVERY_S = 5.0  # a process's timing line this often while it has work


class CounterWindow:
    """How much a process's counters grew since the last look: its periodic timing line."""

    def __init__(self, counters: dict[str, float]) -> None:
        self.counters = counters
        self.since, self.before = time.monotonic(), dict(counters)

    def take(self) -> tuple[float, dict[str, float]]:
        """Seconds since the last call and each counter's growth over them; starts the next window."""
        now = time.monotonic()
        seconds = now - self.since
        growth = {name: value - self.before.get(name, 0.0) for name, value in self.counters.items()}
        self.since, self.before = now, dict(self.counters)
        return seconds, growth


class StallWatchdog:
    """Ends this process when its loop has not re-armed the watchdog for ``limit_s``: every thread's stack goes
    to stderr (the process's log), then exit status 1, and supervisord starts it again. A hung process (a
    deadlock, a device call that never returns) would otherwise stay up and silent for ever: the others only
    route around it. faulthandler's timer is a C thread, so it fires even while the hung thread holds the GIL.
    The loop re-arms it every quarter of the limit (re-arming starts a thread: not on every turn)."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.rearm_every_s = limit_s / 4

    def arm(self) -> None:
        faulthandler.dump_traceback_later(self.limit_s, exit=True)

    def disarm(self) -> None:
        faulthandler.cancel_dump_traceback_later()

    def announce(self, role: str) -> None:
        logging.getLogger(role).info(
            "%s exits (for supervisord to restart it, every thread's stack logged) if its loop stalls for %g s "
            "([liveness] stall_exit_s)",
            role,
            self.limit_s,
        )
