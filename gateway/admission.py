"""Load shedding by queue wait (``[server] max_queue_wait_s``): whether a new request would wait too long for its
first answer behind the admitted requests still waiting for theirs.

Two rules, either one refuses:

- *Foreseen* (`foreseen_wait`): a line of ``L`` requests waiting for a first answer, served at ``rate`` first answers
  a second, makes a newcomer wait about ``L / rate`` (Little's law). Refusing on this foresight bounds what a burst
  queues from its start: a rule that waits for the line to have *waited* too long admits the whole first
  ``max_queue_wait_s`` of a burst, which then takes many times that to drain. ``rate`` is the best first-answer
  rate the gateway saw over its recent busy seconds (`FirstAnswerRate`): what the stack has shown it can serve.
  Rating the stack by its best recent seconds errs towards admitting; the second rule catches what that lets
  through. With too few busy seconds seen (a stack just started or long idle) there is no foresight. The
  line must be at least ``MIN_LINE`` long: a few slow requests (videos) served side by side are no queue, though
  ``L / rate`` over them would be their service time.
- *Seen* (`queue_backlog`): a backlog of admitted requests has already waited past the bound. Needs no rate, so it
  holds before the gateway has seen the stack busy and when the stack is slower than its best recent seconds.
"""

from __future__ import annotations

from collections.abc import Iterable

MIN_LINE = 8  # waiting requests below which the foreseen rule never refuses
RATE_WINDOW_S = 5  # seconds over which a first-answer rate is counted
RATE_HISTORY_S = 60  # how far back the best rate is looked for
RATE_EVIDENCE_S = 10  # busy seconds in that history before the rate is trusted


def queue_backlog(waiting_since: Iterable[float], now: float, wait_s: float, in_flight: int) -> int:
    """How many admitted requests have waited over ``wait_s`` for their first answer, once they are a backlog:
    at least max(2, a quarter of the ``in_flight``); else 0, as with ``wait_s`` 0 (off). One straggler (a large
    video fetched and decoded) is no backlog: it must not turn everyone's traffic away. ``waiting_since`` (when
    each was admitted) comes in admission order, so the count stops at the first request still young."""
    if wait_s <= 0:
        return 0
    enough = max(2, -(-in_flight // 4))
    waited = 0
    for since in waiting_since:
        if now - since <= wait_s:
            break
        waited += 1
    return waited if waited >= enough else 0


class FirstAnswerRate:
    """First answers counted per whole second over the last ``RATE_HISTORY_S``, with whether the line of waiting
    requests stayed non-empty all through each second (`line` is told every change). `best` is the highest rate of
    any ``RATE_WINDOW_S`` consecutive such busy seconds: an idle second says nothing of what the stack can serve.
    Until ``RATE_EVIDENCE_S`` busy seconds have been seen it is 0 (no foresight): a busy period's first seconds
    rate a stack below what it serves once its pipeline is full and warm, and foresight on that rate would turn
    away ordinary traffic. A ring of counters: nothing grows with traffic."""

    def __init__(self) -> None:
        self._counts = [0] * RATE_HISTORY_S
        self._busy = [False] * RATE_HISTORY_S
        self._second = 0  # the whole second the newest counters are for
        self._line = 0  # the line's length now

    def _advance(self, now: float) -> None:
        second = int(now)
        if second <= self._second:
            return
        for s in range(max(self._second + 1, second - RATE_HISTORY_S + 1), second + 1):
            self._counts[s % RATE_HISTORY_S] = 0
            self._busy[s % RATE_HISTORY_S] = self._line > 0  # (the line as it was when the second began)
        self._second = second

    def line(self, now: float, length: int) -> None:
        """The line of requests waiting for a first answer is ``length`` long from ``now`` (monotonic seconds)."""
        self._advance(now)
        self._line = length
        if length == 0:
            self._busy[self._second % RATE_HISTORY_S] = False

    def record(self, now: float) -> None:
        """A request got its first answer at ``now``."""
        self._advance(now)
        self._counts[self._second % RATE_HISTORY_S] += 1

    def best(self, now: float) -> float:
        """First answers a second: the best window of ``RATE_WINDOW_S`` consecutive busy whole seconds of the
        history (the second in progress is not whole yet); 0 before ``RATE_EVIDENCE_S`` busy seconds."""
        self._advance(now)
        ages = range(1, RATE_HISTORY_S)
        busy = [self._busy[(self._second - age) % RATE_HISTORY_S] for age in ages]
        if sum(busy) < RATE_EVIDENCE_S:
            return 0.0
        counts = [self._counts[(self._second - age) % RATE_HISTORY_S] for age in ages]
        best = 0
        for i in range(len(ages) - RATE_WINDOW_S + 1):
            if all(busy[i : i + RATE_WINDOW_S]):
                best = max(best, sum(counts[i : i + RATE_WINDOW_S]))
        return best / RATE_WINDOW_S


def foreseen_wait(line: int, rate: float) -> float | None:
    """The wait a newcomer behind ``line`` waiting requests can expect at ``rate`` first answers a second; None where
    there is no foresight: a line under ``MIN_LINE``, or no rate seen yet."""
    if line < MIN_LINE or rate <= 0:
        return None
    return line / rate
