"""supervisord's end, both ways. Killed hard (SIGKILL, as the OOM killer does), it takes its workers with it: each
asked at start-up for SIGTERM on its parent's death, so none is left holding the deployment's sockets for the next
start. Stopped (SIGTERM), it lets the streams in flight finish first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from openai import OpenAI

from tests.integration.conftest import REPO, serve


def alive(pid: int) -> bool:
    """Running (a zombie nobody has reaped yet has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_for(predicate: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.1)  # watching another process's state from outside
    return False


def test_workers_end_when_supervisord_is_killed(tmp_path: Path) -> None:
    # the cache daemon (ours), and a program that is not ours started as the MPS control daemon is (`sleep` here)
    config = tmp_path / "vlm.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\n')
    log = tmp_path / "cache.log"
    (tmp_path / "supervisord.conf").write_text(
        f"[supervisord]\nnodaemon = true\nlogfile = {tmp_path / 'supervisord.log'}\npidfile = {tmp_path / 's.pid'}\n"
        f"[program:cache]\ncommand = {sys.executable} -m workers.cache --config {config}\ndirectory = {REPO}\n"
        f"redirect_stderr = true\nstdout_logfile = {log}\nstartsecs = 1\n"
        f"[program:foreign]\ncommand = /bin/sh -c 'exec {sys.executable} -m common.exec_supervised sleep 600'\n"
        f"directory = {REPO}\nstartsecs = 1\n"
    )
    supervisord = subprocess.Popen(
        [str(Path(sys.executable).parent / "supervisord"), "-c", str(tmp_path / "supervisord.conf")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    children = Path(f"/proc/{supervisord.pid}/task/{supervisord.pid}/children")

    def programs() -> list[int]:
        return [int(pid) for pid in children.read_text().split()]

    def sleeping() -> bool:  # the foreign program has become `sleep` (past the exec, its death signal asked for)
        return any(Path(f"/proc/{pid}/comm").read_text().strip() == "sleep" for pid in programs())

    pids: list[int] = []
    try:
        # ready: past start_process (where the parent-death signal is asked for), its socket bound
        assert wait_for(lambda: log.exists() and "ready" in log.read_text(), 60), (
            log.read_text() if log.exists() else ""
        )
        assert wait_for(sleeping, 30)
        pids = programs()
        assert len(pids) == 2, pids
        os.kill(supervisord.pid, signal.SIGKILL)
        supervisord.wait(timeout=10)
        assert wait_for(lambda: not any(alive(pid) for pid in pids), 20), "a program outlived supervisord"
    finally:
        if supervisord.poll() is None:
            supervisord.kill()
        for pid in pids:  # (the failure above: no orphan left behind it)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_stopped_stack_lets_its_streams_finish(tmp_path_factory: pytest.TempPathFactory) -> None:
    # supervisord stops the gateway first and waits for it; the gateway stops listening and lets the streams in
    # flight finish before it exits, and only then are the workers stopped (they used to stop all at once, and
    # every stream ended with "the decoder is not responding")
    running = serve(tmp_path_factory, "drain")
    stack = next(running)
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=150,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)  # the stream is under way
    stack.process.send_signal(signal.SIGTERM)
    rest = list(chunks)
    finishes = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"] and rest[-1].usage is not None and rest[-1].usage.completion_tokens == 150
    assert stack.process.wait(timeout=60) == 0
    with pytest.raises(StopIteration):  # (serve's own stop: nothing left to do)
        next(running)
