"""Issue 31's split on one machine, for `benchmarks.gpu`'s ``units`` part: a pd unit (gateway, fetchers, cache daemon,
decoder; ``[server] role = "pd"``) and an encoder unit (the encoders alone; ``role = "encoder"``), each its own
supervisord and run directory as on two hosts, each seeing only its own GPUs (``CUDA_VISIBLE_DEVICES``), the encoders
bound on loopback tcp:// under CurveZMQ, so the embeddings come back by value. `plans` says which GPUs each unit gets
for a machine's GPU count; `EncoderUnit` starts and stops the encoder unit (the pd unit is the driver's usual stack).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.soak_stack import Stack

ENCODER_PORT = 7100
ENDPOINT = "tcp://127.0.0.1:710{gpu}"  # encoder K listens on ENCODER_PORT + K (K < 10; `plans` keeps it so)
MOST_ENCODERS = 3  # the scaling figures: vision throughput with 1, 2 and 3 encoder GPUs


@dataclass(frozen=True)
class UnitsPlan:
    """The pd unit on ``pd_gpus``, one encoder on each of ``encoder_gpus`` (the same GPU on a one-GPU machine)."""

    pd_gpus: tuple[int, ...]
    encoder_gpus: tuple[int, ...]

    @property
    def prefix(self) -> str:
        """Names this plan's workloads in the results (``units-2enc-seed3img-c32``)."""
        return f"units-{len(self.encoder_gpus)}enc-"

    def settings(self, role: str) -> list[tuple[str, str, object]]:
        """``--set`` items of the unit ``role`` (both units hold the same endpoints: one binds them, one dials)."""
        count = len(self.encoder_gpus)
        return [("server", "role", role), ("encoder", "count", count), ("endpoints", "encoder", ENDPOINT)]

    def visible_devices(self, role: str) -> str:
        return ",".join(str(gpu) for gpu in (self.pd_gpus if role == "pd" else self.encoder_gpus))


def plans(gpus: int, most_encoders: int = MOST_ENCODERS) -> list[UnitsPlan]:
    """The pd unit on GPU 0 and the encoder unit on 1, then 2, ... of the others, up to ``most_encoders``; on a
    machine of one GPU (or none) both units on it, which measures the split's transport but not its scaling."""
    if gpus <= 1:
        return [UnitsPlan((0,), (0,))]
    return [UnitsPlan((0,), tuple(range(1, 1 + k))) for k in range(1, min(gpus - 1, most_encoders, 10) + 1)]


class EncoderUnit:
    """An encoder unit as ``ops/serve`` runs it (``vlm-serve serve``: its keys checked, its programs rendered into
    ``run_dir``, supervisord), up once each of its ``count`` encoders accepts connections on its port; stopped as
    the soak stops its stack (`benchmarks.soak_stack.Stack.stop`), its logs kept in ``logs_to``/logs."""

    def __init__(self, repo: Path, config: Path, run_dir: Path, env: dict[str, str], count: int) -> None:
        self.repo, self.run_dir, self.count = repo, run_dir, count
        self.env = {**env, "VLM_CONFIG": str(config), "VLM_RUN_DIR": str(run_dir)}
        self.stack: Stack | None = None

    def start(self, logs_to: Path, timeout_s: float = 240) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(parents=True)
        with open(self.run_dir / "serve.log", "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "ops.cli", "serve"],
                cwd=self.repo,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.stack = Stack("", self.run_dir / "supervisord.conf", supervisord=process, keep_logs_in=logs_to)
        deadline = time.monotonic() + timeout_s
        for port in range(ENCODER_PORT, ENCODER_PORT + self.count):
            while not accepts(port):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the encoder unit did not listen on port {port} (logs in {self.run_dir})")
                time.sleep(0.5)

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False
