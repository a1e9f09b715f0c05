"""benchmarks.fp8_noise on a tiny checkpoint: the weights it rounds are FP8 values times their block's scale, and
its comparison is of the same model before and after."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.fp8_noise import compare, language_linears, main, round_weights
from workers.models.synth import generate_checkpoint


def test_rounded_weights_are_on_the_fp8_grid_of_their_block(tmp_path: Path) -> None:
    linear = torch.nn.Linear(256, 200, bias=False)
    original = linear.weight.data.clone()
    round_weights([linear])
    rounded = linear.weight.data
    assert not torch.equal(rounded, original)
    block = original[:128, :128]
    scale = block.abs().amax() / 448
    assert torch.equal((rounded[:128, :128] / scale).to(torch.float8_e4m3fn).float() * scale, rounded[:128, :128])
    assert ((rounded - original).norm() / original.norm()).item() < 0.05


def test_a_distribution_compared_with_itself_has_not_moved() -> None:
    logprobs = torch.log_softmax(torch.randn(1000), -1)
    row = compare(logprobs, logprobs)
    assert row["same_first_token"] and row["kl"] == 0 and row["max_logprob_change_top20"] == 0


def test_a_run_on_a_tiny_checkpoint_reports_every_prompt(tmp_path: Path) -> None:
    model = generate_checkpoint(tmp_path / "tiny", "tiny", seed=0)
    out = tmp_path / "noise.json"
    main(["--model", str(model), "--activations", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 8 and all(row["kl"] > 0 for row in rows)  # rounding moved every distribution a little
    assert all(row["max_logprob_change_top20"] < 2 for row in rows)


def test_only_the_language_models_projections_are_rounded(tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(generate_checkpoint(tmp_path / "t", "tiny", seed=1))
    names = {id(m) for m in language_linears(model)}
    visual = [m for n, m in model.named_modules() if "visual" in n and isinstance(m, torch.nn.Linear)]
    assert names and visual and not names & {id(m) for m in visual}
