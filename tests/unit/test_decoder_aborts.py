"""The decoder's memory of aborted requests: long enough for an abort that overtook its request, bounded by time
(the gateway aborts every request when it ends, so kept by count alone they grew with every request served)."""

from __future__ import annotations

from workers.decoder.worker import RecentAborts


def test_aborts_are_kept_for_their_window_and_then_forgotten() -> None:
    aborts = RecentAborts(keep_s=5.0)
    aborts.add("a", now=100.0)
    aborts.add("b", now=103.0)
    assert "a" in aborts and "b" in aborts
    aborts.add("c", now=105.5)  # a came 5.5 s ago: past the window
    assert "a" not in aborts and "b" in aborts and "c" in aborts


def test_a_steady_stream_of_aborts_keeps_only_its_window() -> None:
    aborts = RecentAborts(keep_s=5.0)
    for i in range(20_000):  # a request ended every 10 ms for 200 s
        aborts.add(f"chatcmpl-{i}", now=i / 100)
    assert len(aborts) <= 501
    assert "chatcmpl-19999" in aborts and "chatcmpl-19000" not in aborts


def test_the_count_is_bounded_too_and_a_repeated_abort_is_renewed() -> None:
    aborts = RecentAborts(keep_s=1e9, limit=3)
    for rid in ("a", "b", "c", "a", "d"):
        aborts.add(rid, now=0.0)
    assert len(aborts) == 3 and "a" in aborts and "b" not in aborts
