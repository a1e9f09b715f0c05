"""The GPU driver's paths for every model family, run end to end on the CPU with tiny checkpoints, so that what the
H200 runs for Qwen2.5-VL and Qwen3-VL (`benchmarks.gpu --family F --size S`: the checkpoint, `benchmarks.engine`'s
batch-1 TPOT, `benchmarks.vision`'s images/s, the ``hf-parity`` part's transformers reference and verdict) has run
once before it gets there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks import engine, gpu, parity, vision

FAMILIES = ["qwen2_5_vl", "qwen3_vl"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


def driver_args(checkpoints: Path, family: str, *argv: str) -> list[str]:
    return ["--family", family, "--size", "tiny", "--checkpoint-dir", str(checkpoints), *argv]


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_of_a_family_is_generated_once_and_reused(checkpoints: Path, family: str) -> None:
    args = gpu.parse_args(["engine", "--result-dir", str(checkpoints / "unused"), *driver_args(checkpoints, family)])
    path = gpu.checkpoint(args)
    assert path == checkpoints / f"{family}-tiny-seed0"
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == family
    written = (path / "config.json").stat().st_mtime_ns
    assert gpu.checkpoint(args) == path and (path / "config.json").stat().st_mtime_ns == written  # not again


def test_unknown_family_is_refused_by_the_driver(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        gpu.parse_args(["engine", "--result-dir", str(tmp_path), "--family", "llava"])


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_benchmark_runs_the_family_as_the_decoder_would(checkpoints: Path, family: str) -> None:
    args = gpu.parse_args(["engine", "--result-dir", str(checkpoints / "unused"), *driver_args(checkpoints, family)])
    out = checkpoints / f"engine-{family}.json"
    engine.main(["--model", str(gpu.checkpoint(args)), "--out", str(out), "--device", "cpu"])
    result = json.loads(out.read_text())
    assert result["model_type"] == family
    assert result["server_kernels"] == {"fuse": False, "graphs": "off"}  # (the CPU's choice for any family)
    batch_one = result["engine_tpot"][0]
    assert batch_one["batch"] == 1 and batch_one["mean_step_ms"] > 0
    assert batch_one["steps"] == 1 + 4  # the prefill, then a step per further token (4 new tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_benchmark_runs_the_familys_tower_and_transformers(checkpoints: Path, family: str) -> None:
    """The ``vision`` part's images/s script on the family's tower (the encoder's loader) and transformers' tower of
    the same family; the part leaves out `benchmarks.vit_profile`, which takes Qwen2-VL's tower apart."""
    args = gpu.parse_args(["vision", "--result-dir", str(checkpoints / "unused"), *driver_args(checkpoints, family)])
    out = checkpoints / f"vision-{family}.json"
    vision.main(["--model", str(gpu.checkpoint(args)), "--out", str(out), "--device", "cpu", "--batches", "2"])
    result = json.loads(out.read_text())
    assert result["model_type"] == family and set(result["sizes"]) == set(vision.SIZES)
    for row in result["sizes"].values():
        assert [t["batch"] for t in row["tower"]] == [2] and row["tower"][0]["images_per_s"] > 0
        assert row["tower"][0]["roofline_ms"] > 0 and row["hf"][0]["images_per_s"] > 0


@pytest.mark.parametrize("family", ["qwen2_vl", *FAMILIES])
def test_vision_part_profiles_only_qwen2_vls_tower(checkpoints: Path, tmp_path: Path, family: str) -> None:
    args = gpu.parse_args(["vision", "--result-dir", str(tmp_path), *driver_args(checkpoints, family)])
    run = gpu.Run(tmp_path, tmp_path, args)
    called: list[str] = []
    run.python = lambda name, module, *argv, timeout: called.append(module) or 0  # type: ignore[method-assign]
    run.keep = lambda name, path: None  # type: ignore[method-assign]
    gpu.part_vision(run)
    profile = ["benchmarks.vit_profile"] if family == "qwen2_vl" else []
    assert called == ["benchmarks.vision", *profile]


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_parity_part_compares_transformers_with_a_recorded_server(
    checkpoints: Path, tmp_path: Path, family: str
) -> None:
    """The part's transformers reference (the family's own model class, fp32 on the CPU here) against answers
    as a server records them: identical answers pass, and a logprob moved beyond the tolerance fails."""
    args = gpu.parse_args(["hf-parity", "--result-dir", str(tmp_path), *driver_args(checkpoints, family)])
    model = gpu.checkpoint(args)
    server = tmp_path / "server.json"
    parity.reference(model, server, "cpu")
    answers = json.loads(server.read_text())
    assert len(answers["answers"]) == parity.TEXT_PROMPTS + parity.IMAGE_PROMPTS
    raw = tmp_path / "res" / "raw"
    raw.mkdir(parents=True)
    shutil.copy(server, raw / "parity.json")  # our stack's, as the serve part's parity workload leaves it
    answers["answers"][0][3]["logprob"] -= 1.0
    (raw / "vllm-parity.json").write_text(json.dumps(answers))  # a server out of tolerance
    argv = ["hf-parity", "--result-dir", str(tmp_path / "res"), "--hf-device", "cpu"]
    gpu.main([*argv, *driver_args(checkpoints, family)])
    ours = json.loads((tmp_path / "res" / "parity-vs-hf.json").read_text())
    assert ours["ok"] and ours["tolerance"] == gpu.PARITY_TOLERANCE
    assert all(prompt["identical"] for prompt in ours["prompts"])
    assert not json.loads((tmp_path / "res" / "vllm-parity-vs-hf.json").read_text())["ok"]
    summary = (tmp_path / "res" / "summary.md").read_text()
    assert "parity-vs-hf" in summary and "vllm-parity-vs-hf" in summary
    assert (tmp_path / "res" / "hf-parity.json").exists()


def test_a_result_folder_used_again_keeps_the_earlier_calls_record(tmp_path: Path) -> None:
    """serve and vllm in one call, hf-parity into the same folder in the next: summary.md keeps both."""
    info = {"gpu": "H200", "software": "torch", "revision": "abc1234", "repo": "/r", "date": "today"}
    args = gpu.parse_args(["serve", "--result-dir", str(tmp_path)])
    first = gpu.Run(tmp_path, tmp_path, args, rows=[{"name": "vllm-seed3img-c32", "completed": 64}])
    gpu.write_record(first, {**info, "command": "python3 -m benchmarks.gpu vllm serve"})
    earlier = json.loads((tmp_path / "calls.json").read_text())
    second = gpu.Run(tmp_path, tmp_path, args, rows=[{"name": "parity-vs-hf", "exit": 0}], earlier_calls=earlier)
    gpu.write_record(second, {**info, "command": "python3 -m benchmarks.gpu hf-parity"})
    summary = (tmp_path / "summary.md").read_text()
    assert summary.index("gpu vllm serve") < summary.index("vllm-seed3img-c32") < summary.index("gpu hf-parity")
    assert "parity-vs-hf" in summary and len(json.loads((tmp_path / "calls.json").read_text())) == 2


def test_the_driver_names_a_dependency_missing_on_the_box_before_starting_the_stack(tmp_path: Path) -> None:
    """A wheel left out of .whl (jsonschema once) is named at once, not found after the health wait."""
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\ndependencies = ["numpy>=1", "surely-not-installed-dist>=2", '
        "\"decord>=0.6; platform_machine == 'x86_64'\"]\n"
    )
    run = gpu.Run(tmp_path, tmp_path / "out", gpu.parse_args(["--result-dir", str(tmp_path / "out"), "serve"]))
    assert gpu.missing_distributions(run) == ["surely-not-installed-dist"]  # (decord: only videos need it)
    with pytest.raises(RuntimeError, match="surely-not-installed-dist, missing here: carry their wheels"):
        gpu.start_stack(run, tmp_path)
    assert gpu.missing_distributions(gpu.Run(gpu.HERE, tmp_path / "o2", run.args)) == []  # this checkout's own


def test_vision_rss_probe_runs_the_tower_and_reports_rss(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from benchmarks import vision_rss
    from workers.models.synth import generate_checkpoint

    checkpoint = generate_checkpoint(tmp_path / "tiny", "tiny", seed=0)
    vision_rss.main(["--checkpoint", str(checkpoint), "--forwards", "200", "--trim"])
    assert capsys.readouterr().out.startswith("200 forwards: ") and vision_rss.rss_mib() > 0


def test_vision_benchmark_runs_the_tower_in_fp8_against_the_unquantized_one(checkpoints: Path) -> None:
    """``--quantization fp8`` (the issue's FP8 images/s at 768x1024): the FP8 tower's images/s, the unquantized
    tower's on the same batches, and the embedding distance between them (docs/quantization.md's bound)."""
    args = gpu.parse_args(
        ["vision", "--result-dir", str(checkpoints / "unused"), *driver_args(checkpoints, "qwen2_5_vl")]
    )
    out = checkpoints / "vision-fp8.json"
    argv = ["--model", str(gpu.checkpoint(args)), "--out", str(out), "--device", "cpu", "--batches", "1"]
    vision.main([*argv, "--skip-hf", "--quantization", "fp8", "--sizes", "768x1024"])
    result = json.loads(out.read_text())
    assert result["quantization"] == "fp8" and list(result["sizes"]) == ["768x1024"]
    row = result["sizes"]["768x1024"]
    assert row["tower"][0]["images_per_s"] > 0 and row["reference_tower"][0]["images_per_s"] > 0
    assert 0.005 < row["embedding_distance"] < 0.08  # tests/unit/test_vision_fp8.py's EMBEDDING_BOUND


def test_the_fp8_part_makes_a_block_wise_copy_and_the_engine_serves_it_or_quantizes_at_load(checkpoints: Path) -> None:
    """`benchmarks.gpu fp8`'s CPU-checkable pieces: the FP8 copy of the synthetic checkpoint (once), and
    `benchmarks.engine --quantization` loading the language model as the decoder would (FP8 at load or as stored)."""
    args = gpu.parse_args(["fp8", "--result-dir", str(checkpoints / "unused"), *driver_args(checkpoints, "qwen2_vl")])
    fp8_model = gpu.fp8_checkpoint(args)
    assert fp8_model == checkpoints / "qwen2_vl-tiny-seed0-fp8-block"
    stored = json.loads((fp8_model / "config.json").read_text())["quantization_config"]
    assert stored["weight_block_size"] == [128, 128]
    for model, quantization, expected in [
        (gpu.checkpoint(args), "fp8", "fp8-channel (quantized at load)"),
        (fp8_model, "auto", "fp8-block"),
        (gpu.checkpoint(args), "auto", None),
    ]:
        out = checkpoints / "engine-fp8.json"
        engine.main(["--model", str(model), "--quantization", quantization, "--out", str(out), "--device", "cpu"])
        result = json.loads(out.read_text())
        assert result["quantization"] == expected and result["engine_tpot"][0]["mean_step_ms"] > 0
    assert (
        gpu.parse_args(["fp8", "--result-dir", "x", "--model", str(fp8_model)])
        and gpu.fp8_checkpoint(gpu.parse_args(["fp8", "--result-dir", "x", "--model", str(fp8_model)])) is None
    )  # (a given checkpoint is served as it is: no copy)
