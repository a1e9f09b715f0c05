"""benchmarks.parity's verdict: answers may part only at a near tie, after a prefix of matching logprobs."""

from __future__ import annotations

from typing import Any

from benchmarks.parity import compare_answer


def answer(*tokens: tuple[str, float, float]) -> list[dict[str, Any]]:
    """Tokens as (chosen, its logprob, the runner-up's logprob)."""
    return [{"token": t, "logprob": lp, "top": [[t, lp], ["~", second]]} for t, lp, second in tokens]


def test_identical_answers_are_within_tolerance() -> None:
    ref = answer(("a", -0.5, -2.0), ("b", -0.1, -3.0))
    assert compare_answer(ref, ref, 0.1) == {
        "identical": True,
        "parted_at": None,
        "tie_margin": None,
        "max_logprob_gap": 0.0,
        "ok": True,
    }


def test_parting_at_a_near_tie_is_within_tolerance() -> None:
    ref = answer(("a", -0.5, -2.0), ("b", -0.70, -0.72), ("c", -1.0, -1.5))
    other = answer(("a", -0.52, -2.0), ("x", -0.69, -0.71))
    result = compare_answer(ref, other, 0.1)
    assert result["parted_at"] == 1 and abs(result["tie_margin"] - 0.02) < 1e-9 and result["ok"]


def test_parting_where_the_reference_was_sure_is_a_failure() -> None:
    ref = answer(("a", -0.5, -2.0), ("b", -0.1, -3.0))
    other = answer(("a", -0.5, -2.0), ("x", -0.2, -0.3))
    assert not compare_answer(ref, other, 0.1)["ok"]


def test_a_logprob_gap_before_parting_is_a_failure() -> None:
    ref = answer(("a", -0.5, -2.0), ("b", -0.1, -3.0))
    other = answer(("a", -0.9, -2.0), ("b", -0.1, -3.0))
    result = compare_answer(ref, other, 0.1)
    assert result["identical"] and not result["ok"]
