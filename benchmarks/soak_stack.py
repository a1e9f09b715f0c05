"""The stack a soak runs against: started under supervisord on a checkpoint, or one already running; its processes'
pids from supervisord's XML-RPC socket; the chaos (``kill -9``, SIGSTOP then SIGCONT) and the resource samples
(RSS, open fds, ``/dev/shm`` bytes, the gateway's /metrics gauges, GPU memory).

`benchmarks.soak` drives it; this module only touches the stack's processes and files.
"""

from __future__ import annotations

import asyncio
import configparser
import contextlib
import http.client
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import xmlrpc.client
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from supervisor.xmlrpc import SupervisorTransport, UnixStreamHTTPConnection

from common.config import load_config

REPO = Path(__file__).resolve().parents[1]
SHM_DIR = Path("/dev/shm")
START_WAIT_S = 300.0  # a started stack's wait to be healthy (a 7B checkpoint's stack takes over a minute)
STOP_WAIT_S = 60.0  # supervisord's wait for its programs to stop, before SIGKILL to its group
# The longest one probe of a sample (supervisord's XML-RPC, /metrics, nvidia-smi) may take: a hung process must
# not stop the series (a SIGSTOPped gateway accepts the connection and never answers).
PROBE_TIMEOUT_S = 5.0
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

    @classmethod
    def from_config(cls, base_url: str, config: Path) -> Stack:
        cfg = load_config(config)
        return cls(base_url, cfg.run_path / "supervisord.conf", f"vlm-{cfg.deployment_id}-")

    def rpc(self) -> Any:
        """A proxy of its own for each call: supervisord's transport keeps one connection, which two threads (the
        sampler's, the chaos's) must never share, and it has no timeout of its own (`TimedTransport`)."""
        if self.conf is None:
            raise RuntimeError("no supervisord known for this stack (give --config)")
        return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=TimedTransport(_server_url(self.conf)))

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
            return self.scrape()
        except (OSError, http.client.HTTPException, ValueError):
            return {}

    def scrape(self) -> dict[str, float]:
        """`metrics`, raising when the gateway does not answer within ``PROBE_TIMEOUT_S`` or answers no exposition."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=PROBE_TIMEOUT_S) as r:
            return gauges(r.read().decode())

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


class _TimedUnixConnection(UnixStreamHTTPConnection):
    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socketfile)


class TimedTransport(SupervisorTransport):
    """supervisord's XML-RPC transport (a unix socket or HTTP) whose every socket operation gives up after
    ``timeout_s``: a supervisord that takes the connection and never answers raises instead of hanging."""

    def __init__(self, serverurl: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
        super().__init__(None, None, serverurl=serverurl)
        self._get_connection = lambda: _timed_connection(serverurl, timeout_s)


def _timed_connection(serverurl: str, timeout_s: float) -> http.client.HTTPConnection:
    if serverurl.startswith("unix://"):
        connection = _TimedUnixConnection("localhost", timeout=timeout_s)
        connection.socketfile = serverurl.removeprefix("unix://")
        return connection
    parsed = urlparse(serverurl)
    return http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port or 80, timeout=timeout_s)


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


def gpu_memory_mib(timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, float]:
    """Used memory of each GPU (nvidia-smi), {} without one. An nvidia-smi that does not end within ``timeout_s``
    is killed, and not waited for past that (``subprocess.run`` would wait for it without end once killed)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    query = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
    try:
        process = subprocess.Popen(query, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return {}
    try:
        out, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.communicate(timeout=1.0)
        raise TimeoutError(f"nvidia-smi did not answer within {timeout_s:g} s") from None
    used = {}
    for line in out.splitlines():
        index, _, mib = line.partition(",")
        if mib.strip():
            used[index.strip()] = float(mib)
    return used


def processes_usage(stack: Stack) -> dict[str, dict[str, float]]:
    """Each running process's pid, RSS, anonymous RSS and fds (supervisord's list; a process gone meanwhile is left
    out)."""
    out: dict[str, dict[str, float]] = {}
    for p in stack.processes():
        usage = process_usage(p.pid) if p.pid else None
        if usage is not None:
            out[p.name] = {"pid": p.pid, "rss_mib": usage[0], "anon_mib": usage[1], "fds": usage[2]}
    return out


def in_thread(probe: Callable[[], Any]) -> asyncio.Future[Any]:
    """``probe()`` in a daemon thread of its own, as a future of the running loop: a probe that never returns holds
    no pool's worker and does not keep the interpreter from exiting."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    future.add_done_callback(lambda f: f.cancelled() or f.exception())  # (a late failure: retrieved, no log noise)

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def run() -> None:
        try:
            result, error = probe(), None
        except Exception as exc:  # (any failure: the sample records it as missing)
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile: nobody waits)
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="soak-probe", daemon=True).start()
    return future


@dataclass
class Sampler:
    """The resource samples of a stack, every probe bounded: each runs in a thread of its own and is waited for at
    most ``timeout_s``; one that fails or does not answer in time is recorded in the sample's ``missing`` (its
    values absent) and the series goes on. While a probe still hangs, later samples skip it rather than pile up
    threads behind it."""

    stack: Stack
    timeout_s: float = PROBE_TIMEOUT_S
    running: dict[str, asyncio.Future[Any]] = field(default_factory=dict)

    def probes(self) -> dict[str, Callable[[], Any]]:
        return {
            "processes": lambda: processes_usage(self.stack),
            "shm": lambda: shm_bytes(self.stack.shm_prefix),
            "metrics": self.stack.scrape,
            "gpu_mib": lambda: gpu_memory_mib(self.timeout_s),
        }

    async def sample(self, t: float) -> dict[str, Any]:
        """One sample at run time ``t``: each process's pid, RSS and fds, the stack's /dev/shm, its gauges, GPUs."""
        probes = self.probes()
        answers = await asyncio.gather(*(self._probe(name, probe) for name, probe in probes.items()))
        got = {name: value for name, (value, why) in zip(probes, answers, strict=True) if not why}
        missing = {name: why for name, (_, why) in zip(probes, answers, strict=True) if why}
        shm, shm_files = got.get("shm", (None, None))
        return {
            "t": t,
            "processes": got.get("processes", {}),
            "shm_bytes": shm,
            "shm_files": shm_files,
            "metrics": got.get("metrics", {}),
            "gpu_mib": got.get("gpu_mib", {}),
            "missing": missing,
        }

    async def _probe(self, name: str, probe: Callable[[], Any]) -> tuple[Any, str]:
        """(its value, "") or (None, why it is missing)."""
        before = self.running.get(name)
        if before is not None and not before.done():
            return None, "its last probe has not answered yet"
        future = self.running[name] = in_thread(probe)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s), ""
        except TimeoutError:
            return None, f"no answer within {self.timeout_s:g} s"
        except Exception as exc:
            return None, f"{type(exc).__name__}: {exc}"
