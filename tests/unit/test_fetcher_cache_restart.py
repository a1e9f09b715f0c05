"""The fetcher and a cache daemon that restarts, over real sockets (the test holds the cache's ROUTER).

The fetcher knows a daemon restarted when a ping is answered by another incarnation than the one it knew; then it
sends again every reservation the lost daemon held. So it must know the first daemon's incarnation before any
call: it asks at start. (It used to ask only while calls were outstanding, at a heartbeat: a daemon killed before
answering any of those was never known, its replacement's answer was taken for the same daemon, and reservations
lost with the first waited out their deadline: the 60 s stalls of a ``kill -9`` of the cache under CPU load.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from common.config import Config
from common.protocol import FetcherStarted, Message, StatsRequest, StatsResult, decode, encode
from workers.fetcher.worker import FetcherWorker
from workers.models.synth import generate_checkpoint

WAIT_MS = 5000


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_checkpoint(tmp_path_factory.mktemp("fetcher") / "tiny", "tiny", seed=0)


@pytest.fixture
def cache_and_fetcher(tmp_path: Path, checkpoint: Path) -> Iterator[tuple[zmq.Socket, FetcherWorker]]:
    cfg = Config(run_dir=str(tmp_path / "run"))
    cfg.model.path = str(checkpoint)
    ctx = zmq.Context()
    cache = ctx.socket(zmq.ROUTER)
    cache.linger = 0
    (tmp_path / "run").mkdir()
    cache.bind(cfg.endpoint("cache"))
    fetcher = FetcherWorker(cfg)
    try:
        yield cache, fetcher
    finally:
        fetcher.transport.close()
        ctx.destroy(linger=0)


def received(cache: zmq.Socket) -> tuple[bytes, Message | None]:
    assert cache.poll(WAIT_MS), "the fetcher sent the cache daemon nothing"
    peer, frame = cache.recv_multipart()
    return peer, decode(frame)


def test_the_fetcher_learns_the_daemons_incarnation_as_it_starts(
    cache_and_fetcher: tuple[zmq.Socket, FetcherWorker],
) -> None:
    cache, fetcher = cache_and_fetcher
    peer, first = received(cache)
    assert isinstance(first, FetcherStarted)
    _, ping = received(cache)
    assert isinstance(ping, StatsRequest), ping  # before any request came, so before any reservation
    cache.send_multipart([peer, encode(StatsResult(ping.call_id, "cache", "first", {}))])
    fetcher.loop.run_once(WAIT_MS / 1000)
    assert fetcher.cache_incarnation == "first"


def test_an_answer_from_a_new_incarnation_is_a_restart(cache_and_fetcher: tuple[zmq.Socket, FetcherWorker]) -> None:
    cache, fetcher = cache_and_fetcher
    peer, _ = received(cache)
    _, ping = received(cache)
    assert isinstance(ping, StatsRequest)
    cache.send_multipart([peer, encode(StatsResult(ping.call_id, "cache", "first", {}))])
    fetcher.loop.run_once(WAIT_MS / 1000)
    fetcher.ping_cache()
    while not isinstance(msg := received(cache)[1], StatsRequest):
        pass
    cache.send_multipart([peer, encode(StatsResult(msg.call_id, "cache", "second", {}))])
    fetcher.loop.run_once(WAIT_MS / 1000)
    assert fetcher.cache_incarnation == "second"
    # The restart's handling: the new daemon is told this fetcher's reservations there start afresh.
    while not isinstance(msg := received(cache)[1], FetcherStarted):
        pass
    assert msg.incarnation == fetcher.incarnation
