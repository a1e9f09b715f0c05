"""Unit tests for ``common/dispatch.py``: credits, liveness, re-issue, attempts and deadlines."""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import pytest

from common import dispatch as dispatch_mod
from common import liveness as liveness_mod
from common.dispatch import Dispatcher, Job
from common.liveness import LivenessClock
from common.protocol import Message, Ping, WorkerStatus

DEAD_AFTER = 3.0
TICK = 0.5  # the hub's liveness tick ([liveness] heartbeat_s)


class Clock:
    """Monotonic time, set by the test, and the hub's `LivenessClock` over it, ticked on time as it runs."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.liveness = LivenessClock(TICK, start=self.now)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Time passes with the hub's loop turning: its tick comes every period, on time."""
        end = self.now + seconds
        while self.now + TICK < end:
            self.now += TICK
            self.liveness.tick()
        self.now = end
        self.liveness.tick()


@dataclass
class Harness:
    clock: Clock
    dispatcher: Dispatcher = field(init=False)
    sent: list[tuple[bytes, str]] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    unreachable: set[bytes] = field(default_factory=set)
    max_attempts: int = 3
    hold: float | None = None

    def __post_init__(self) -> None:
        self.dispatcher = Dispatcher(
            self.send,
            self.on_fail,
            clock=self.clock.liveness,
            dead_after_s=DEAD_AFTER,
            max_attempts=self.max_attempts,
            hold_without_workers_s=self.hold,
        )

    def send(self, peer: bytes, payload: Message) -> bool:
        assert isinstance(payload, Ping)
        # Invariant at every send: the receiving worker never holds more jobs than its credits.
        holder = self.dispatcher.peers[peer]
        assert len(holder.jobs) <= holder.credits, f"{peer!r} over its credits"
        if peer in self.unreachable:
            return False
        self.sent.append((peer, payload.sender))
        return True

    def on_fail(self, job: Job, why: str) -> None:
        self.failed.append((job.job_id, why))

    # helpers
    def status(self, key: bytes, credits: int, incarnation: str = "inc-1") -> None:
        self.dispatcher.peer_status(key, WorkerStatus("encoder", key.decode(), incarnation, credits))

    def submit(self, job_id: str, timeout_s: float = 60.0) -> None:
        self.dispatcher.submit(job_id, Ping(job_id), timeout_s)

    def sent_to(self, key: bytes) -> list[str]:
        return [job for peer, job in self.sent if peer == key]

    def sent_jobs(self) -> list[str]:
        return [job for _, job in self.sent]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(dispatch_mod, "time", types.SimpleNamespace(monotonic=clock))
    monkeypatch.setattr(liveness_mod, "time", types.SimpleNamespace(monotonic=clock))
    return clock


@pytest.fixture
def h(clock: Clock) -> Harness:
    return Harness(clock)


def test_jobs_wait_until_a_worker_is_live(h: Harness) -> None:
    h.submit("j1")
    h.submit("j2")
    assert h.sent == [] and h.dispatcher.live_peers() == 0
    assert list(h.dispatcher.queue) == ["j1", "j2"]
    h.status(b"w1", credits=4)
    assert h.dispatcher.live_peers() == 1
    assert h.sent == [(b"w1", "j1"), (b"w1", "j2")]  # in submission order
    assert not h.dispatcher.queue
    assert h.dispatcher.jobs["j1"].peer == b"w1" and h.dispatcher.jobs["j1"].attempts == 1


def test_a_worker_with_zero_credits_gets_nothing(h: Harness) -> None:
    h.status(b"w1", credits=0)
    h.submit("j1")
    assert h.sent == []
    h.status(b"w1", credits=1)  # a heartbeat raising the credits dispatches
    assert h.sent == [(b"w1", "j1")]


def test_a_preferred_worker_takes_the_job_while_it_has_credit(h: Harness) -> None:
    """The choices of one request go to the fetcher of the first (it loads their media once), unless that
    fetcher is full or gone: then to the freest, as any job."""
    h.status(b"small", credits=2)
    h.status(b"big", credits=4)
    h.dispatcher.submit("first", Ping("first"), 60.0)
    assert h.sent == [(b"big", "first")]
    h.dispatcher.submit("second", Ping("second"), 60.0, prefer=b"small")
    h.dispatcher.submit("third", Ping("third"), 60.0, prefer=b"small")
    assert h.sent_to(b"small") == ["second", "third"]  # though big had more free credits
    h.dispatcher.submit("fourth", Ping("fourth"), 60.0, prefer=b"small")  # small is full
    h.dispatcher.submit("fifth", Ping("fifth"), 60.0, prefer=b"gone")  # no such worker
    assert h.sent_to(b"big") == ["first", "fourth", "fifth"]


def test_jobs_of_one_affinity_key_go_to_one_worker_while_the_workers_stay(h: Harness) -> None:
    """A fetcher remembers the images it decoded: a request that resends an image goes where it went before,
    whichever worker is freest; a key's worker changes only when that worker is gone."""
    workers = [b"f0", b"f1", b"f2"]
    for key in workers:
        h.status(key, credits=64)
    keys = [f"image-{i}".encode() for i in range(30)]
    first = {}
    for i, key in enumerate(keys):
        h.dispatcher.submit(f"a{i}", Ping(f"a{i}"), 60.0, affinity=key)
        first[key] = h.sent[-1][0]
    assert set(first.values()) == set(workers)  # the keys spread over the workers
    for i, key in enumerate(keys):  # the same keys again, later: each to the same worker
        h.dispatcher.submit(f"b{i}", Ping(f"b{i}"), 60.0, affinity=key)
        assert h.sent[-1] == (first[key], f"b{i}")
    for job_id in list(h.dispatcher.jobs):
        h.dispatcher.complete(job_id)
    h.clock.advance(DEAD_AFTER + 1)  # all silent; f0 and f2 come back, f1 does not
    h.dispatcher.tick()
    h.status(b"f0", credits=64, incarnation="inc-1")
    h.status(b"f2", credits=64, incarnation="inc-1")
    for i, key in enumerate(keys):  # f1 is gone: only its keys move
        h.dispatcher.submit(f"c{i}", Ping(f"c{i}"), 60.0, affinity=key)
        assert h.sent[-1][0] == first[key] or first[key] == b"f1"


def test_a_full_affinity_worker_does_not_hold_the_job(h: Harness) -> None:
    h.status(b"f0", credits=1)
    h.status(b"f1", credits=1)
    key = next(
        k
        for k in (f"k{i}".encode() for i in range(100))
        if dispatch_mod.ranked_first(k, h.dispatcher.peers).key == b"f0"
    )
    h.dispatcher.submit("a", Ping("a"), 60.0, affinity=key)
    h.dispatcher.submit("b", Ping("b"), 60.0, affinity=key)  # f0 is full: the freest takes it
    assert h.sent == [(b"f0", "a"), (b"f1", "b")]


def test_never_beyond_credits(h: Harness) -> None:
    h.status(b"w1", credits=2)
    for i in range(5):
        h.submit(f"j{i}")
    assert h.sent_jobs() == ["j0", "j1"]
    assert list(h.dispatcher.queue) == ["j2", "j3", "j4"]
    assert h.dispatcher.peers[b"w1"].free == 0
    h.dispatcher.tick()
    h.status(b"w1", credits=2)  # heartbeats do not over-commit either
    assert len(h.sent) == 2


def test_most_free_credits_first(h: Harness) -> None:
    h.status(b"small", credits=1)
    h.status(b"big", credits=3)
    h.submit("j0")
    assert h.sent == [(b"big", "j0")]
    h.submit("j1")
    assert h.sent[-1] == (b"big", "j1")  # big still has 2 free > 1
    for i in range(2, 6):
        h.submit(f"j{i}")
    assert len(h.sent_to(b"big")) == 3 and len(h.sent_to(b"small")) == 1
    assert list(h.dispatcher.queue) == ["j4", "j5"]
    assert all(p.free == 0 for p in h.dispatcher.peers.values())


def test_complete_frees_credit(h: Harness) -> None:
    h.status(b"w1", credits=1)
    h.submit("j1")
    h.submit("j2")
    job = h.dispatcher.complete("j1")
    assert job is not None and job.job_id == "j1"
    assert "j1" not in h.dispatcher.jobs
    assert h.sent_jobs() == ["j1", "j2"]  # the freed credit went to the queued job at once
    assert h.dispatcher.peers[b"w1"].free == 0
    assert h.dispatcher.complete("j1") is None  # a duplicate or late result is harmless
    assert h.dispatcher.complete("never-submitted") is None
    h.dispatcher.complete("j2")
    assert h.dispatcher.peers[b"w1"].free == 1


def test_complete_dispatches_the_next_job(h: Harness) -> None:
    h.status(b"w1", credits=1)
    h.submit("j1")
    h.submit("j2")
    assert h.sent_jobs() == ["j1"]
    h.dispatcher.complete("j1")
    assert h.sent_jobs() == ["j1", "j2"]


def test_silent_worker_loses_its_jobs_to_a_live_one(h: Harness, clock: Clock) -> None:
    h.status(b"a", credits=2)
    h.submit("j1")
    h.submit("j2")
    assert h.sent_to(b"a") == ["j1", "j2"]
    h.status(b"b", credits=2)
    clock.advance(DEAD_AFTER - 0.5)
    h.status(b"b", credits=2)  # b heartbeats, a stays silent
    h.dispatcher.tick()
    assert b"a" in h.dispatcher.peers  # not yet dead
    assert h.sent_to(b"b") == []
    clock.advance(1.0)  # a: silent for DEAD_AFTER + 0.5; b: 1.0
    h.dispatcher.tick()
    assert b"a" not in h.dispatcher.peers and b"b" in h.dispatcher.peers
    assert sorted(h.sent_to(b"b")) == ["j1", "j2"]
    assert all(h.dispatcher.jobs[j].attempts == 2 for j in ("j1", "j2"))
    assert h.failed == []


def test_silent_worker_jobs_wait_for_the_next_live_worker(h: Harness, clock: Clock) -> None:
    h.status(b"a", credits=1)
    h.submit("j1")
    clock.advance(DEAD_AFTER + 0.1)
    h.dispatcher.tick()
    assert h.dispatcher.live_peers() == 0
    assert list(h.dispatcher.queue) == ["j1"] and h.dispatcher.jobs["j1"].peer is None
    h.status(b"b", credits=1)
    assert h.sent == [(b"a", "j1"), (b"b", "j1")]


def test_a_late_result_from_a_dead_worker_does_not_corrupt_credits(h: Harness, clock: Clock) -> None:
    h.status(b"a", credits=1)
    h.submit("j1")
    clock.advance(DEAD_AFTER + 0.1)
    h.status(b"b", credits=1)
    h.dispatcher.tick()  # j1 -> b
    assert h.sent_to(b"b") == ["j1"]
    assert h.dispatcher.complete("j1") is not None  # the dead worker's answer arrives after all
    assert h.dispatcher.peers[b"b"].free == 1


def test_new_incarnation_reissues_old_jobs(h: Harness) -> None:
    h.status(b"w", credits=2, incarnation="first")
    h.submit("j1")
    h.status(b"w", credits=2, incarnation="first")  # a plain heartbeat changes nothing
    assert h.sent == [(b"w", "j1")]
    h.status(b"w", credits=2, incarnation="second")
    assert h.sent == [(b"w", "j1"), (b"w", "j1")]
    assert h.dispatcher.peers[b"w"].incarnation == "second"
    assert h.dispatcher.peers[b"w"].jobs == {"j1"}
    assert h.dispatcher.jobs["j1"].attempts == 2


def test_restart_reissues_only_that_workers_jobs(h: Harness) -> None:
    h.status(b"a", credits=1, incarnation="a1")
    h.status(b"b", credits=3, incarnation="b1")
    for job in ("j1", "j2", "j3"):
        h.submit(job)
    holders = {job: h.dispatcher.jobs[job].peer for job in ("j1", "j2", "j3")}
    restarted = holders["j1"]
    assert restarted is not None
    lost = sorted(j for j, p in holders.items() if p == restarted)
    kept = sorted(j for j, p in holders.items() if p != restarted)
    h.status(restarted, credits=3 if restarted == b"b" else 1, incarnation="new")
    for job in lost:
        assert h.sent_jobs().count(job) == 2 and h.dispatcher.jobs[job].attempts == 2
    for job in kept:
        assert h.sent_jobs().count(job) == 1 and h.dispatcher.jobs[job].attempts == 1
    # Every job is held by exactly one live worker, none over its credits.
    held = sorted(j for p in h.dispatcher.peers.values() for j in p.jobs)
    assert held == ["j1", "j2", "j3"]
    assert all(p.free >= 0 for p in h.dispatcher.peers.values())


def test_gives_up_after_max_attempts(h: Harness) -> None:
    h.status(b"w", credits=1, incarnation="0")
    h.submit("j1")
    for n in range(1, 6):
        h.status(b"w", credits=1, incarnation=str(n))  # the worker keeps dying while holding j1
    assert h.sent == [(b"w", "j1")] * h.max_attempts
    assert len(h.failed) == 1
    job_id, why = h.failed[0]
    assert job_id == "j1" and "attempts" in why
    assert "j1" not in h.dispatcher.jobs
    assert h.dispatcher.peers[b"w"].free == 1


def test_max_attempts_is_configurable(clock: Clock) -> None:
    h = Harness(clock, max_attempts=1)
    h.status(b"w", credits=1, incarnation="0")
    h.submit("j1")
    h.status(b"w", credits=1, incarnation="1")
    assert h.sent == [(b"w", "j1")]
    assert [j for j, _ in h.failed] == ["j1"]


def test_job_past_its_deadline_fails(h: Harness, clock: Clock) -> None:
    h.submit("j1", timeout_s=5.0)
    h.submit("j2", timeout_s=50.0)
    clock.advance(4.9)
    h.dispatcher.tick()
    assert h.failed == []
    clock.advance(0.2)
    h.dispatcher.tick()
    assert len(h.failed) == 1
    job_id, why = h.failed[0]
    assert job_id == "j1" and why == "no worker is live to take it"  # (the reason a client is given)
    assert "j1" not in h.dispatcher.jobs and "j2" in h.dispatcher.jobs
    h.status(b"w", credits=4)  # a late worker only gets the job still alive
    assert h.sent == [(b"w", "j2")]


def test_deadline_also_covers_jobs_held_by_a_worker(h: Harness, clock: Clock) -> None:
    h.status(b"w", credits=1)
    h.submit("j1", timeout_s=5.0)
    h.submit("j2", timeout_s=60.0)
    clock.advance(2.5)
    h.status(b"w", credits=1)
    clock.advance(2.6)  # past j1's deadline; the worker is alive (silent for 2.6 s only)
    h.dispatcher.tick()
    assert b"w" in h.dispatcher.peers
    assert h.failed == [("j1", "timed out waiting for a live worker")]
    assert h.sent_jobs() == ["j1", "j2"]  # its credit went to the next job


def test_cancel_removes_a_queued_job(h: Harness) -> None:
    h.status(b"w", credits=1)
    h.submit("j1")
    h.submit("j2")
    h.submit("j3")
    h.dispatcher.cancel("j2")
    assert "j2" not in h.dispatcher.jobs and "j2" not in h.dispatcher.queue
    h.dispatcher.complete("j1")
    h.dispatcher.tick()
    assert h.sent_jobs() == ["j1", "j3"]
    assert h.failed == []
    h.dispatcher.cancel("unknown")  # harmless


def test_cancel_of_a_running_job_frees_its_credit(h: Harness) -> None:
    h.status(b"w", credits=1)
    h.submit("j1")
    h.dispatcher.cancel("j1")
    assert h.dispatcher.peers[b"w"].free == 1
    h.submit("j2")
    assert h.sent_jobs() == ["j1", "j2"]


def test_send_failure_marks_the_worker_lost_and_requeues(h: Harness) -> None:
    h.status(b"gone", credits=5)
    h.status(b"ok", credits=1)
    h.unreachable.add(b"gone")
    h.submit("j1")  # goes to "gone" (more credits), the send fails, then to "ok"
    assert b"gone" not in h.dispatcher.peers
    assert h.sent == [(b"ok", "j1")]
    assert h.dispatcher.jobs["j1"].attempts == 2


def test_send_failure_with_no_other_worker_requeues(h: Harness) -> None:
    h.unreachable.add(b"gone")
    h.status(b"gone", credits=1)
    h.submit("j1")
    assert h.dispatcher.live_peers() == 0
    assert list(h.dispatcher.queue) == ["j1"] and h.dispatcher.jobs["j1"].peer is None
    assert h.failed == []
    h.status(b"ok", credits=1)
    assert h.sent == [(b"ok", "j1")]


def test_with_no_worker_live_for_the_hold_queued_jobs_fail_at_once(clock: Clock) -> None:
    h = Harness(clock, hold=30.0)
    h.submit("j1", timeout_s=600)
    clock.advance(29)
    h.dispatcher.tick()
    assert h.failed == []  # (workers may still be starting)
    clock.advance(2)
    h.dispatcher.tick()
    assert h.failed == [("j1", "no worker has been live for 31 s")]

    h.status(b"w1", credits=1)  # a worker comes, takes a job, then goes silent: its job waits for a restart
    h.submit("j2", timeout_s=600)
    h.submit("j3", timeout_s=600)  # (no credit left: queued while the worker is live)
    clock.advance(20)
    h.status(b"w1", credits=1)  # (its heartbeat)
    h.dispatcher.tick()
    assert [job for job, _ in h.failed] == ["j1"]  # a job queued behind a live worker is not held to the hold
    clock.advance(DEAD_AFTER + 1)  # silent past dead_after_s: lost now, its job queued again
    h.dispatcher.tick()
    clock.advance(29)
    h.dispatcher.tick()
    assert [job for job, _ in h.failed] == ["j1"]
    clock.advance(2)
    h.dispatcher.tick()
    assert sorted(job for job, _ in h.failed) == ["j1", "j2", "j3"]
    h.submit("j4", timeout_s=600)  # still none live: the next tick answers it
    h.dispatcher.tick()
    assert h.failed[-1][0] == "j4"


def test_a_draining_worker_takes_no_new_jobs_and_finishes_those_it_holds(h: Harness) -> None:
    h.status(b"w1", credits=2)
    h.status(b"w2", credits=2)
    h.submit("j1")  # (both free: w1, the first of the freest)
    assert h.sent_to(b"w1") == ["j1"]
    h.dispatcher.drain(b"w1")
    assert h.dispatcher.live_peers() == 1 and not h.dispatcher.drained(b"w1")
    for job in ("j2", "j3", "j4"):
        h.submit(job)
    assert h.sent_to(b"w1") == ["j1"] and h.sent_to(b"w2") == ["j2", "j3"]  # j4 waits for w2, not for w1
    h.status(b"w1", credits=2)  # (its heartbeat: still draining)
    assert h.sent_to(b"w1") == ["j1"]
    h.dispatcher.complete("j1")
    assert h.dispatcher.drained(b"w1") and h.sent_to(b"w1") == ["j1"]
    h.dispatcher.forget_peer(b"w1")
    assert b"w1" not in h.dispatcher.peers and not h.dispatcher.drained(b"w1")


def test_a_worker_forgotten_with_jobs_loses_them_to_the_others(h: Harness) -> None:
    h.status(b"w1", credits=1)
    h.submit("j1")
    h.dispatcher.drain(b"w1")
    h.status(b"w2", credits=1)
    h.dispatcher.forget_peer(b"w1")  # (gone before it finished: its job goes again)
    assert h.sent_to(b"w2") == ["j1"] and h.dispatcher.jobs["j1"].attempts == 2


def test_a_worker_back_before_it_left_takes_jobs_again(h: Harness) -> None:
    h.dispatcher.drain(b"w1")  # (drained before it was ever seen: it comes up draining)
    h.status(b"w1", credits=1)
    h.submit("j1")
    assert h.sent == [] and h.dispatcher.live_peers() == 0
    h.dispatcher.undrain(b"w1")
    assert h.sent_to(b"w1") == ["j1"] and h.dispatcher.live_peers() == 1


def test_with_every_worker_draining_queued_jobs_fail_after_the_hold(clock: Clock) -> None:
    h = Harness(clock, hold=30.0)
    h.status(b"w1", credits=1)
    h.dispatcher.drain(b"w1")
    h.submit("j1", timeout_s=600)
    clock.advance(31)
    h.status(b"w1", credits=1)
    h.dispatcher.tick()
    assert h.failed == [("j1", "no worker has been live for 31 s")]
