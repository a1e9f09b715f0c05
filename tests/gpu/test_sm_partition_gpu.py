"""`[encoder] sm_split`: two processes confined to the two sides of one SM split run their kernels on disjoint SMs
that cover the GPU (each program of a Triton kernel records the SM it ran on: benchmarks/green_isolation.py).
Needs a CUDA GPU (skipped otherwise)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def sms_used(side: str, split: int, out: Path) -> set[int]:
    command = [sys.executable, "-m", "benchmarks.green_isolation", "--role", "smids", "--side", side]
    subprocess.run([*command, "--sms", str(split), "--out", str(out / f"{side}.jsonl")], check=True, timeout=300)
    return set(json.loads((out / f"{side}.jsonl").read_text())["smids"])


def test_the_two_sides_of_a_split_run_on_disjoint_sms(tmp_path: Path) -> None:
    total = torch.cuda.get_device_properties(0).multi_processor_count
    split = (total * 3 // 4) // 8 * 8
    first, rest, whole = (sms_used(side, split, tmp_path) for side in ("first", "rest", "all"))
    assert len(first) == split and not first & rest, (sorted(first), sorted(rest))
    assert first | rest == whole and len(whole) == total


def test_a_split_that_leaves_one_side_no_sms_is_refused_before_start() -> None:
    from common.config import Config
    from workers.models.runtime import check_sm_split

    cfg = Config()
    cfg.encoder.gpus = [0]  # the encoder beside the lone decoder on GPU 0
    total = torch.cuda.get_device_properties(0).multi_processor_count
    cfg.encoder.sm_split = (total * 3 // 4) // 8 * 8
    check_sm_split(cfg)
    cfg.encoder.sm_split = total
    with pytest.raises(ValueError, match="leaves no SMs for the vision side"):
        check_sm_split(cfg)
