"""The gateway's liveness clock (`gateway.liveness`): a stall of the judging loop is not a peer's silence, a
peer that really went silent is still judged dead within ``dead_after_s`` and one tick, and a heartbeat read
just before or just after the late tick counts the same. Times are given, never waited for."""

from __future__ import annotations

import random
import types

import pytest

from common import dispatch as dispatch_mod
from common.config import Config, LivenessConfig
from common.dispatch import Dispatcher, Job
from common.protocol import Message, WorkerStatus
from gateway.liveness import LivenessClock, excuse
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
    """`common.dispatch`'s monotonic time, set by the test."""

    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def wall(monkeypatch: pytest.MonkeyPatch) -> Wall:
    wall = Wall()
    monkeypatch.setattr(dispatch_mod, "time", types.SimpleNamespace(monotonic=wall))
    return wall


def fetchers() -> Dispatcher:
    def send(_peer: bytes, _msg: Message | bytes) -> bool:
        return True

    def on_fail(_job: Job, _why: str) -> None:
        pass

    return Dispatcher(send, on_fail, dead_after_s=DEAD_AFTER)


def heartbeat(dispatcher: Dispatcher, key: bytes) -> None:
    dispatcher.peer_status(key, WorkerStatus("fetcher", key.decode(), "inc-1", 8))


@pytest.mark.parametrize("excused", [True, False])
def test_a_fetcher_is_not_dropped_for_the_gateways_stall(wall: Wall, excused: bool) -> None:
    """The fetchers' `Dispatcher` judges by the wall: a fetcher heard at +0.4, the gateway stalled until +5.6,
    one more heard just after it resumed (before the tick). Excused by the seconds the clock left out, neither
    is dropped, and the one heard after the stall is not made any fresher than now; unexcused (as before the
    clock), the first is dropped."""
    clock = LivenessClock(PERIOD, start=START)
    dispatcher = fetchers()
    wall.now = START + 0.4
    heartbeat(dispatcher, b"before")
    wall.now = START + 5.6
    heartbeat(dispatcher, b"after")
    missed = clock.tick(wall.now)
    if excused:
        excuse(dispatcher.peers.values(), missed, wall.now)
    dispatcher.tick()
    assert sorted(dispatcher.peers) == ([b"after", b"before"] if excused else [b"after"])
    assert dispatcher.peers[b"after"].last_seen == START + 5.6


def test_a_silent_fetcher_is_still_dropped_after_the_gateways_stall(wall: Wall) -> None:
    clock = LivenessClock(PERIOD, start=START)
    dispatcher = fetchers()
    wall.now = START + 0.4
    heartbeat(dispatcher, b"silent")
    wall.now, not_counted = START + 5.6, 0.0  # (the gateway stalled: the first tick is late)
    while dispatcher.peers:
        wall.now += PERIOD
        missed = clock.tick(wall.now)
        not_counted += missed
        excuse(dispatcher.peers.values(), missed, wall.now)
        dispatcher.tick()
        assert wall.now < START + 60, "never dropped"
    assert not_counted > DEAD_AFTER  # (the stall alone would have dropped it, unexcused)
    silent = wall.now - not_counted - (START + 0.4)
    assert DEAD_AFTER < silent <= DEAD_AFTER + PERIOD + 1e-9
