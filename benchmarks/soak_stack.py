"""The stack a soak runs against: started under supervisord on a checkpoint, or one already running; its processes'
pids from supervisord's XML-RPC socket; the chaos (``kill -9``, SIGSTOP then SIGCONT) and the resource samples
(RSS, open fds, ``/dev/shm`` bytes, the gateway's /metrics gauges, GPU memory).

`benchmarks.soak` drives it; this module only touches the stack's processes and files.
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import xmlrpc.client
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.xmlrpc import SupervisorTransport

from common.config import load_config

REPO = Path(__file__).resolve().parents[1]
SHM_DIR = Path("/dev/shm")
START_WAIT_S = 300.0  # a started stack's wait to be healthy (a 7B checkpoint's stack takes over a minute)
STOP_WAIT_S = 60.0  # supervisord's wait for its programs to stop, before SIGKILL to its group
# The gateway's /metrics gauges a soak samples (summed over their labels: replicas).
METRIC_GAUGES = {
    "kv_blocks_used": "vlm_decoder_kv_blocks_used",
    "kv_blocks_capacity": "vlm_decoder_kv_blocks_capacity",
    "cache_leased_requests": "vlm_cache_leased_requests",
    "cache_pending_entries": "vlm_cache_pending_entries",
    "cache_entries": "vlm_cache_entries",
    "gateway_requests_in_flight": "vlm_gateway_requests_in_flight",
}


def stack_toml(port: int, request_timeout_s: float, extra: str = "", server: str = "") -> str:
    """A soak stack's settings: its port, its request deadline, loopback media allowed, plus ``server`` (lines of
    [server]) and ``extra`` (whole TOML sections)."""
    server = server.strip() + "\n" if server.strip() else ""
    return (
        f"[server]\nport = {port}\nrequest_timeout_s = {request_timeout_s}\n{server}"
        "[fetcher]\nallow_private_addresses = true\n" + extra
    )


@dataclass
class StackProcess:
    name: str  # supervisord's program name without its group: "decoder", "encoder-0"
    pid: int  # 0 while not running


@dataclass
class Stack:
    """A running stack: its URL, and where its supervisord listens (None: a bare URL, no chaos, no per-process
    samples)."""

    base_url: str
    conf: Path | None = None  # the rendered supervisord.conf
    shm_prefix: str = ""  # /dev/shm files of this deployment start with it ("" : not known)
    supervisord: subprocess.Popen[bytes] | None = None  # when this harness started it
    keep_logs_in: Path | None = None  # where stop() copies the run's logs/ (the soak's --stack-dir)
    _rpc: Any = field(default=None, repr=False)

    @classmethod
    def from_config(cls, base_url: str, config: Path) -> Stack:
        cfg = load_config(config)
        return cls(base_url, cfg.run_path / "supervisord.conf", f"vlm-{cfg.deployment_id}-")

    def rpc(self) -> Any:
        if self._rpc is None:
            if self.conf is None:
                raise RuntimeError("no supervisord known for this stack (give --config)")
            self._rpc = xmlrpc.client.ServerProxy(
                "http://127.0.0.1", transport=SupervisorTransport(None, None, serverurl=_server_url(self.conf))
            )
        return self._rpc

    def processes(self) -> list[StackProcess]:
        """Every program supervisord runs, with its pid (0 while it is down)."""
        if self.conf is None:
            return []
        infos = self.rpc().supervisor.getAllProcessInfo()
        return [StackProcess(i["name"], int(i["pid"]) if i["statename"] == "RUNNING" else 0) for i in infos]

    def pid(self, name: str) -> int:
        for p in self.processes():
            if p.name == name:
                return p.pid
        raise KeyError(f"supervisord runs no process {name!r}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def wait_healthy(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.supervisord is not None and self.supervisord.poll() is not None:
                return False
            if self.healthy():
                return True
            time.sleep(0.5)
        return False

    def metrics(self) -> dict[str, float]:
        """The /metrics gauges of ``METRIC_GAUGES``, each summed over its labels; {} when the gateway is down."""
        try:
            with urllib.request.urlopen(self.base_url + "/metrics", timeout=5) as r:
                text = r.read().decode()
        except (OSError, urllib.error.URLError):
            return {}
        return gauges(text)

    def stop(self) -> None:
        """SIGTERM to the supervisord this harness started (it stops its programs), SIGKILL to its group if it
        lingers; then its logs copied into ``keep_logs_in``. Once: a second call does nothing."""
        process, self.supervisord = self.supervisord, None
        if process is None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        self.keep_logs()

    def keep_logs(self) -> None:
        """The run directory's logs/ and supervisord.log copied (files, never links) into ``keep_logs_in``/logs: the
        run directory is under the repository, outside the result folder that is shipped."""
        if self.keep_logs_in is None or self.conf is None or not (self.conf.parent / "logs").is_dir():
            return
        run, kept = self.conf.parent, self.keep_logs_in / "logs"
        try:
            shutil.copytree(run / "logs", kept, ignore_dangling_symlinks=True, dirs_exist_ok=True)
            if (run / "supervisord.log").is_file():
                shutil.copy(run / "supervisord.log", kept / "supervisord.log")
        except OSError as exc:  # (a log rotated away while copied: the rest is kept)
            print(f"soak: not every log was kept: {exc}", file=sys.stderr)


def _server_url(conf: Path) -> str:
    parser = configparser.RawConfigParser()
    parser.read(conf)
    return parser.get("supervisorctl", "serverurl").replace("%(here)s", str(conf.parent))


def gauges(text: str) -> dict[str, float]:
    """``METRIC_GAUGES`` from a Prometheus text exposition (``name{labels} value`` lines), summed over labels."""
    wanted = {family: key for key, family in METRIC_GAUGES.items()}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        key = wanted.get(name.split("{", 1)[0])
        if key is not None:
            out[key] = out.get(key, 0.0) + float(value)
    return out


def start_stack(
    directory: Path, port: int, model: str, request_timeout_s: float, extra_toml: str = "", server_toml: str = ""
) -> Stack:
    """``vlm-serve serve`` (supervisord, as ``ops/serve`` runs it, without its install step) on ``model`` ("" : the
    built-in tiny demo checkpoint), healthy or raise (stopped first). Its output goes to ``directory/serve.log``, its
    logs/ into ``directory/logs`` when it stops."""
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "vlm.toml"
    config.write_text(stack_toml(port, request_timeout_s, extra_toml, server_toml))
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)  # (the GPU box's wheels)
    env = {**os.environ, "VLM_CONFIG": str(config), "PYTHONPATH": path}
    if model:
        env["VLM_MODEL"] = model
    with open(directory / "serve.log", "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "serve"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    stack = Stack.from_config(f"http://127.0.0.1:{port}", config)
    stack.supervisord, stack.keep_logs_in = process, directory
    try:
        healthy = stack.wait_healthy(START_WAIT_S)
    except BaseException:  # (SIGTERM or Ctrl-C while it starts: the stack goes too)
        stack.stop()
        raise
    if not healthy:
        stack.stop()
        raise RuntimeError(f"the stack did not become healthy within {START_WAIT_S:.0f} s (logs in {directory})")
    return stack


# ---------------------------------------------------------------------------------------- samples
def _descendants(pid: int) -> list[int]:
    """``pid`` and every process under it (a worker's helpers count as the worker's)."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        try:
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        todo.extend(int(c) for c in children)
    return out


def process_usage(pid: int) -> tuple[float, float, int] | None:
    """(RSS in MiB, its anonymous part in MiB, open fds) of ``pid`` and its descendants; None when it is gone. The
    anonymous part is the process's own memory: RSS also counts the pages of the shared embedding pool that the
    process has touched, which grow until it has touched the whole pool and are no leak."""
    rss_kib, anon_kib, fds = 0, 0, 0
    for each in _descendants(pid):
        try:
            status = Path(f"/proc/{each}/status").read_text()
            fds += len(os.listdir(f"/proc/{each}/fd"))
        except OSError:
            if each == pid:
                return None
            continue
        rss_kib += _status_kib(status, "VmRSS")
        anon_kib += _status_kib(status, "RssAnon")
    return rss_kib / 1024, anon_kib / 1024, fds


def _status_kib(status: str, field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", status, flags=re.MULTILINE)
    return int(match.group(1)) if match else 0


def shm_bytes(prefix: str) -> tuple[int | None, int | None]:
    """(bytes, files) of this deployment's /dev/shm files (``prefix`` names them); Nones without a prefix."""
    total, count = 0, 0
    if not prefix:
        return None, None
    for path in SHM_DIR.glob(prefix + "*"):
        try:
            total += path.stat().st_size
            count += 1
        except OSError:
            continue  # (unlinked between the listing and the stat)
    return total, count


def gpu_memory_mib() -> dict[str, float]:
    """Used memory of each GPU (nvidia-smi), {} without one."""
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    used = {}
    for line in out.splitlines():
        index, _, mib = line.partition(",")
        if mib.strip():
            used[index.strip()] = float(mib)
    return used


def sample(stack: Stack, t: float) -> dict[str, Any]:
    """One sample at run time ``t``: each process's pid, RSS and fds, the stack's /dev/shm, its gauges, GPUs."""
    processes: dict[str, dict[str, float]] = {}
    try:
        listed = stack.processes()
    except (OSError, xmlrpc.client.Error):
        listed = []
    for p in listed:
        usage = process_usage(p.pid) if p.pid else None
        if usage is not None:
            processes[p.name] = {"pid": p.pid, "rss_mib": usage[0], "anon_mib": usage[1], "fds": usage[2]}
    shm, shm_files = shm_bytes(stack.shm_prefix)
    return {
        "t": t,
        "processes": processes,
        "shm_bytes": shm,
        "shm_files": shm_files,
        "metrics": stack.metrics(),
        "gpu_mib": gpu_memory_mib(),
    }
