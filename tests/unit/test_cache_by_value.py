"""Embeddings sent by value (`CacheWrite`: an encoder on a tcp:// endpoint, which cannot reach this host's pool, sent
the rows back to its fetcher) written by the cache daemon into the slot it reserved, on real sockets (the test is
the fetcher and the decoder): the rows land in their slot, a write for a slot the daemon no longer gives that hash
is ignored (as a stale commit is), and rows that do not fit their slot fail the entry, so its requests are answered."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.protocol import CacheAcquireResult, CacheCommit, CacheWrite, commit_for
from common.tensor_ref import inline_ref
from tests.unit.test_cache_recovery import Daemon, H, reserve, running_daemon

ROWS = torch.arange(8, dtype=torch.float32).reshape(4, 2) + 0.5  # `reserve` asks for a [4, 2] float32 slot


@pytest.fixture
def reserved(tmp_path: Path) -> Iterator[Daemon]:
    with running_daemon(tmp_path) as running:
        reserve(running.daemon, "req-1", "fetcher-1")
        running.acquire("c1", "req-1")  # (the decoder waits for the entry)
        yield running


def the_slot(running: Daemon) -> torch.Tensor:
    return running.daemon.pool.view(running.daemon.ref(running.daemon.store.entries[H]))


def test_rows_sent_by_value_fill_their_slot_and_the_commit_makes_them_ready(reserved: Daemon) -> None:
    cache = reserved.daemon
    slot = cache.ref(cache.store.entries[H])
    cache.handle(b"fetcher", CacheWrite(H, slot, inline_ref(ROWS)))
    assert torch.equal(the_slot(reserved), ROWS) and reserved.answer(200) is None  # written, not yet committed
    cache.handle(b"fetcher", commit_for(H, slot))
    answer = reserved.answer()
    assert isinstance(answer, CacheAcquireResult) and answer.status == 200, answer
    assert torch.equal(cache.pool.view(answer.refs[0]), ROWS)
    assert cache.store.snapshot()["writes"] == 1 and cache.store.snapshot()["written_bytes"] == ROWS.nbytes


def test_the_parts_of_a_chunked_video_land_in_their_own_rows(reserved: Daemon) -> None:
    cache = reserved.daemon
    slot = cache.ref(cache.store.entries[H])
    for first in (0, 2):  # two parts of two rows each, as the fetcher cuts a video's slot
        part = dataclasses.replace(slot, offset=slot.offset + first * 2 * 4, shape=[2, 2])
        cache.handle(b"fetcher", CacheWrite(H, part, inline_ref(ROWS[first : first + 2])))
    assert torch.equal(the_slot(reserved), ROWS)


@pytest.mark.parametrize("stale", ["other pool", "outside the entry", "another pool file", "already ready"])
def test_a_write_for_a_slot_the_daemon_no_longer_gives_that_hash_is_ignored(reserved: Daemon, stale: str) -> None:
    cache = reserved.daemon
    slot = cache.ref(cache.store.entries[H])
    if stale == "already ready":
        cache.handle(b"fetcher", CacheWrite(H, slot, inline_ref(ROWS)))
        cache.handle(b"fetcher", commit_for(H, slot))
        assert isinstance(reserved.answer(), CacheAcquireResult)
    wrong = {
        "other pool": dataclasses.replace(slot, pool_incarnation="cache-before"),
        "outside the entry": dataclasses.replace(slot, offset=slot.offset + 4096),
        "another pool file": dataclasses.replace(slot, shm_name=slot.shm_name + "-old"),
        "already ready": slot,
    }[stale]
    before = the_slot(reserved).clone()
    cache.handle(b"fetcher", CacheWrite(H, wrong, inline_ref(-ROWS)))
    assert torch.equal(the_slot(reserved), before) and H in cache.store.entries
    assert cache.store.snapshot()["writes"] == (1 if stale == "already ready" else 0)


@pytest.mark.parametrize(
    "rows", [ROWS.to(torch.bfloat16), ROWS.reshape(2, 4), ROWS[:3]], ids=["dtype", "shape", "size"]
)
def test_rows_that_do_not_fit_their_slot_fail_the_entry_and_answer_its_requests(
    reserved: Daemon, rows: torch.Tensor
) -> None:
    cache = reserved.daemon
    cache.handle(b"fetcher", CacheWrite(H, cache.ref(cache.store.entries[H]), inline_ref(rows)))
    answer = reserved.answer()
    assert isinstance(answer, CacheAcquireResult) and answer.status == 503, answer
    assert "does not fit its slot" in answer.message and H not in cache.store.entries
    cache.handle(b"fetcher", CacheCommit(H))  # (the fetcher's commit after it: nothing left to mark ready)
    assert H not in cache.store.entries
