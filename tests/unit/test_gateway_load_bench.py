"""`benchmarks.gateway_load`: a short run of the real gateway process against the stand-in decoder (a smoke
check of the harness: every token the stand-in sends reaches a client; not a timing)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import gateway_load


def test_short_run_delivers_the_stand_in_tokens_to_streaming_clients(tmp_path: Path) -> None:
    out = tmp_path / "gateway_load.json"
    argv = ["--streams", "4", "--step-ms", "5", "--seconds", "1.5", "--warmup", "1", "--max-tokens", "16"]
    gateway_load.main([*argv, "--out", str(out)])
    (result,) = json.loads(out.read_text())["results"]
    assert result["errors"] == []
    assert result["tokens_per_s"] > 100  # 4 streams at one token per 5-ms step: 800/s if nothing is late
    assert result["gateway_cpu_us_per_token"] > 0
    # A chunk carries one token or several merged ones, never less than one (counted over whole requests).
    assert result["whole_requests"] > 0
    assert result["tokens_per_chunk"] >= 1.0
    assert result["chunk_gap_p50_ms"] > 0
