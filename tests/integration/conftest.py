"""Fixtures that run the real stack: ``./ops/serve`` under supervisord, and a real HTTP media server."""

from __future__ import annotations

import collections
import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from benchmarks.gateway_load import free_port
from benchmarks.hf_chat import HfChat
from common.config import load_config
from workers.models.synth import generate_checkpoint

REPO = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every stack test is slow (each starts real processes): ``./ops/test --fast`` leaves them out. The tests on
    `family_stack` run one after another, grouped by family, where the first of them was: so that no family's stack
    waits idle, beside the other tests' stacks, for the last module that takes it (pytest's own order, applied after
    this, keeps each family's tests together and so this order)."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.slow)
    on_family_stack = [item for item in items if "family_stack" in getattr(item, "fixturenames", ())]
    if on_family_stack:
        first = items.index(on_family_stack[0])
        families = {id(item): item.callspec.params["family_stack"] for item in on_family_stack}  # type: ignore[attr-defined]
        order = list(dict.fromkeys(families.values()))
        on_family_stack.sort(key=lambda item: order.index(families[id(item)]))
        rest = [item for item in items if id(item) not in families]
        items[:] = rest[:first] + on_family_stack + rest[first:]


@dataclass
class Stack:
    base_url: str
    config_path: Path
    process: subprocess.Popen[bytes]

    @property
    def run_dir(self) -> Path:
        return load_config(self.config_path).run_path

    def ctl(self, *args: str) -> str:
        out = subprocess.run(
            [str(REPO / ".venv/bin/supervisorctl"), "-c", str(self.run_dir / "supervisord.conf"), *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.strip()

    def pid(self, process: str) -> int:
        """The pid of a process by its name (``decoder``, ``encoder-0``; supervisorctl's name for a numbered one
        is ``encoder:encoder-0``); 0 while it is not running."""
        for line in self.ctl("status").splitlines():
            name, _, rest = line.partition(" ")
            if name.split(":")[-1] == process:
                return int(rest.split("pid ")[1].split(",")[0]) if "pid " in rest else 0
        raise KeyError(f"supervisord runs no process {process!r}")

    def get_json(self, path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ops/serve exited with {self.process.returncode}")
            try:
                status, _ = self.get_json("/health")
                if status == 200:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)  # (the bound is the timeout; a short period starts each test sooner)
        raise TimeoutError(f"stack not healthy within {timeout_s}s; logs in {self.run_dir / 'logs'}")


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The whole stack as ``./ops/serve`` starts it, on a free port, allowing loopback media URLs."""
    yield from serve(tmp_path_factory, "test", "[cache]\npending_ttl_s = 30.0\n")


CURVE_HUBS = ("gateway", "fetch", "cache", "decoder", "encoder.0")


@pytest.fixture(scope="session")
def curve_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The whole stack with every hub on tcp:// (loopback) under CurveZMQ, its keys written by `vlm-serve keys`."""
    keys = tmp_path_factory.mktemp("keys")
    subprocess.run(
        [sys.executable, "-m", "ops.cli", "keys", "--dir", str(keys)], check=True, capture_output=True, cwd=REPO
    )
    endpoints = "".join(f'"{hub}" = "tcp://127.0.0.1:{free_port()}"\n' for hub in CURVE_HUBS)
    yield from serve(tmp_path_factory, "curve", f'[security]\nkeys_dir = "{keys}"\n[endpoints]\n{endpoints}')


def serve(
    tmp_path_factory: pytest.TempPathFactory, name: str, extra_toml: str = "", server_toml: str = ""
) -> Iterator[Stack]:
    """``./ops/serve`` on a free port with loopback media allowed, plus ``extra_toml`` (whole sections) and
    ``server_toml`` (lines of [server]); stopped with SIGTERM afterwards (see `STOPPING`). Its output goes to
    ``run/serve-<name>.log``."""
    STOPPING.reap(name)
    port = STOPPING.free_port()
    config = stack_config(tmp_path_factory.mktemp(name), port, extra_toml, server_toml)
    env = {**os.environ, "VLM_CONFIG": str(config)}
    (REPO / "run").mkdir(exist_ok=True)
    with open(REPO / "run" / f"serve-{name}.log", "wb") as log:
        process = subprocess.Popen([str(REPO / "ops/serve")], env=env, stdout=log, stderr=subprocess.STDOUT)
    stack = Stack(f"http://127.0.0.1:{port}", config, process)
    try:
        wake_supervisord(stack)
        stack.wait_healthy()
        yield stack
    finally:
        process.send_signal(signal.SIGTERM)
        STOPPING.add(name, port, process)


def wait_listening(address: str, port: int, process: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    """Until something accepts TCP connections at ``address``:``port`` (a unit without a gateway, an encoder unit, is
    up once its encoders bound their sockets, after loading their towers); ``process`` is its ops/serve."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the unit serving {address}:{port} exited with {process.returncode}")
        with socket.socket() as probe:
            probe.settimeout(1.0)
            if probe.connect_ex((address, port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listened on {address}:{port} within {timeout_s:.0f} s")


def wake_supervisord(stack: Stack, timeout_s: float = 60.0) -> None:
    """Connect once to the stack's supervisord socket as soon as it listens. supervisord spawns its programs only after
    its main loop's first poll, which waits up to a second for an event when none comes: a connection is one, so the
    programs start that second sooner. Returns without one if ops/serve exits first (`Stack.wait_healthy` says why)."""
    path = str(stack.run_dir / "supervisor.sock")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and stack.process.poll() is None:
        with socket.socket(socket.AF_UNIX) as probe:
            try:
                probe.connect(path)
                return
            except OSError:  # (not there yet, or a stopped stack's leftover file that no one listens on)
                pass
        time.sleep(0.02)


@dataclass
class _Stopping:
    """Stacks sent SIGTERM and not yet gone. Supervisord stops its programs one after another, which takes
    seconds of waiting, not of work: the next test starts meanwhile instead of waiting for it. A stopping stack's
    port (its run directory is ``run/<port>``) and log name are not given to a new stack until it is gone; the
    session's end waits for every one (``kill`` past `STOP_TIMEOUT_S`, as a synchronous stop did)."""

    processes: dict[str, tuple[int, float, subprocess.Popen[bytes]]]

    def add(self, name: str, port: int, process: subprocess.Popen[bytes]) -> None:
        self.reap(name)  # (a name whose earlier stack is still stopping: this one waits for that first)
        self.processes[name] = (port, time.monotonic(), process)

    def reap(self, name: str | None = None) -> None:
        """Forget the stacks that are gone; wait for ``name``'s (every one's if None)."""
        for key, (_, signalled, process) in list(self.processes.items()):
            if name is None or key == name:
                try:
                    process.wait(timeout=max(0.0, signalled + STOP_TIMEOUT_S - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            if process.poll() is not None:
                del self.processes[key]

    def free_port(self) -> int:
        taken = {port for port, _, _ in self.processes.values()}
        while (port := free_port()) in taken:
            pass
        return port


STOP_TIMEOUT_S = 30.0
STOPPING = _Stopping({})


@pytest.fixture(scope="session", autouse=True)
def _every_stack_stopped() -> Iterator[None]:
    yield
    STOPPING.reap()


def stack_config(directory: Path, port: int, extra_toml: str = "", server_toml: str = "") -> Path:
    """The test stacks' settings file in ``directory``: ``port``, loopback media allowed, short fetch timeouts, plus
    ``extra_toml`` (whole sections) and ``server_toml`` (lines of [server])."""
    config = directory / "vlm.toml"
    config.write_text(
        f"[server]\nport = {port}\nrequest_timeout_s = 120.0\n{server_toml}"
        "[fetcher]\nallow_private_addresses = true\nhttp_timeout_s = 5.0\nencode_timeout_s = 30.0\n" + extra_toml
    )
    return config


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_checkpoint(family)``: that family's tiny seed-0 synthetic checkpoint, generated once a session for the
    modules that serve or read it as it is (one that changes its files makes its own)."""
    made: dict[str, Path] = {}

    def checkpoint(family: str) -> Path:
        if family not in made:
            made[family] = generate_checkpoint(tmp_path_factory.mktemp(family) / "tiny", "tiny", 0, family=family)
        return made[family]

    return checkpoint


@pytest.fixture(scope="session")
def family_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Callable[[str], Path]
) -> Iterator[Stack]:
    """The whole stack on a family's tiny checkpoint (`tiny_checkpoint`), with the test settings: one for every module
    that serves that checkpoint as it is. A module takes it with ``pytest.mark.parametrize("family_stack", FAMILIES,
    indirect=True, scope="session")``; pytest then runs those modules' tests of one family one after another, on one
    stack, and stops it before it starts the next family's."""
    family: str = request.param
    yield from serve(tmp_path_factory, family, f'[model]\npath = "{tiny_checkpoint(family)}"\n')


@pytest.fixture(scope="session")
def client(stack: Stack) -> OpenAI:
    """The official OpenAI client against the stack (no retries: every answer is the first one)."""
    return OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def hf(stack: Stack) -> HfChat:
    """transformers' own model and processor on the stack's checkpoint: the parity reference."""
    return HfChat(load_config(stack.config_path).model_path())


SLOW_MEDIA_S = 0.5  # how long the media server holds a /slow/ path before answering


class _MediaServer(http.server.ThreadingHTTPServer):
    hits: collections.Counter[str]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    server: _MediaServer

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.server.hits[self.path] += 1
        if self.path.startswith("/slow/"):  # the file itself, late: requests for it overlap
            time.sleep(SLOW_MEDIA_S)
            self.path = self.path.removeprefix("/slow")
        super().do_GET()


@dataclass
class MediaServer:
    root: Path
    base_url: str
    hits: collections.Counter[str]  # GET requests by path, /slow/ included

    def put(self, name: str, data: bytes) -> str:
        (self.root / name).write_bytes(data)
        return f"{self.base_url}/{name}"

    def slow_url(self, name: str) -> str:
        """The URL of file ``name`` answered SLOW_MEDIA_S late."""
        return f"{self.base_url}/slow/{name}"


@pytest.fixture(scope="session")
def media_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MediaServer]:
    root = tmp_path_factory.mktemp("media")
    server = _MediaServer(
        ("127.0.0.1", 0),
        lambda *a: _QuietHandler(*a, directory=str(root)),  # type: ignore[misc]
    )
    server.hits = collections.Counter()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield MediaServer(root, f"http://127.0.0.1:{server.server_address[1]}", server.hits)
    finally:
        server.shutdown()


WORKER_COMMANDS = [
    ["workers.cache"],
    ["workers.encoder", "--gpu", "0"],
    ["workers.fetcher"],
    ["workers.decoder"],
    ["gateway"],
]


def _healthy(base_url: str, processes: list[subprocess.Popen[bytes]], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise RuntimeError("a worker exited during start-up")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    raise TimeoutError("hand-started stack not healthy")


def checkpoint_with_generation(source: Path, target: Path, changes: dict[str, Any]) -> Path:
    """A copy of the checkpoint at ``source`` (its files linked) whose generation_config.json has ``changes``."""
    target.mkdir()
    for item in source.iterdir():
        if item.name != "generation_config.json":
            (target / item.name).symlink_to(item)
    generation = json.loads((source / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**generation, **changes}))
    return target


@contextlib.contextmanager
def hand_started_stack(
    root: Path, model: Path, settings: str = "", api_keys: list[str] | None = None, server: str = ""
) -> Iterator[str]:
    """Each process started by hand (``python -m ...``), as a developer debugging would; yields the base URL.

    ``settings`` is extra TOML (sections other than [server]), ``server`` extra lines of [server]; sockets
    live under ``root``.
    """
    port = STOPPING.free_port()
    config = root / "vlm.toml"
    keys = json.dumps(api_keys or [])
    config.write_text(f'run_dir = "{root / "run"}"\n[server]\nport = {port}\napi_keys = {keys}\n{server}{settings}')
    env = {**os.environ, "VLM_CONFIG": str(config), "VLM_MODEL": str(model)}
    processes = []
    with open(root / "workers.log", "wb") as log:
        for args in WORKER_COMMANDS:
            cmd = [sys.executable, "-m", *args, "--config", str(config)]
            processes.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        _healthy(f"http://127.0.0.1:{port}", processes)  # /health needs no key
        yield f"http://127.0.0.1:{port}"
    finally:
        for args, p in zip(WORKER_COMMANDS, processes, strict=False):
            p.send_signal(signal.SIGTERM)
            STOPPING.add(f"{root}: {' '.join(args)}", port, p)
