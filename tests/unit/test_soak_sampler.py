"""The soak's resource sampler (`benchmarks.soak.sampler`, `benchmarks.soak_stack.Sampler`) against real sockets
that hang or answer nonsense, as a SIGSTOPped gateway (it accepts the connection and never answers) or a wedged
supervisord would: each sample comes back with the probe recorded as missing, and the series goes on."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from benchmarks import soak
from benchmarks.soak_stack import Sampler, Stack

# Far above the sampler's own bound in these tests (0.5 s): only a probe that waits without end reaches it.
HANG_BOUND_S = 30.0


def _serve(listener: socket.socket, answer: Callable[[socket.socket], None]) -> list[socket.socket]:
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # (the listener closed: the test is over)
            while True:
                connection = listener.accept()[0]
                held.append(connection)
                answer(connection)

    threading.Thread(target=accept, daemon=True).start()
    return held


def _never(_connection: socket.socket) -> None:
    pass


def _nonsense(connection: socket.socket) -> None:
    with contextlib.suppress(OSError):
        connection.recv(65536)
        connection.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/xml\r\nContent-Length: 9\r\n\r\nnot xml<<")
        connection.close()


@contextlib.contextmanager
def stack_answering(tmp_path: Path, answer: Callable[[socket.socket], None]) -> Iterator[Stack]:
    """A `Stack` whose gateway (TCP) and supervisord (a unix socket) both take connections and ``answer`` them."""
    gateway = socket.socket()
    gateway.bind(("127.0.0.1", 0))
    gateway.listen(16)
    supervisord = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    supervisord.bind(str(tmp_path / "supervisor.sock"))
    supervisord.listen(16)
    conf = tmp_path / "supervisord.conf"
    conf.write_text(f"[supervisorctl]\nserverurl = unix://{tmp_path / 'supervisor.sock'}\n")
    held = _serve(gateway, answer) + _serve(supervisord, answer)
    try:
        yield Stack(f"http://127.0.0.1:{gateway.getsockname()[1]}", conf)
    finally:
        gateway.close()
        supervisord.close()
        for connection in list(held):
            connection.close()


async def _bounded_sample(stack: Stack) -> dict[str, object]:
    return await asyncio.wait_for(Sampler(stack, timeout_s=0.5).sample(1.0), HANG_BOUND_S)


@pytest.mark.parametrize("answer", [_never, _nonsense], ids=["never-answers", "answers-nonsense"])
def test_a_sample_of_a_stack_that_hangs_or_answers_nonsense_records_its_probes_as_missing(
    tmp_path: Path, answer: Callable[[socket.socket], None]
) -> None:
    with stack_answering(tmp_path, answer) as stack:
        sample = asyncio.run(_bounded_sample(stack))
    assert "processes" in sample["missing"], sample["missing"]  # type: ignore[operator]
    if answer is _never:
        assert "metrics" in sample["missing"], sample["missing"]  # type: ignore[operator]
    assert sample["processes"] == {} and sample["metrics"] == {}  # (nonsense has no gauge in it)
    assert sample["t"] == 1.0


def test_the_series_goes_on_while_the_stack_hangs(tmp_path: Path) -> None:
    samples: list[dict[str, object]] = []

    async def sample_for_a_while(stack: Stack) -> None:
        task = asyncio.create_task(soak.sampler(stack, 0.0, 0.2, samples, probe_timeout_s=0.5))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), 4.0)
        task.cancel()

    with stack_answering(tmp_path, _never) as stack:
        asyncio.run(sample_for_a_while(stack))
    assert len(samples) >= 3, samples  # (one sample, or none, when a probe hung the sampler)
    # while a probe still hangs (its own socket timeout is longer), later samples skip it instead of piling up
    skipped = [s["missing"].get("metrics") for s in samples[1:]]  # type: ignore[union-attr]
    assert "its last probe has not answered yet" in skipped, samples
