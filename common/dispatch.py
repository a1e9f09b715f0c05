"""Work distribution to live workers only, with re-issue of work held by a worker that died.

A hub keeps one ``Dispatcher`` per worker pool. Workers announce themselves with
``WorkerStatus`` (ready handshake, then heartbeats) carrying how many jobs they take at once;
jobs go to the live worker with the most free credits. A worker that is silent for
``dead_after_s`` or comes back as a new incarnation loses its jobs to the queue again; a job
that has failed ``max_attempts`` times, or waited past its deadline, is failed through
``on_fail`` — never dropped.

Silence is measured on the hub's `LivenessClock` (given, and ticked by the hub's own periodic tick before it
calls `Dispatcher.tick`), not the wall: the time the hub's own loop was stalled, when it could not read a
heartbeat, is not a worker's silence. Job deadlines are the client's, and run on the wall.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from common.liveness import LivenessClock
from common.protocol import Message, WorkerStatus

log = logging.getLogger(__name__)


@dataclass
class Peer:
    key: bytes
    incarnation: str
    credits: int
    last_seen: float  # `LivenessClock` time of its last status
    jobs: set[str] = field(default_factory=set)
    draining: bool = False  # given no new jobs: it is leaving (`Dispatcher.drain`)

    @property
    def free(self) -> int:
        return 0 if self.draining else self.credits - len(self.jobs)


@dataclass
class Job:
    job_id: str
    payload: Message | bytes  # a message, or its frame already encoded (`send` tells them apart)
    deadline: float
    attempts: int = 0
    peer: bytes | None = None
    prefer: bytes | None = None  # the worker to give it to while that one has a free credit
    affinity: bytes | None = None  # else: the live worker this key ranks first (`ranked_first`), while it has one


class Dispatcher:
    def __init__(
        self,
        send: Callable[[bytes, Message | bytes], bool],
        on_fail: Callable[[Job, str], None],
        *,
        clock: LivenessClock,
        dead_after_s: float,
        max_attempts: int = 3,
        hold_without_workers_s: float | None = None,
    ) -> None:
        """``clock``: the hub's, which its periodic tick advances (`LivenessClock.tick`) before calling `tick`
        here. ``hold_without_workers_s``: once no worker has been live for that long (a crash loop, a pool never
        started), queued jobs fail at once instead of each waiting out its own deadline; None: they wait."""
        self.send = send
        self.clock = clock
        self.on_fail = on_fail
        self.dead_after_s = dead_after_s
        self.max_attempts = max_attempts
        self.hold_without_workers_s = hold_without_workers_s
        self.none_live_since = clock.now()  # (`LivenessClock` time, as every time a peer is judged by)
        self.peers: dict[bytes, Peer] = {}
        self.draining: set[bytes] = set()  # workers leaving (`drain`), live or not
        self.jobs: dict[str, Job] = {}
        self.queue: deque[str] = deque()

    # ------------------------------------------------------------------ liveness
    def peer_status(self, key: bytes, status: WorkerStatus) -> None:
        peer = self.peers.get(key)
        if peer is not None and peer.incarnation != status.incarnation:
            self._lose_peer(peer, "restarted")
            peer = None
        if peer is None:
            log.info("worker %s (%s) is live with %d credits", key, status.incarnation, status.credits)
            peer = self.peers[key] = Peer(key, status.incarnation, status.credits, self.clock.now())
            peer.draining = key in self.draining
        peer.credits = status.credits
        peer.last_seen = self.clock.now()
        self.dispatch()

    def live_peers(self) -> int:
        return sum(not peer.draining for peer in self.peers.values())

    def drain(self, key: bytes) -> None:
        """Give the worker ``key`` no new jobs (it is leaving); those it holds finish, or are re-issued if it goes
        silent. `drained` says when it holds none."""
        self.draining.add(key)
        if key in self.peers and not self.peers[key].draining:
            self.peers[key].draining = True
            if not self.live_peers():
                self.none_live_since = self.clock.now()

    def undrain(self, key: bytes) -> None:
        """The worker ``key`` takes jobs again (it came back before it was gone)."""
        self.draining.discard(key)
        if key in self.peers:
            self.peers[key].draining = False
            self.dispatch()

    def drained(self, key: bytes) -> bool:
        """Whether a draining worker holds no job now: it can be forgotten (`forget_peer`)."""
        peer = self.peers.get(key)
        return key in self.draining and (peer is None or not peer.jobs)

    def forget_peer(self, key: bytes) -> None:
        """A worker that is gone for good: its jobs (if any) are re-issued, and a status from it is news again."""
        self.draining.discard(key)
        peer = self.peers.get(key)
        if peer is not None:
            self._lose_peer(peer, "left")
            self.dispatch()

    def _lose_peer(self, peer: Peer, why: str) -> None:
        log.warning("worker %s %s; re-issuing %d job(s)", peer.key, why, len(peer.jobs))
        self.peers.pop(peer.key, None)
        if not self.live_peers():
            self.none_live_since = self.clock.now()
        for job_id in sorted(peer.jobs):
            job = self.jobs.get(job_id)
            if job is not None:
                job.peer = None
                self.queue.appendleft(job_id)

    # ------------------------------------------------------------------ jobs
    def submit(
        self,
        job_id: str,
        payload: Message | bytes,
        timeout_s: float,
        prefer: bytes | None = None,
        affinity: bytes | None = None,
    ) -> None:
        """Queue a job (``prefer``: go to that worker if it is live with a free credit, as to the one holding
        related work; ``affinity``: a key whose jobs go to the same worker while the live workers stay the same,
        as where a worker remembers what it did for the key; to the freest otherwise)."""
        self.jobs[job_id] = Job(job_id, payload, time.monotonic() + timeout_s, prefer=prefer, affinity=affinity)
        self.queue.append(job_id)
        self.dispatch()

    def complete(self, job_id: str) -> Job | None:
        """The job is done: its credit goes to the next queued job at once."""
        job = self._forget(job_id)
        self.dispatch()
        return job

    def cancel(self, job_id: str) -> None:
        if self._forget(job_id) is not None:
            self.queue = deque(j for j in self.queue if j != job_id)
            self.dispatch()

    def _forget(self, job_id: str) -> Job | None:
        job = self.jobs.pop(job_id, None)
        if job is not None and job.peer is not None and job.peer in self.peers:
            self.peers[job.peer].jobs.discard(job_id)
        return job

    def dispatch(self) -> None:
        while self.queue:
            freest = max(self.peers.values(), key=lambda p: p.free, default=None)
            if freest is None or freest.free <= 0:
                return
            job = self.jobs.get(self.queue.popleft())
            if job is None or job.peer is not None:
                continue
            preferred = self._preferred(job)
            peer = preferred if preferred is not None and preferred.free > 0 else freest
            if job.attempts >= self.max_attempts:
                self._fail(job, f"gave up after {job.attempts} attempts: its workers kept dying")
                continue
            job.attempts += 1
            job.peer = peer.key
            peer.jobs.add(job.job_id)
            if not self.send(peer.key, job.payload):
                self._lose_peer(peer, "is unreachable")

    def _preferred(self, job: Job) -> Peer | None:
        if job.prefer is not None and job.prefer in self.peers:
            return self.peers[job.prefer]
        return ranked_first(job.affinity, self.peers) if job.affinity is not None else None

    def tick(self) -> None:
        """Drop silent workers (re-issuing their jobs) and fail jobs past their deadline. The hub has ticked its
        clock first: silence counts only the time its loop could have read a status in."""
        seen_now = self.clock.now()
        for peer in [p for p in self.peers.values() if seen_now - p.last_seen > self.dead_after_s]:
            self._lose_peer(peer, f"silent for {seen_now - peer.last_seen:.1f}s")
        now = time.monotonic()
        for job in [j for j in self.jobs.values() if j.deadline < now]:
            self._fail(job, "timed out waiting for a live worker" if self.peers else "no worker is live to take it")
        hold = self.hold_without_workers_s
        if not self.live_peers() and hold is not None and seen_now - self.none_live_since >= hold:
            for job in list(self.jobs.values()):
                self._fail(job, f"no worker has been live for {seen_now - self.none_live_since:.0f} s")
        self.dispatch()

    def _fail(self, job: Job, why: str) -> None:
        self._forget(job.job_id)
        self.on_fail(job, why)


def ranked_first(key: bytes, peers: dict[bytes, Peer]) -> Peer | None:
    """Rendezvous hashing: the peer whose (key, peer) hash is highest. A key keeps its peer while that one lives,
    and a peer that joins or leaves moves only the keys it ranks first for."""
    return max(peers.values(), key=lambda peer: hashlib.blake2b(key + peer.key, digest_size=8).digest(), default=None)
