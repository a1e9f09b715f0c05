"""`benchmarks.engine_mixed`, the decoder engine under mixed's load: its maths on hand-made forwards, and a
short CPU run of the whole harness on the tiny checkpoint (a smoke check of the harness, not a timing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import engine_mixed
from workers.models.synth import demo_checkpoint


def test_forward_split_separates_decode_and_prompt_forwards() -> None:
    # Prompt forwards cost 2 ms plus 5 us a token; decodes 3 ms; over one second of wall time.
    forwards = [(32, 0, 3.0), (32, 0, 3.0), (33, 1000, 7.0), (34, 2000, 12.0), (33, 200, 3.0)]
    split = engine_mixed.forward_split(forwards, 1.0)
    assert split["decode_forwards"] == 2 and split["prompt_forwards"] == 3
    assert split["decode_ms_mean"] == pytest.approx(3.0)
    assert split["prompt_tokens"] == 3200
    assert split["prompt_us_per_token"] == pytest.approx(5.0)
    assert split["prompt_ms_at_zero_tokens"] == pytest.approx(2.0)
    assert split["device_busy_share"] == pytest.approx(0.028)
    assert split["decode_ms_share"] + split["prompt_ms_share"] == pytest.approx(split["device_busy_share"])


def test_cpu_run_counts_text_tokens_and_vision_requests(tmp_path: Path) -> None:
    out = tmp_path / "engine_mixed.json"
    # A clock of 0.25 s per engine step: each window is 12 steps, whatever else the machine runs.
    argv = ["--model", str(demo_checkpoint()), "--out", str(out), "--device", "cpu", "--seconds", "3"]
    # (a block size other than the server's: the option works)
    engine_mixed.main([*argv, "--step-s", "0.25", "--rate", "4", "--block-size", "32"])
    result = json.loads(out.read_text())
    assert result["block_size"] == 32
    control, mixed = result["control"], result["mixed"]
    assert control["vision_sent"] == 0 and control["text_tokens_per_s"] > 0
    assert control["forwards"]["prompt_forwards"] > 0  # the text streams' own prompts
    assert mixed["vision_sent"] == 12  # 4/s over 3 s, the first at once
    assert 0 < mixed["vision_done"] <= mixed["vision_sent"]
    assert mixed["vision_ttft_mean_ms"] > 0
    # Each vision prompt holds 3 x 972 media tokens: the mixed window's forwards carry them.
    assert mixed["forwards"]["prompt_tokens"] >= mixed["vision_done"] * 3 * 972
    assert result["text_share"] == pytest.approx(mixed["text_tokens_per_s"] / control["text_tokens_per_s"])
    assert mixed["launch"]["other_ms"] > 0  # (no graphs on the CPU: every step is "other")
