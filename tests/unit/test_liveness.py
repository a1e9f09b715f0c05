"""The liveness clock (`common.liveness`) that the gateway (its decoder replicas, its fetchers) and a fetcher (its
encoders, through `common.dispatch.Dispatcher`) judge their peers by: a stall of the judging loop is not a peer's
silence, a peer that really went silent is still judged dead within ``dead_after_s`` and one tick, and a heartbeat
read just before or just after the late tick counts the same. Times are given, never waited for."""

from __future__ import annotations

import math
import random
import types

import pytest

from common import dispatch as dispatch_mod
from common import liveness as liveness_mod
from common.config import Config, LivenessConfig
from common.dispatch import Dispatcher, Job
from common.liveness import LivenessClock
from common.protocol import Message, WorkerStatus
from gateway.replicas import Replicas

PERIOD = 0.5  # the tick's sleep ([liveness] heartbeat_s)
DEAD_AFTER = 3.0
START = 100.0


def ticks(clock: LivenessClock, start: float, end: float) -> list[float]:
    """Ticks on time, one period apart, from ``start`` (excluded) to ``end`` (included): their times."""
    times = []
    at = start + PERIOD
    while at <= end + 1e-9:
        clock.tick(at)
        times.append(at)
        at += PERIOD
    return times


def pool(clock: LivenessClock) -> Replicas:
    return Replicas(Config(liveness=LivenessConfig(heartbeat_s=PERIOD, dead_after_s=DEAD_AFTER)), clock)


def test_ticks_on_time_keep_the_wall_clocks_time() -> None:
    clock = LivenessClock(PERIOD, start=START)
    ticks(clock, START, START + 10)
    assert clock.now(START + 10) == pytest.approx(START + 10)
    assert clock.now(START + 10.2) == pytest.approx(START + 10.2)  # (between ticks it runs as the wall does)


def test_the_time_a_tick_was_late_by_is_not_counted() -> None:
    clock = LivenessClock(PERIOD, start=START)
    ticks(clock, START, START + 1)
    assert clock.now(START + 6) == pytest.approx(START + 1 + PERIOD)  # (stalled: no further than one period)
    assert clock.tick(START + 6) == pytest.approx(5 - PERIOD)  # the seconds left out
    assert clock.now(START + 6.25) == pytest.approx(START + 1.75)  # then on with the wall again


@pytest.mark.parametrize("reader_first", [True, False])
def test_a_stall_of_the_gateway_past_dead_after_s_does_not_make_a_heartbeating_replica_stale(
    reader_first: bool,
) -> None:
    """A heartbeat at +0.4, the gateway's loop stalled from +0.6 to +5.6 (the heartbeats sent meanwhile wait in
    its socket): the tick on resuming blames no one, whether the reader took a queued heartbeat before it or
    not; nor does a request arriving then (`Replicas.unavailable`) before any tick."""
    clock = LivenessClock(PERIOD, start=START)
    replicas = pool(clock)
    decoder = replicas.all[0]
    clock.tick(START + 0.4 - 1e-3)
    decoder.seen = clock.now(START + 0.4)
    resumed = START + 5.6
    assert replicas.unavailable(decoder, clock.now(resumed)) is None  # (a request handled before the tick)
    if reader_first:
        decoder.seen = clock.now(resumed + 1e-3)
    clock.tick(resumed + 2e-3)
    assert replicas.stale(clock.now(resumed + 2e-3)) == []
    if not reader_first:
        decoder.seen = clock.now(resumed + 3e-3)
    ticks(clock, resumed + 2e-3, resumed + DEAD_AFTER - 0.1)  # (no heartbeat read since: still within its time)
    assert replicas.stale(clock.now(resumed + DEAD_AFTER - 0.1)) == []
    assert replicas.live(decoder, clock.now(resumed + DEAD_AFTER - 0.1))


@pytest.mark.parametrize("stall", [0.0, 5.0])
def test_a_silent_replica_is_stale_within_dead_after_s_and_one_tick_of_counted_time(stall: float) -> None:
    """The decoder's last heartbeat at +0.2, then none: the first tick that finds it stale comes after
    ``dead_after_s`` of the clock's time and no more than one period later (with a stall of the gateway's
    between, that much later on the wall)."""
    clock = LivenessClock(PERIOD, start=START)
    replicas = pool(clock)
    decoder = replicas.all[0]
    decoder.seen = clock.now(START + 0.2)
    at, late = START, stall
    while not replicas.stale(clock.now(at)):
        at += PERIOD + late  # (the first tick is late by the stall, if any)
        late = 0.0
        clock.tick(at)
        assert at < START + 60, "never judged stale"
    assert START + 0.2 + DEAD_AFTER + stall - PERIOD < at <= START + 0.2 + DEAD_AFTER + stall + PERIOD + 1e-9


def test_a_stamp_is_never_ahead_of_the_clock_later() -> None:
    """Heartbeats stamped at any moment between ticks that come late by any amount: at every later moment the
    clock reads at least the stamp (a stamp ahead of it would grant a dead peer extra life), and the clock's
    time between two moments is never more than the wall's."""
    rng = random.Random(7)
    clock = LivenessClock(PERIOD, start=START)
    wall, stamps = START, []
    for _ in range(2000):
        wall += rng.choice([rng.uniform(0, PERIOD), rng.uniform(PERIOD, 4 * PERIOD)])
        before = clock.now(wall)
        if rng.random() < 0.5:
            stamps.append(clock.now(wall))
        else:
            missed = clock.tick(wall)
            assert missed >= 0 and clock.now(wall) == pytest.approx(before)  # (a tick commits, never jumps)
        assert all(stamp <= clock.now(wall) + 1e-9 for stamp in stamps[-50:])
    assert clock.now(wall) <= wall


def test_a_replica_is_counted_lost_once_per_loss() -> None:
    """``vlm_gateway_replicas_lost``: a silence counts once however many ticks find it stale; a new process
    heard after that silence is the same loss; a new process heard while the old one was live is a loss."""
    clock = LivenessClock(PERIOD, start=START)
    replicas = pool(clock)
    decoder = replicas.all[0]
    assert not replicas.heard(decoder, "first")  # (the first process: nothing lost)
    ticks(clock, START, START + 10)
    assert [replicas.silenced() for _ in range(3)] == [[decoder]] * 3 and decoder.lost == 1
    assert replicas.heard(decoder, "second") and decoder.lost == 1  # (its restart: the loss counted already)
    assert replicas.silenced() == [] and not replicas.heard(decoder, "second")
    assert replicas.heard(decoder, "third") and decoder.lost == 2  # (restarted within dead_after_s)


class Wall:
    """Monotonic time (`common.dispatch`'s and `common.liveness`'s), set by the test."""

    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def wall(monkeypatch: pytest.MonkeyPatch) -> Wall:
    wall = Wall()
    for module in (dispatch_mod, liveness_mod):
        monkeypatch.setattr(module, "time", types.SimpleNamespace(monotonic=wall))
    return wall


def workers(clock: LivenessClock) -> Dispatcher:
    def send(_peer: bytes, _msg: Message | bytes) -> bool:
        return True

    def on_fail(_job: Job, _why: str) -> None:
        pass

    return Dispatcher(send, on_fail, clock=clock, dead_after_s=DEAD_AFTER)


def heartbeat(dispatcher: Dispatcher, key: bytes) -> None:
    dispatcher.peer_status(key, WorkerStatus("encoder", key.decode(), "inc-1", 8))


def hub_tick(clock: LivenessClock, dispatcher: Dispatcher) -> None:
    """The hub's periodic tick (the gateway's `Pipeline._tick`, a fetcher's `heartbeat`): the clock, then the
    judgement."""
    clock.tick()
    dispatcher.tick()


@pytest.mark.parametrize("reader_first", [True, False])
@pytest.mark.parametrize("period", [PERIOD, math.inf])
def test_a_worker_whose_heartbeat_waits_is_not_dropped_for_its_hubs_stall(
    wall: Wall, reader_first: bool, period: float
) -> None:
    """Two workers heard at +0.4 on time, the hub's loop stalled from +0.6 to +5.6 (past ``dead_after_s``):
    one worker's heartbeat sent meanwhile waits in the socket and is read on resuming, before the hub's late
    tick or after it; the other's is not there yet (its answer to the ping that tick sends). Neither is
    dropped, and the one read is not made any fresher than now. A clock that counts every second (an infinite
    period: the wall, as a `Dispatcher` judged by before) drops both."""
    clock = LivenessClock(period, start=START)
    dispatcher = workers(clock)
    wall.now = START + 0.4
    clock.tick()
    heartbeat(dispatcher, b"waiting")
    heartbeat(dispatcher, b"pinged")
    wall.now = START + 5.6
    if reader_first:
        heartbeat(dispatcher, b"waiting")
    hub_tick(clock, dispatcher)
    if period == math.inf:
        assert sorted(dispatcher.peers) == ([b"waiting"] if reader_first else [])
        return
    assert sorted(dispatcher.peers) == [b"pinged", b"waiting"]
    if not reader_first:
        heartbeat(dispatcher, b"waiting")
    assert dispatcher.peers[b"waiting"].last_seen == pytest.approx(clock.now())
    while wall.now + PERIOD < START + 5.6 + DEAD_AFTER - 0.1:  # (none heard since: still within their time)
        wall.now += PERIOD
        hub_tick(clock, dispatcher)
    assert sorted(dispatcher.peers) == [b"pinged", b"waiting"]


@pytest.mark.parametrize("stall", [0.0, 5.0])
def test_a_silent_worker_is_still_dropped_within_dead_after_s_and_one_tick(wall: Wall, stall: float) -> None:
    """A worker heard at +0.4, then never again; the hub's first tick after that late by ``stall`` (its loop
    stalled), then on time: the tick that drops it comes after ``dead_after_s`` of the time the hub could read
    in, and no more than one period later (with the stall between, that much later on the wall)."""
    clock = LivenessClock(PERIOD, start=START)
    dispatcher = workers(clock)
    wall.now = START + 0.4
    clock.tick()
    heartbeat(dispatcher, b"silent")
    wall.now += stall
    while dispatcher.peers:
        wall.now += PERIOD
        hub_tick(clock, dispatcher)
        assert wall.now < START + 60, "never dropped"
    silent = wall.now - stall - (START + 0.4)
    assert DEAD_AFTER < silent <= DEAD_AFTER + PERIOD + 1e-9


def test_a_stall_of_the_hub_does_not_count_towards_failing_jobs_for_want_of_workers(wall: Wall) -> None:
    """``hold_without_workers_s`` is a judgement of the workers' liveness too: no worker heard since the hub
    started, its loop stalled past the hold right away (a worker's ready handshake may be waiting): the queued
    job waits on, and fails once the hold has run in the time the hub could have heard a worker in."""
    clock = LivenessClock(PERIOD, start=START)
    failed: list[str] = []
    dispatcher = Dispatcher(
        lambda _peer, _msg: True,
        lambda job, _why: failed.append(job.job_id),
        clock=clock,
        dead_after_s=DEAD_AFTER,
        hold_without_workers_s=2 * DEAD_AFTER,
    )
    dispatcher.submit("job", b"", timeout_s=600)
    wall.now += 3 * DEAD_AFTER  # (stalled from the start: nothing counted yet)
    hub_tick(clock, dispatcher)
    assert failed == []
    while not failed:
        wall.now += PERIOD
        hub_tick(clock, dispatcher)
        assert wall.now < START + 60, "never failed"
    assert clock.now() - START == pytest.approx(2 * DEAD_AFTER)
