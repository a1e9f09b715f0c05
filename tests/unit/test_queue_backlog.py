"""`gateway.app.queue_backlog`: load shedding counts a backlog of requests waiting for their first answer, never
one straggler."""

from __future__ import annotations

from gateway.app import queue_backlog


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
