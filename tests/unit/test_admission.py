"""`gateway.admission`: load shedding counts a backlog of requests waiting for their first answer, never one
straggler (`queue_backlog`), and foresees a line's wait from the best first-answer rate it has seen
(`FirstAnswerRate`, `foreseen_wait`), so that a burst queues about ``max_queue_wait_s`` of work from its start."""

from __future__ import annotations

from collections import deque

from gateway.admission import (
    MIN_LINE,
    RATE_EVIDENCE_S,
    RATE_HISTORY_S,
    RATE_WINDOW_S,
    FirstAnswerRate,
    foreseen_wait,
    queue_backlog,
)


def test_one_straggler_is_no_backlog() -> None:
    assert queue_backlog([0.0, 9.0, 9.5], now=10.0, wait_s=5.0, in_flight=3) == 0


def test_two_waiting_past_the_limit_are_a_backlog() -> None:
    assert queue_backlog([0.0, 1.0, 9.5], now=10.0, wait_s=5.0, in_flight=3) == 2


def test_a_backlog_is_at_least_a_quarter_of_the_requests_in_flight() -> None:
    waiting = [0.0, 1.0, 2.0] + [9.0] * 9  # 3 old of 12 waiting
    assert queue_backlog(waiting, now=10.0, wait_s=5.0, in_flight=12) == 3
    assert queue_backlog(waiting, now=10.0, wait_s=5.0, in_flight=13) == 0  # (a quarter of 13: 4)


def test_the_count_stops_at_the_first_young_request() -> None:
    # (admission order: a request after a young one is younger still, whatever the list says)
    assert queue_backlog([0.0, 9.0, 0.0, 0.0], now=10.0, wait_s=5.0, in_flight=4) == 0


def test_zero_is_off() -> None:
    assert queue_backlog([0.0, 0.0, 0.0], now=10.0, wait_s=0.0, in_flight=3) == 0


def test_the_best_rate_is_the_best_busy_window_of_the_last_minute() -> None:
    rate = FirstAnswerRate()
    rate.line(99.5, 20)  # busy from here on
    assert rate.best(100.0) == 0.0
    for second in range(100, 110):  # 10 a second for 10 s, then 2 a second
        for i in range(10):
            rate.record(second + i / 10)
    for second in range(110, 130):
        rate.record(second + 0.5)
        rate.record(second + 0.7)
    assert rate.best(130.0) == 10.0
    # The second in progress is not whole: 50 answers in it do not count yet.
    for _ in range(50):
        rate.record(130.5)
    assert rate.best(130.9) == 10.0
    assert rate.best(131.0) == (50 + 4 * 2) / RATE_WINDOW_S


def test_idle_seconds_and_a_short_busy_past_give_no_rate() -> None:
    """A stack just started: its first busy seconds (a pipeline filling, kernels warming) are no evidence of what
    it serves; nor is a window with a second in which nobody waited."""
    rate = FirstAnswerRate()
    rate.line(3.1, 32)  # 32 clients start together
    for i in range(20):
        rate.record(4.5 + i * 0.15)
    assert rate.best(3.1 + RATE_EVIDENCE_S - 1) == 0.0
    rate = FirstAnswerRate()
    for second in range(0, 30):  # answers every second, the line emptied once in each
        rate.line(second + 0.1, 12)
        for i in range(10):
            rate.record(second + 0.2 + i / 100)
        rate.line(second + 0.5, 0)
    assert rate.best(30.0) == 0.0


def test_the_best_rate_forgets_what_is_older_than_its_history() -> None:
    rate = FirstAnswerRate()
    rate.line(0.0, 10)
    for i in range(2000):
        rate.record(1.0 + i / 100)
    assert rate.best(21.0) == 100.0
    rate.line(21.0, 0)
    assert rate.best(21.0 + RATE_HISTORY_S) == 0.0
    rate.line(499.5, 10)  # (after a long silence: the old counters are gone, not wrapped around)
    for second in range(500, 500 + RATE_EVIDENCE_S):
        rate.record(second + 0.5)
    assert rate.best(500.0 + RATE_EVIDENCE_S) == 1.0


def test_no_foresight_for_a_short_line_or_without_a_rate() -> None:
    assert foreseen_wait(MIN_LINE - 1, 0.1) is None  # a few slow requests side by side are no queue
    assert foreseen_wait(100, 0.0) is None
    assert foreseen_wait(50, 10.0) == 5.0


def simulate_burst(wait_s: float, capacity: float, burst_factor: float, foresee: bool = True) -> tuple[int, float]:
    """A stack giving ``capacity`` first answers a second in admission order (FIFO), none sooner than ``LATENCY_S``
    after its request came (the pipeline's own time), loaded at 90% of its capacity for 20 s, then at
    ``burst_factor`` times it for 30 s, then not at all, admitting with both rules as the gateway does (``foresee``
    False: the seen rule alone). The longest line admitted, and how long after the burst the line took to fall back
    under ``MIN_LINE``."""
    rate, line, served_credit = FirstAnswerRate(), deque[float](), 0.0
    step, longest, drained_at = 0.01, 0, None
    for tick in range(int(120 / step)):
        now = tick * step
        load = 0.9 if now < 20.0 else burst_factor if now < 50.0 else 0.0
        arrivals = capacity * load * step
        for _ in range(int((tick + 1) * arrivals) - int(tick * arrivals)):
            foreseen = foreseen_wait(len(line), rate.best(now)) if foresee else None
            refused = (foreseen is not None and foreseen > wait_s) or queue_backlog(line, now, wait_s, len(line))
            if not refused:
                line.append(now)
                rate.line(now, len(line))
        served_credit = min(served_credit + capacity * step, 1.0)  # (an idle stack banks no answers)
        while line and served_credit >= 1 and now - line[0] >= LATENCY_S:
            line.popleft()
            rate.record(now)
            rate.line(now, len(line))
            served_credit -= 1
        longest = max(longest, len(line))
        if now >= 50.0 and drained_at is None and len(line) < MIN_LINE:
            drained_at = now
    assert drained_at is not None
    return longest, drained_at - 50.0


LATENCY_S = 1.5


def test_a_burst_queues_about_the_bound_of_work_and_drains_soon_after() -> None:
    longest, drain_s = simulate_burst(wait_s=5.0, capacity=10.0, burst_factor=10.0)
    assert longest <= 5.0 * 10.0 + 1  # the line the stack serves in max_queue_wait_s
    assert drain_s <= 5.0
    # The rule that waits for a backlog to have waited lets in the burst's first max_queue_wait_s: ten times that.
    longest, drain_s = simulate_burst(wait_s=5.0, capacity=10.0, burst_factor=10.0, foresee=False)
    assert longest > 400 and drain_s > 40
