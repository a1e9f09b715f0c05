"""The ``structured`` workload's requests (`benchmarks.workloads`, `benchmarks.serve`), its schemas
(`benchmarks.schemas`), the GPU driver's runs of it, and `benchmarks.grammar_cost` on the tiny checkpoint's
tokenizer (a smoke check of the harness: no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import jsonschema
import llguidance
import pytest

from benchmarks import gpu, grammar_cost, schemas, serve, workloads
from gateway.structured import json_schema_grammar
from workers.models.synth import demo_checkpoint


def bodies(opts: workloads.WorkloadOptions, streams: int, turns: int) -> dict[tuple[int, int], dict]:
    constrained = workloads.constrained_streams(opts, streams)
    return {
        (stream, turn): json.loads(
            serve.request_body(workloads.structured_request(opts, stream, turn, stream < constrained), "m")
        )
        for stream in range(streams)
        for turn in range(turns)
    }


def test_a_quarter_of_the_streams_send_a_strict_schema_and_no_ignore_eos() -> None:
    opts = workloads.WorkloadOptions(seed=3, prompt_tokens=60, text_max_tokens=40, json_max_tokens=300)
    assert workloads.constrained_streams(opts, 32) == 8
    sent = bodies(opts, 32, 3)
    for (stream, turn), body in sent.items():
        case = schemas.case_for(stream + turn)
        assert body["messages"][0]["content"].endswith(f"Reply with a JSON object {case.task}")
        assert body["stream"] and body["temperature"] == 0
        if stream < 8:
            assert "ignore_eos" not in body and body["max_tokens"] == 300
            assert body["response_format"] == {
                "type": "json_schema",
                "json_schema": {"name": case.name, "schema": case.schema, "strict": True},
            }
        else:
            assert body["ignore_eos"] is True and body["max_tokens"] == 40 and "response_format" not in body
    constrained_schemas = {b["response_format"]["json_schema"]["name"] for (s, _), b in sent.items() if s < 8}
    assert constrained_schemas == set(schemas.SCHEMAS)  # every schema is used


def test_the_control_sends_the_same_prompts_none_constrained() -> None:
    opts = workloads.WorkloadOptions(seed=3, prompt_tokens=60)
    control = workloads.WorkloadOptions(seed=3, prompt_tokens=60, constrained_share=0.0)
    assert workloads.constrained_streams(control, 32) == 0
    run, rerun = bodies(opts, 8, 2), bodies(control, 8, 2)
    assert [b["messages"] for b in run.values()] == [b["messages"] for b in rerun.values()]
    assert all(b["ignore_eos"] and "response_format" not in b for b in rerun.values())
    prompts = [b["messages"][0]["content"] for b in run.values()]
    assert len(set(prompts)) == len(prompts)  # fresh text every request: no prefix cache hits between them
    other_seed = bodies(workloads.WorkloadOptions(seed=4, prompt_tokens=60), 8, 2)
    assert not {b["messages"][0]["content"] for b in other_seed.values()} & set(prompts)


def test_structured_options_are_checked() -> None:
    with pytest.raises(SystemExit):
        serve.parse_args(["--workload", "structured", "--rate", "2"])  # streams need --concurrency
    with pytest.raises(SystemExit):
        serve.parse_args(["--workload", "structured", "--concurrency", "4", "--constrained-share", "1.5"])
    args = serve.parse_args(["--workload", "structured", "--concurrency", "4", "--constrained-share", "0.5"])
    opts = workloads.WorkloadOptions.from_args(args)
    assert (opts.constrained_share, opts.json_max_tokens, workloads.constrained_streams(opts, 4)) == (0.5, 512, 2)


@pytest.mark.parametrize("case", schemas.CASES, ids=lambda c: c.name)
def test_each_schema_compiles_and_its_example_answer_validates(case: schemas.SchemaCase) -> None:
    jsonschema.Draft202012Validator.check_schema(case.schema)
    jsonschema.validate(case.example, case.schema)
    assert llguidance.LLMatcher.validate_grammar(json_schema_grammar(case.schema)) == ""  # the server's grammar
    assert schemas.check_answer(case, case.example_text()) == (True, True)
    assert schemas.check_answer(case, case.example_text()[:-1]) == (False, False)  # cut short: no JSON
    assert schemas.check_answer(case, json.dumps({"unexpected": 1})) == (True, False)


def test_schemas_cover_what_agents_send() -> None:
    text = json.dumps([case.schema for case in schemas.CASES])
    for feature in ('"enum"', '"$ref"', '"$defs"', '"minItems"', '"maxItems"', '"minimum"', '"pattern"'):
        assert feature in text
    assert any(set(case.schema["properties"]) - set(case.schema["required"]) for case in schemas.CASES)  # optional
    assert any(  # nested objects
        p.get("type") == "object" for case in schemas.CASES for p in case.schema["properties"].values()
    )


def test_answer_checks_count_constrained_answers_only() -> None:
    records = [
        {"valid_json": True, "schema_valid": True},
        {"valid_json": True, "schema_valid": False},
        {"valid_json": False, "schema_valid": False},
        {"error": None},  # an unconstrained request
    ]
    assert serve.answer_checks(records) == {"constrained_answers": 3, "valid_json": 2, "schema_valid": 1}
    unchecked = [{"valid_json": True, "schema_valid": None}]  # no jsonschema on that machine
    assert serve.answer_checks(unchecked) == {"constrained_answers": 1, "valid_json": 1, "schema_valid": None}


def test_gpu_driver_runs_structured_with_its_control() -> None:
    (run, run_argv), (control, control_argv) = gpu.workload_argv("structured", 32, None)
    assert (run, control) == ("structured-c32", "structured-control-c32")
    args, control_args = serve.parse_args(run_argv), serve.parse_args(control_argv)
    assert (args.workload, args.concurrency, args.constrained_share) == ("structured", 32, 0.25)
    assert control_args.constrained_share == 0 and control_args.num_requests == args.num_requests
    assert control_args.paired_with == Path("structured-c32.json")  # (beside the control's --out)
    (_, _), (_, vllm_control) = gpu.workload_argv("structured", 32, None, "vllm-")
    assert serve.parse_args(vllm_control).paired_with == Path("vllm-structured-c32.json")
    assert "structured" in gpu.SERVE_WORKLOADS and "grammar" in gpu.PARTS


def test_grammar_cost_runs_on_the_tiny_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "grammar_cost.json"
    grammar_cost.main(["--checkpoint", str(demo_checkpoint()), "--repetitions", "2", "--steps", "12",
                       "--rows", "2,8", "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["config"]["rows"] == [2, 8] and result["config"]["schemas"] == list(schemas.SCHEMAS)
    figures = result["llguidance"]
    assert figures["version"]  # (the installed package's, recorded beside its figures)
    for key in ("compile_ms", "first_mask_ms", "ready_ms"):
        assert figures[key]["n"] == 2 * len(schemas.CASES)
        assert set(figures[key]) == {"n", "mean", "p50", "p99", "max"}
    assert set(figures["per_schema"]) == set(schemas.SCHEMAS)
    for rows in ("2", "8"):
        assert figures["steps"][rows]["fill_ms"]["n"] == figures["steps"][rows]["consume_ms"]["n"] == 12
        assert figures["steps_serial"][rows]["fill_ms"]["n"] == 12  # (one row after another, beside)
    assert sorted(figures["steps_by_threads"], key=int) == ["1", "4", "8"]  # (executors of set sizes)
    if importlib.util.find_spec("xgrammar") is None:
        assert "not installed" in result["xgrammar"]["skipped"]
        assert "xgrammar     skipped" in capsys.readouterr().out
    else:
        assert result["xgrammar"]["ready_ms"]["n"] == 2 * len(schemas.CASES)
    row = gpu.table_row(result)
    assert set(row["llguidance"]) == {"version", "ready_p99_ms", "fill_2_p50_ms", "fill_8_p50_ms"}


def test_gpu_driver_grammar_part_runs_ours_and_the_peers_python(tmp_path: Path) -> None:
    """The ``grammar`` part: grammar_cost with this Python, then through a stand-in for the vLLM peer's
    device.sh (its ``python3`` is this one here) with the peer's site first on the path."""
    peer = tmp_path / "peer"
    peer.mkdir()
    (peer / "device.sh").write_text(
        f"P={tmp_path}/peer-tmp\n"
        f'python3() {{ echo "PYTHONPATH=$PYTHONPATH" >&2; {sys.executable} "$@"; }}\n'
        '[ "${BASH_SOURCE[0]}" != "$0" ] && return 0\n'
        'case "$1" in setup) echo "vllm 0.22.0 (stand-in)";; *) exit 2;; esac\n'
    )
    result = tmp_path / "result"
    few = "--repetitions 2 --steps 5"  # (the part's plumbing is under test here, not the figures' spread)
    argv = ["grammar", "--result-dir", str(result), "--model", str(demo_checkpoint()), "--peer-dir", str(peer)]
    gpu.main([*argv, "--grammar-args", few])
    for name in ("grammar_cost.json", "vllm-grammar_cost.json"):  # (both runs were given --grammar-args)
        per_schema = json.loads((result / name).read_text())["llguidance"]["per_schema"]
        assert per_schema and all(figures["ready_ms"]["n"] == 2 for figures in per_schema.values()), name
    assert f"PYTHONPATH={tmp_path}/peer-tmp/site:" in (result / "raw" / "vllm-grammar_cost.log").read_text()
    record = (result / "summary.md").read_text()
    assert "| grammar_cost |" in record and "| vllm-grammar_cost |" in record and "ready_p99_ms" in record


def test_a_paired_control_asks_for_each_constrained_answers_length(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def record(stream: int, request: int, kind: str, tokens: int, error: str | None = None) -> dict[str, object]:
        tags = {"stream_kind": kind, "stream": stream, "request": request}
        return {"tags": tags, "output_tokens": tokens, "error": error}

    requests = [record(0, 0, "constrained", 40), record(0, 1, "constrained", 90), record(1, 0, "constrained", 60)]
    requests += [record(1, 1, "constrained", 7, error="503"), record(5, 0, "unconstrained", 256)]
    (tmp_path / "structured-c32.json").write_text(json.dumps({"requests": requests}))
    paired = serve.paired_lengths(Path("structured-c32.json"), tmp_path / "control.json")
    assert paired.streams == {0, 1} and paired.median == 60  # (the failed request is no length to copy)
    opts = workloads.WorkloadOptions(constrained_share=0.0)
    spec = workloads.structured_request(opts, 0, 1, False)
    stand_in = paired.stand_in(spec, 0, 1)
    assert (stand_in.max_tokens, stand_in.tags["stream_kind"], stand_in.response_format) == (90, "paired", None)
    assert stand_in.messages == spec.messages
    assert paired.stand_in(spec, 1, 1).max_tokens == 60  # not in that run (or failed there): the median
    with pytest.raises(SystemExit, match="no completed constrained request"):
        (tmp_path / "empty.json").write_text(json.dumps({"requests": requests[-1:]}))
        serve.paired_lengths(tmp_path / "empty.json", tmp_path / "control.json")
    with pytest.raises(SystemExit):  # (a constrained run cannot be a paired control)
        serve.parse_args(["--workload", "structured", "--concurrency", "4", "--paired-with", "x.json"])
    assert "--paired-with is for a structured control run" in capsys.readouterr().err
