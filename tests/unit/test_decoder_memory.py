"""benchmarks.decoder_memory on a tiny checkpoint (CPU): the real engine serves its stream of requests, and every
sample has the process's anonymous memory beside Python's blocks and malloc's bytes, so that an H200 run can tell a
leak of Python objects from a native one."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.decoder_memory import main
from workers.models.synth import generate_checkpoint


def test_a_short_run_serves_requests_and_samples_every_reading(tmp_path: Path) -> None:
    model = generate_checkpoint(tmp_path / "tiny", "tiny", seed=0)
    out = tmp_path / "memory.json"
    argv = ["--model", str(model), "--device", "cpu", "--seconds", "3", "--sample-every", "1", "--max-prompt", "200"]
    main([*argv, "--blocks", "500", "--concurrency", "4", "--out", str(out)])
    samples = json.loads(out.read_text())["samples"]
    assert len(samples) >= 2
    last = samples[-1]
    assert last["requests"] > 4 and last["tokens"] > 0  # (requests finished and were replaced)
    assert last["anon_mib"] > 0 and last["python_blocks"] > 0 and last["gc_objects"] > 0
    assert last["malloc_mib"] is None or (last["malloc_mib"] > 0 and last["malloc_free_mib"] >= 0)
