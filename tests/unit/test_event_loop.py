"""Unit tests for ``common/transport.py``: typed channels, the event loop, timers and thread wakeups."""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from common.protocol import Message, Ping, WorkerStatus, encode
from common.transport import Channel, EventLoop, Wakeup

TIMEOUT_MS = 2000


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.term()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # ipc:// paths must stay short (sun_path is ~107 bytes), so not tmp_path.
    path = Path(tempfile.mkdtemp(prefix="vlm-t-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["inproc", "ipc"])
def address(request: pytest.FixtureRequest, short_dir: Path) -> str:
    if request.param == "inproc":
        return f"inproc://test-{uuid.uuid4().hex}"
    return f"ipc://{short_dir / 'sub' / 'hub.sock'}"  # the parent is created on bind


@pytest.fixture
def pair(ctx: zmq.Context, address: str) -> Iterator[tuple[Channel, Channel]]:
    router = Channel(ctx, zmq.ROUTER, address, bind=True)
    dealer = Channel(ctx, zmq.DEALER, address, bind=False, identity=b"worker-1")
    yield router, dealer
    dealer.close()
    router.close()


def recv(channel: Channel) -> tuple[bytes, Message | None]:
    assert channel.sock.poll(TIMEOUT_MS), "nothing arrived"
    return channel.recv()


def run_until(loop: EventLoop, done: Any, timeout_s: float = 2.0) -> int:
    handled = 0
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        handled += loop.run_once(0.05)
    return handled


def close(wake: Wakeup) -> None:
    os.close(wake.read_fd)
    os.close(wake.write_fd)


# --------------------------------------------------------------------------- Channel


def test_dealer_router_typed_round_trip(pair: tuple[Channel, Channel]) -> None:
    router, dealer = pair
    dealer.send(Ping("fetcher"))
    peer, msg = recv(router)
    assert peer == b"worker-1"
    assert msg == Ping("fetcher")
    status = WorkerStatus("encoder", "encoder.0", "inc", 3)
    assert router.send_to(peer, status) is True
    peer_back, reply = recv(dealer)
    assert peer_back == b""  # a DEALER has no peer identity to report
    assert reply == status


def test_two_dealers_are_told_apart(ctx: zmq.Context, pair: tuple[Channel, Channel]) -> None:
    router, first = pair
    second = Channel(ctx, zmq.DEALER, router.address, bind=False, identity=b"worker-2")
    try:
        first.send(Ping("one"))
        second.send(Ping("two"))
        got = dict(recv(router) for _ in range(2))
        assert got == {b"worker-1": Ping("one"), b"worker-2": Ping("two")}
        assert router.send_to(b"worker-2", Ping("for two"))
        assert recv(second) == (b"", Ping("for two"))
        assert first.sock.poll(50) == 0  # the other dealer got nothing
    finally:
        second.close()


def test_ipc_bind_creates_the_run_dir(ctx: zmq.Context, short_dir: Path) -> None:
    sock_path = short_dir / "a" / "b" / "x.sock"
    router = Channel(ctx, zmq.ROUTER, f"ipc://{sock_path}", bind=True)
    try:
        assert sock_path.exists()
    finally:
        router.close()


@pytest.mark.parametrize(
    "frame",
    [b"\xc1garbage", b"", pickle.dumps(Ping("x")), msgpack.packb([99, "Ping", {"sender": "x"}])],
    ids=["garbage", "empty", "pickle", "bad-version"],
)
def test_bad_frame_is_dropped_and_logged(
    pair: tuple[Channel, Channel], caplog: pytest.LogCaptureFixture, frame: bytes
) -> None:
    router, dealer = pair
    dealer.sock.send(frame)  # raw bytes behind the typed channel's back
    with caplog.at_level(logging.WARNING, logger="common.transport"):
        peer, msg = recv(router)
    assert peer == b"worker-1" and msg is None
    assert any("dropping a bad frame" in r.getMessage() for r in caplog.records)
    # The channel still works afterwards.
    dealer.send(Ping("after"))
    assert recv(router) == (b"worker-1", Ping("after"))


def test_bad_frame_to_a_dealer_is_dropped(pair: tuple[Channel, Channel], caplog: pytest.LogCaptureFixture) -> None:
    router, dealer = pair
    dealer.send(Ping("hello"))
    recv(router)
    router.sock.send_multipart([b"worker-1", b"\x00\x01 not a message"])
    with caplog.at_level(logging.WARNING, logger="common.transport"):
        assert recv(dealer) == (b"", None)
    assert any("dropping a bad frame" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("tag", [None, ["Ping"]], ids=["nil-tag", "array-tag"])
def test_frame_with_a_non_string_tag_is_dropped(pair: tuple[Channel, Channel], tag: Any) -> None:
    router, dealer = pair
    dealer.sock.send(msgpack.packb([1, tag, {"sender": "x"}]))
    assert recv(router) == (b"worker-1", None)


def test_send_to_an_unknown_peer_returns_false(pair: tuple[Channel, Channel]) -> None:
    router, dealer = pair
    assert router.send_to(b"nobody", Ping("x")) is False
    dealer.send(Ping("hi"))
    recv(router)
    assert router.send_to(b"worker-1", Ping("x")) is True  # a known one still works
    assert router.send_to(b"worker-1x", Ping("x")) is False


# --------------------------------------------------------------------------- EventLoop


def test_run_once_dispatches_to_the_right_handler(ctx: zmq.Context, pair: tuple[Channel, Channel]) -> None:
    router, dealer = pair
    loop = EventLoop()
    at_router: list[tuple[bytes, Message]] = []
    at_dealer: list[tuple[bytes, Message]] = []
    loop.on_message(router, lambda peer, msg: at_router.append((peer, msg)))
    loop.on_message(dealer, lambda peer, msg: at_dealer.append((peer, msg)))
    for i in range(3):
        dealer.send(Ping(f"p{i}"))
    dealer.sock.send(b"\xc1 bad frame in the middle")
    dealer.send(Ping("p3"))
    time.sleep(0.05)  # let every frame reach the router (ipc is asynchronous)
    handled = loop.run_once(1.0)
    assert handled == 4  # one call drains them all; the bad frame is not counted and does not stop the drain
    assert at_router == [(b"worker-1", Ping(f"p{i}")) for i in range(4)]
    assert at_dealer == []
    router.send_to(b"worker-1", Ping("back"))
    run_until(loop, lambda: bool(at_dealer))
    assert at_dealer == [(b"", Ping("back"))]


def test_run_once_waits_up_to_max_wait_when_idle(pair: tuple[Channel, Channel]) -> None:
    router, _ = pair
    loop = EventLoop()
    loop.on_message(router, lambda peer, msg: None)
    start = time.monotonic()
    assert loop.run_once(0.05) == 0
    elapsed = time.monotonic() - start
    assert 0.03 <= elapsed < 0.5


def test_run_once_waits_even_with_nothing_registered() -> None:
    loop = EventLoop()
    start = time.monotonic()
    loop.run_once(0.05)
    assert time.monotonic() - start >= 0.03


def test_timers_fire_when_due() -> None:
    loop = EventLoop()
    fast: list[float] = []
    slow: list[float] = []
    loop.every(0.02, lambda: fast.append(time.monotonic()))
    loop.every(30.0, lambda: slow.append(time.monotonic()))
    assert loop.run_once(0.0) == 0
    assert fast == []  # not due yet
    start = time.monotonic()
    run_until(loop, lambda: len(fast) >= 3, timeout_s=1.0)
    assert time.monotonic() - start < 0.5
    assert all(b - a >= 0.015 for a, b in itertools.pairwise(fast))  # period respected
    assert slow == []


def test_run_once_waits_only_until_the_next_timer(pair: tuple[Channel, Channel]) -> None:
    router, _ = pair
    loop = EventLoop()
    loop.on_message(router, lambda peer, msg: None)
    fired: list[int] = []
    loop.every(0.05, lambda: fired.append(1))
    start = time.monotonic()
    loop.run_once(5.0)  # the wait is capped by the timer, not by max_wait_s
    elapsed = time.monotonic() - start
    assert 0.03 <= elapsed < 0.5
    # poll() takes whole milliseconds, so the timer may be due a fraction of a millisecond later.
    run_until(loop, lambda: bool(fired), timeout_s=0.1)
    assert fired == [1]


def test_run_and_stop() -> None:
    loop = EventLoop()
    loop.every(0.01, loop.stop)
    steps: list[int] = []

    def step() -> bool:
        steps.append(1)
        return len(steps) < 3

    start = time.monotonic()
    loop.run(step)
    assert time.monotonic() - start < 1.0
    assert len(steps) >= 3


STOPPED_BY_SIGNAL = """
import sys, time
from common.lifecycle import on_terminate
from common.transport import EventLoop
loop = EventLoop()
loop.every(60.0, lambda: None)  # the only timer: without a wake-up the wait would last a minute
on_terminate(loop.stop)
print("ready", flush=True)
loop.run()
print("stopped", flush=True)
"""


def test_sigterm_ends_a_loop_waiting_for_a_distant_timer_at_once() -> None:
    # supervisord stops a worker with SIGTERM; an encoder idle between its 5-s reports took 5 s to go.
    worker = subprocess.Popen([sys.executable, "-c", STOPPED_BY_SIGNAL], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None and worker.stdout.readline() == "ready\n"
        time.sleep(0.2)  # into the poll's wait
        start = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=10) == 0
        assert time.monotonic() - start < 1.0
        assert worker.stdout.read() == "stopped\n"
    finally:
        worker.kill()


def test_stop_from_another_thread_ends_the_wait() -> None:
    loop = EventLoop()
    loop.every(60.0, lambda: None)
    stopper = threading.Timer(0.05, loop.stop)
    start = time.monotonic()
    stopper.start()
    loop.run()
    stopper.join()
    assert time.monotonic() - start < 1.0


def test_wakeup_from_another_thread_is_prompt() -> None:
    loop = EventLoop()
    loop.every(30.0, lambda: None)  # so run_once would otherwise wait the full max_wait_s
    got: list[tuple[object, int]] = []
    wake = Wakeup(loop, lambda item: got.append((item, threading.get_ident())))
    poster = threading.Timer(0.05, wake.post, args=("result-1",))
    try:
        start = time.monotonic()
        poster.start()
        handled = loop.run_once(2.0)
        elapsed = time.monotonic() - start
        poster.join()
        assert handled == 1
        assert got == [("result-1", threading.get_ident())]  # handled on the loop's thread
        assert elapsed < 0.5
    finally:
        close(wake)


def test_wakeup_drains_everything_posted_in_order() -> None:
    loop = EventLoop()
    got: list[object] = []
    wake = Wakeup(loop, got.append)
    threads = [threading.Thread(target=lambda i=i: wake.post(i)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wake.post("last")
    run_until(loop, lambda: len(got) >= 21)
    assert sorted(x for x in got if isinstance(x, int)) == list(range(20))
    assert got[-1] == "last"
    assert loop.run_once(0.0) == 0  # nothing left behind
    assert len(got) == 21
    close(wake)


def test_encode_helper_matches_channel_send(pair: tuple[Channel, Channel]) -> None:
    # A frame built by hand with encode() is accepted like one sent through send().
    router, dealer = pair
    dealer.sock.send(encode(Ping("by hand")))
    assert recv(router) == (b"worker-1", Ping("by hand"))
