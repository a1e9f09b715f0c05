"""The cache daemon when a fetcher restarts or a commit is stale, on real sockets (the test is the decoder).

A fetcher that restarts never fills the slots its predecessor reserved: the daemon fails them at once
(`FetcherStarted`, or the new incarnation's first `CacheReserve`), so a decoder waiting on one is told now, not
after ``pending_ttl_s``. A commit naming another slot than the one the daemon gives its hash now (an encode for a
freed slot, or for a lost daemon's pool) is ignored: it must not mark a slot ready that nobody wrote."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from common.config import Config
from common.protocol import (
    CacheAcquire,
    CacheAcquireResult,
    CacheCommit,
    CacheLookup,
    CacheReserve,
    FetcherStarted,
    Message,
    decode,
    encode,
)
from workers.cache.daemon import CacheDaemon

H = "ab" * 32


@dataclass
class Daemon:
    daemon: CacheDaemon
    decoder: zmq.Socket[bytes]

    def acquire(self, call_id: str, request_id: str) -> None:
        """The decoder's acquire of ``H``, through the socket (so that the daemon can route its answer)."""
        self.decoder.send(encode(CacheAcquire(call_id, request_id, [H])))
        peer, msg = self.daemon.channel.recv()
        assert msg is not None
        self.daemon.handle(peer, msg)

    def answer(self, timeout_ms: int = 2000) -> Message | None:
        return decode(self.decoder.recv()) if self.decoder.poll(timeout_ms) else None


@contextlib.contextmanager
def running_daemon(run_dir: Path) -> Iterator[Daemon]:
    """A cache daemon (handled by the test, message by message) and a decoder's socket connected to it."""
    cfg = Config()
    cfg.run_dir, cfg.cache.pool_bytes = str(run_dir), 1 << 20
    cache = CacheDaemon(cfg)
    decoder = zmq.Context.instance().socket(zmq.DEALER)
    decoder.setsockopt(zmq.IDENTITY, b"decoder")
    decoder.connect(cache.channel.address)
    try:
        yield Daemon(cache, decoder)
    finally:
        decoder.close(linger=0)
        cache.channel.close()
        cache.pool.unlink()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    with running_daemon(tmp_path) as running:
        yield running


def reserve(cache: CacheDaemon, request_id: str, incarnation: str) -> None:
    lookup = CacheLookup("0", H, 4 * 8, "float32", [4, 2])
    cache.handle(b"fetcher", CacheReserve(f"call-{request_id}", request_id, [lookup], "fetcher.0", incarnation))


@pytest.mark.parametrize("announced_by", ["FetcherStarted", "CacheReserve"])
def test_a_restarted_fetcher_frees_what_its_predecessor_reserved(daemon: Daemon, announced_by: str) -> None:
    reserve(daemon.daemon, "req-1", "fetcher-1")
    assert not daemon.daemon.store.entries[H].ready  # reserved for fetcher-1 to encode
    daemon.acquire("c1", "req-1")
    daemon.daemon.handle(b"fetcher", FetcherStarted("fetcher.0", "fetcher-1"))  # (the same process again)
    assert daemon.answer(200) is None and H in daemon.daemon.store.entries
    if announced_by == "FetcherStarted":
        daemon.daemon.handle(b"fetcher", FetcherStarted("fetcher.0", "fetcher-2"))
    else:
        reserve(daemon.daemon, "req-2", "fetcher-2")
    answer = daemon.answer()
    assert isinstance(answer, CacheAcquireResult) and answer.status == 503, answer
    assert "fetcher.0 that was encoding it restarted" in answer.message
    if announced_by == "CacheReserve":  # (failed first, then reserved again: for the new fetcher to encode)
        assert daemon.daemon.owners[H] == ("fetcher.0", "fetcher-2")
        assert not daemon.daemon.store.entries[H].ready


def test_another_fetchers_restart_frees_nothing(daemon: Daemon) -> None:
    reserve(daemon.daemon, "req-1", "fetcher-1")
    daemon.daemon.handle(b"other", FetcherStarted("fetcher.1", "fetcher-7"))
    daemon.daemon.handle(b"other", FetcherStarted("fetcher.1", "fetcher-8"))
    assert H in daemon.daemon.store.entries and daemon.daemon.owners[H] == ("fetcher.0", "fetcher-1")


@pytest.mark.parametrize("stale", ["other offset", "other pool"])
def test_a_commit_for_another_slot_is_ignored(daemon: Daemon, stale: str) -> None:
    reserve(daemon.daemon, "req-1", "fetcher-1")
    entry = daemon.daemon.store.entries[H]
    daemon.acquire("c1", "req-1")
    incarnation = daemon.daemon.incarnation
    if stale == "other offset":
        daemon.daemon.handle(b"encoder", CacheCommit(H, "", incarnation, entry.offset + 256))
    else:
        daemon.daemon.handle(b"encoder", CacheCommit(H, "", "cache-before", entry.offset))
    daemon.daemon.handle(b"encoder", CacheCommit(H, "a stale failure", incarnation, entry.offset + 256))
    assert daemon.answer(200) is None and not daemon.daemon.store.entries[H].ready
    daemon.daemon.handle(b"encoder", CacheCommit(H, "", incarnation, entry.offset))  # its own slot
    answer = daemon.answer()
    assert isinstance(answer, CacheAcquireResult) and answer.status == 200, answer
    assert answer.refs[0].offset == entry.offset


def test_a_replaced_fetchers_late_reservation_frees_nothing(daemon: Daemon) -> None:
    """A reservation the dead fetcher sent, read after its successor's start, does not take the name back."""
    daemon.daemon.handle(b"fetcher", FetcherStarted("fetcher.0", "fetcher-1"))
    daemon.daemon.handle(b"fetcher", FetcherStarted("fetcher.0", "fetcher-2"))
    reserve(daemon.daemon, "req-2", "fetcher-2")
    reserve(daemon.daemon, "req-1", "fetcher-1")  # (late)
    assert daemon.daemon.fetchers["fetcher.0"] == "fetcher-2"
    assert H in daemon.daemon.store.entries and daemon.daemon.owners[H] == ("fetcher.0", "fetcher-2")
