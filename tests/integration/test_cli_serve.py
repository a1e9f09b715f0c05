"""``vlm-serve serve`` starts the stack: the console script that ``ops/install`` puts beside the venv's python, run as a
real process, answers a chat completion through the official client, and SIGTERM leaves neither supervisord nor any
of its children running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from openai import OpenAI

from benchmarks.gateway_load import free_port
from tests.integration.conftest import REPO, Stack, stack_config

PROGRAMS = ("cache", "encoder-0", "fetcher-0", "decoder", "gateway")


def gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_vlm_serve_runs_the_stack_until_sigterm(tmp_path: Path) -> None:
    port = free_port()
    config = stack_config(tmp_path, port)
    (REPO / "run").mkdir(exist_ok=True)
    script = Path(sys.executable).parent / "vlm-serve"
    assert script.exists(), f"{script} is missing: ops/install (pip install -e .) makes it"
    command = [str(script), "serve", "--port", str(port), "--config", str(config)]
    with open(REPO / "run" / "serve-cli.log", "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    stack = Stack(f"http://127.0.0.1:{port}", config, process)
    try:
        stack.wait_healthy()
        children = {name: stack.pid(name) for name in PROGRAMS}
        assert all(children.values()), children
        client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=4, temperature=0
        )
        assert reply.choices[0].message.role == "assistant"
        assert reply.usage is not None and reply.usage.completion_tokens >= 1
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert process.returncode == 0  # supervisord itself (it replaced the python process: same pid)
    printed = (REPO / "run" / "serve-cli.log").read_text()
    for choice in ("layout: no GPU -> ", "embedding pool: host shared memory (auto", "SM split: off", "CUDA MPS: off"):
        assert choice in printed, f"the start-up output names no {choice!r} line"
    assert [name for name, pid in children.items() if not gone(pid)] == []
