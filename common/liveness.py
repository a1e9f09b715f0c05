"""The clock a hub judges its peers' liveness by: a peer is dead when this clock, not the wall, has run
``dead_after_s`` past its last heartbeat. Every judge of peers by the age of their last message uses one: the
gateway (its decoder replicas and fetchers), a fetcher (its encoders), each `common.dispatch.Dispatcher`.

A hub reads heartbeats on the same loop that judges them. When that loop is held up (a slow first import, a GC
pause, a starved CPU, the process stopped), the heartbeats that came meanwhile wait in the sockets (or were
never asked for: a fetcher pings its encoders from the same tick), and on resuming the judging tick may run
before the readers have taken them: a wall clock would then blame the peer for the judge's own stall. So this
clock runs only while the loop could have read: between two ticks it advances by at most the period the tick
asked to sleep, and whatever the tick was late by beyond that is time the loop was busy elsewhere, not counted.

Why a clock and not "skip judging after a late tick" or "drain the sockets first": the readers stamp heartbeats
with this same clock, which never runs backwards nor ahead of what the next tick commits, so a heartbeat read
just before or just after the late tick counts the same (the reader and the tick may run in either order); a
peer that is really dead is still judged so within ``dead_after_s`` plus one tick of its last heartbeat, as a
wall clock would, as long as the loop keeps its time; and a heartbeat stuck behind a backlog of other messages
(tokens) gets the whole of ``dead_after_s`` to be read, not one tick. The owner's periodic tick calls `tick`
once per period, before it judges; a clock never ticked stops one period after its start.
"""

from __future__ import annotations

import time


class LivenessClock:
    """Monotonic seconds, less the time the judging loop was late by (`tick`). Starts at ``time.monotonic()``
    and stays within the loop's stalls of it, so a time stamped from either compares as the same moment."""

    def __init__(self, period_s: float, start: float | None = None) -> None:
        self.period_s = period_s  # how long the tick sleeps between judgements
        self.ticked = time.monotonic() if start is None else start  # monotonic time of the last tick
        self.at_tick = self.ticked  # this clock's time then

    def now(self, at: float | None = None) -> float:
        """This clock's time at monotonic time ``at`` (now): up to one period past the last tick, no further."""
        at = time.monotonic() if at is None else at
        return self.at_tick + min(max(at - self.ticked, 0.0), self.period_s)

    def tick(self, at: float | None = None) -> float:
        """The judging tick woke (at monotonic time ``at``): its time so far is committed. Returns the seconds
        not counted (the tick's lateness past its period): time in which the loop could not read a heartbeat."""
        at = time.monotonic() if at is None else at
        counted = self.now(at)
        missed = max(at - self.ticked, 0.0) - (counted - self.at_tick)
        self.ticked, self.at_tick = at, counted
        return missed
