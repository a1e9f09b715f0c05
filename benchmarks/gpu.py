"""The GPU driver: ``python3 -m benchmarks.gpu --result-dir DIR [options] PART [PART ...]`` on the GPU machine.

Parts (run in the order given, each against every ``--repo``):

- ``tests``: the GPU-marked tests (tests/gpu and the unit files with GPU cases).
- ``kernels``: decode attention bandwidth (`benchmarks.kernels`), the prefill tile sweep
  (`benchmarks.kernels_prefill`), the decode projections per BLAS library (`benchmarks.decode_gemms`).
- ``engine``: `benchmarks.engine` (decode steps, prefills, the real engine's TPOT at batch 1 and 32).
- ``vision``: the ViT's images/s (`benchmarks.vision`) and where its time goes (`benchmarks.vit_profile`).
- ``serve``: the stack under supervisord, the ``--workloads`` at each of ``--clients`` (`benchmarks.serve`); with
  ``--url`` against a server already running instead.
- ``units``: issue 31's split (`benchmarks.units`): an encoder unit on its own GPUs and a pd unit on GPU 0, each its
  own supervisord, over loopback tcp:// + CurveZMQ, the ``--workloads`` at each of ``--clients`` for 1, 2 and 3
  encoder GPUs where there are that many (one GPU: both units on it).
- ``hf``: the transformers baseline on seed3img's prompts (`benchmarks.baseline_hf`).
- ``hf-parity``: transformers' bf16 answers to `benchmarks.parity`'s prompts, compared with those the ``parity``
  workload recorded from each server before it (ours, vLLM's) within ``--parity-tolerance``.
- ``vllm``: vLLM 0.22 (`--peer-dir`, a copy of ../shared/tools/vllm-peer) on the same checkpoint with the same
  workloads, then stopped; ``vllm-part1`` and ``vllm-part2`` copy the carried tarball parts first (one device
  call each, see that folder's README).
- ``grammar``: `benchmarks.grammar_cost` (schema compile time, per-step bitmask fill of 8 and 32 rows) with the
  checkpoint's tokenizer: llguidance with this Python, then, where the vLLM peer is carried (``--peer-dir``,
  set up by ``vllm`` or its ``setup``), with vLLM's Python too: its llguidance and xgrammar side by side.
- ``fp8``: issue 29's kernels and engine: the FP8 GPU tests, `benchmarks.fp8_gemm`, the tower quantized at load
  (`benchmarks.vision --quantization fp8`, 768x1024), and `benchmarks.engine` in bf16, quantized at load and on a
  block-wise FP8 copy of the synthetic checkpoint (generated beside it; ``serve``/``vllm`` take it as ``--model``).
- ``soak``: `benchmarks.soak` for ``--soak-s`` seconds with chaos on a stack of its own (seed3img-sized traffic, 32
  clients); it takes about ``--soak-s`` plus 2 minutes (the stack's start, drain, stop), so ``--soak-s 480`` needs a
  device call of about 10 to 11 minutes (more than one 10-minute command: benchmarks/README.md says how).
- ``overload``: `benchmarks.soak --burst` (seed3img at 10x the measured sustainable rate), about 4 minutes.

A part's tool that outlasts its limit (``--timeout``; for ``soak`` and ``overload`` what their plan needs,
``benchmarks.soak --time-bound``) gets SIGTERM, then SIGKILL 90 s later: the soak stops its stack on SIGTERM.

Workloads (``--workloads``, for ``serve`` and ``vllm`` alike): `benchmarks.serve`'s ``seed3img``, ``seed3img-anchor``,
``multiturn``, ``text``, ``mixed`` (with its text-only control), ``structured`` (a quarter of the streams
constrained to JSON schemas, with its control of none constrained), ``parity``, and ``vllm-bench``: vLLM's own
client (`vllm bench serve`, ANCHORS' 3 x 768x1024 images) from the carried peer, against whichever server is
measured.

The checkpoint is ``--model``, else the synthetic one of ``--family`` and ``--size`` (`workers.models.synth`),
generated into ``--checkpoint-dir`` the first time a part needs it and reused while the machine stays warm.

Each part writes its summary (JSON without per-request records, `benchmarks.prune_results.summarise_json`)
into the result folder and everything raw (full JSONs, logs, /metrics, `nvidia-smi dmon`) under its ``raw/``,
which git ignores. ``machine.json`` and ``summary.md`` (command, machine, revision, date, table) are rewritten
after every part; with ``--ship DIR`` the folder is also packed into DIR/results.tgz after every part, so what
finished comes back from a call cut short.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from benchmarks.prune_results import load_json, summarise_json
from benchmarks.units import EncoderUnit, UnitsPlan, plans
from common.config import Config, gpu_count
from common.model_files import SUPPORTED_MODEL_TYPES

HERE = Path(__file__).resolve().parents[1]  # this checkout: the client, the wheels, gpu.toml
PORT = 8000
PEER_PORT = 8100
PARTS = (
    "tests",
    "fp8",
    "kernels",
    "engine",
    "vision",
    "serve",
    "units",
    "hf",
    "hf-parity",
    "vllm",
    "vllm-part1",
    "vllm-part2",
    "grammar",
    "soak",
    "overload",
)
SERVE_WORKLOADS = ("seed3img", "seed3img-anchor", "multiturn", "text", "mixed", "structured")  # benchmarks.serve's
WORKLOADS = ("parity", *SERVE_WORKLOADS, "vllm-bench")
GPU_TESTS = ["tests/gpu", "tests/unit/test_paged.py", "tests/unit/test_sampling.py", "tests/unit/test_model_parity.py"]
# bf16 against transformers' bf16 (`benchmarks.parity compare`): the one-GPU engine's own gap on the 7b-shaped
# Qwen2-VL checkpoint, three bf16 ulps of its logits (results/2026-11-30-h200x2-tp-parity-d674b44).
PARITY_TOLERANCE = 0.1875
# A timed-out tool's time between SIGTERM and SIGKILL: past the soak's stop of its stack (supervisord's own wait
# for its programs, benchmarks.soak_stack.STOP_WAIT_S).
STOP_GRACE_S = 90


Settings = Sequence[tuple[str, str, object]]  # (section, key, value), as ``--set`` gives them


@dataclass
class Run:
    """One repository's run: where its code is, where its results go, what it wrote."""

    repo: Path
    out: Path
    args: argparse.Namespace
    rows: list[dict[str, Any]] = field(default_factory=list)
    earlier_calls: list[dict[str, Any]] = field(default_factory=list)  # calls.json of this folder's earlier calls

    @property
    def raw(self) -> Path:
        return self.out / "raw"

    def env(self, code: Path | None = None) -> dict[str, str]:
        """The environment of a tool run from ``code`` (default: the repository under test)."""
        site = ["/tmp/site"] if Path("/tmp/site").is_dir() else []
        return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": ":".join([*site, str(code or self.repo)])}

    def python(self, name: str, module: str, *argv: str, timeout: int, cwd: Path | None = None) -> int:
        """``python3 -m module argv`` in the repository (or ``cwd``), its output into raw/NAME.log; past ``timeout``
        stopped (`stop_gently`) and 124."""
        self.raw.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", module, *argv]
        log(f"{name}: {shlex.join(command)} (at most {timeout} s)")
        with open(self.raw / f"{name}.log", "w") as out:
            process = subprocess.Popen(
                command, cwd=cwd or self.repo, env=self.env(cwd), stdout=out, stderr=subprocess.STDOUT
            )
            try:
                code = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log(f"{name}: past {timeout} s: SIGTERM, SIGKILL {STOP_GRACE_S} s later")
                stop_gently(process)
                code = 124
        if code:
            log(f"{name}: exit {code}")
        return code

    def keep(self, name: str, path: Path) -> None:
        """The summary of the JSON at ``path`` (in raw/) as NAME.json, and a row for summary.md."""
        if not path.exists():
            self.rows.append({"name": name, "missing": True})
            return
        data = load_json(path)
        (self.out / f"{name}.json").write_text(json.dumps(summarise_json(data), indent=1) + "\n")
        self.rows.append({"name": name, **table_row(data)})


def stop_gently(process: subprocess.Popen[Any]) -> None:
    """SIGTERM, then SIGKILL if it has not ended ``STOP_GRACE_S`` later: a tool that started a stack (the soak) stops
    it on SIGTERM, which SIGKILL would leave running, holding the GPU and the ports of the next part's."""
    process.terminate()
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def log(message: str) -> None:
    print(f"[gpu {time.strftime('%H:%M:%S')}] {message}", flush=True)


def table_row(data: Any) -> dict[str, Any]:
    """The figures summary.md tabulates: a serve run's headline, the engine's TPOT, else nothing."""
    if isinstance(data, dict) and "summary" in data and "mean_tpot_ms" in data["summary"]:
        s = data["summary"]
        keys = (
            "completed",
            "errors",
            "output_tokens_per_s",
            "mean_ttft_ms",
            "p99_ttft_ms",
            "mean_tpot_ms",
            "p50_tpot_ms",
            "p99_itl_ms",
        )
        return {key: s.get(key) for key in keys}
    if isinstance(data, dict) and "request_throughput" in data:  # `vllm bench serve --save-result`
        keys = ("completed", "failed", "request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms")
        return {key: data.get(key) for key in (*keys, "mean_tpot_ms", "p99_itl_ms")}
    if isinstance(data, dict) and "engine_tpot" in data:
        return {"engine_tpot": data["engine_tpot"]}
    if isinstance(data, dict) and "llguidance" in data and "xgrammar" in data:  # `benchmarks.grammar_cost`
        return {library: grammar_row(data[library]) for library in ("llguidance", "xgrammar")}
    return {}


def grammar_row(figures: dict[str, Any]) -> dict[str, Any] | str:
    """A library's compile p99 (to a ready matcher) and its p50 mask fill per row count, or why it was skipped."""
    if "skipped" in figures:
        return f"skipped: {figures['skipped']}"
    fills = {f"fill_{rows}_p50_ms": steps["fill_ms"]["p50"] for rows, steps in figures["steps"].items()}
    return {"version": figures["version"], "ready_p99_ms": figures["ready_ms"]["p99"], **fills}


# --- the machine: wheels, the venv wrapper, the checkpoint ---------------------------------------------------


def _has_stack_packages() -> bool:
    """This Python already has what the wheels bring (a development machine whose .whl/ is for the GPU's)."""
    return all(importlib.util.find_spec(name) is not None for name in ("zmq", "pydantic", "supervisor"))


# The stack's dependencies that are optional on the GPU box: only video requests need decord (and its wheel is
# often left out of .whl to make room for the vLLM parts).
OPTIONAL_ON_BOX = {"decord"}
_MISSING_DISTRIBUTIONS = """
import importlib.metadata, re, sys, tomllib
specs = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
names = [re.split(r"[\\s<>=!~;\\[]", spec, maxsplit=1)[0] for spec in specs]
for name in names:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        print(name)
"""


def missing_distributions(run: Run) -> list[str]:
    """The repository's declared dependencies that the stack's Python (with the carried wheels) lacks."""
    out = subprocess.run(
        [sys.executable, "-c", _MISSING_DISTRIBUTIONS, str(run.repo / "pyproject.toml")],
        env=run.env(),
        capture_output=True,
        text=True,
        check=True,
    )
    return [name for name in out.stdout.split() if name not in OPTIONAL_ON_BOX]


def install_wheels() -> None:
    """The wheels carried in .whl/ (../shared/tools/device-wheels.sh fills it) into /tmp/site, once per machine."""
    wheels = sorted((HERE / ".whl").glob("*.whl"))
    if not wheels or (Path("/tmp/site") / ".installed").exists() or _has_stack_packages():
        return
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--upgrade",
            "--target",
            "/tmp/site",
            *map(str, wheels),
        ],
        check=True,
    )
    (Path("/tmp/site") / ".installed").touch()


def venv_wrapper(repo: Path) -> None:
    """ops/vlm.conf runs .venv/bin/python: where that is no Python with torch, a wrapper around this one."""
    python = repo / ".venv" / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import torch"], capture_output=True).returncode == 0:
        return
    if (repo / ".venv").is_symlink() or (repo / ".venv").is_file():
        (repo / ".venv").unlink()
    shutil.rmtree(repo / ".venv", ignore_errors=True)  # never write through a venv's python symlink
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)


def checkpoint(args: argparse.Namespace) -> Path:
    """``--model``, else the synthetic checkpoint of ``--family`` and ``--size`` in ``--checkpoint-dir``, generated
    the first time a part needs it and reused by every later part and call while the machine stays warm."""
    if args.model:
        return Path(args.model)
    return synthetic_checkpoint(args)


def synthetic_checkpoint(args: argparse.Namespace, quantization: str | None = None) -> Path:
    """``--family``/``--size``'s synthetic checkpoint (seed 0) in ``--checkpoint-dir``, its linear weights in the
    hub FP8 format ``quantization`` names where given; generated the first time, reused while the machine stays."""
    name = f"{args.family}-{args.size}-seed0" + (f"-{quantization}" if quantization else "")
    model = Path(args.checkpoint_dir) / name
    if not (model / "config.json").exists():  # (the generator renames a finished directory into place)
        log(f"generating the {args.family} {args.size} synthetic checkpoint at {model}")
        command = [sys.executable, "-m", "workers.models.synth", "--family", args.family, "--size", args.size]
        command += ["--out", str(model), "--seed", "0", *(["--quantization", quantization] if quantization else [])]
        subprocess.run(command, cwd=HERE, env={**os.environ, "PYTHONPATH": str(HERE)}, check=True)
    return model


def revision(run: Run) -> str:
    """The checkout's `.revision` file (an exported tree has no git metadata), ``--rev`` for this checkout, else
    git's HEAD where the checkout is a repository's top (the device copy's git metadata may lag its tree)."""
    if (run.repo / ".revision").exists():
        return (run.repo / ".revision").read_text().strip()
    if run.args.rev and run.repo == HERE:
        return run.args.rev
    git = ["git", "-C", str(run.repo), "rev-parse"]
    top = subprocess.run([*git, "--show-toplevel"], capture_output=True, text=True).stdout.strip()
    if not top or Path(top).resolve() != run.repo:
        return "unknown"
    return subprocess.run([*git, "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"


def machine(run: Run) -> dict[str, Any]:
    query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    gpu = subprocess.run(query, capture_output=True, text=True).stdout.strip() if shutil.which(query[0]) else "no GPU"
    versions = subprocess.run(
        [sys.executable, "-c", "import torch; print('torch', torch.__version__)"],
        capture_output=True,
        text=True,
        env=run.env(),
    ).stdout.strip()
    return {
        "gpu": gpu,
        "software": versions,
        "revision": revision(run),
        "repo": str(run.repo),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python3", "-m", "benchmarks.gpu", *sys.argv[1:]]),
    }


# --- the stack ------------------------------------------------------------------------------------------------


def stack_config(run: Run, extra: Settings = (), file_name: str = "gpu.toml") -> Path:
    """benchmarks/gpu.toml (the repository's, else this one's) with every ``--set SECTION.KEY=VALUE`` applied, then
    ``extra``'s, into raw/FILE_NAME."""
    base = run.repo / "benchmarks" / "gpu.toml"
    config = tomllib.loads((base if base.exists() else HERE / "benchmarks" / "gpu.toml").read_text())
    for section, name, value in [*run.args.set, *extra]:
        config.setdefault(section, {})[name] = value
    lines = []
    for section, values in config.items():
        lines.append(f"[{section}]")
        lines += [f"{name} = {json.dumps(value)}" for name, value in values.items()]
    path = run.raw / file_name
    path.write_text("\n".join(lines) + "\n")
    return path


def setting(item: str) -> tuple[str, str, object]:
    """``--set SECTION.KEY=VALUE`` parsed when the command line is, so that a typo fails the call at once, not
    after the parts before ``serve`` ran: VALUE in TOML, or a bare word as a string (``encoder.quantization=fp8``)."""
    key, equals, value = item.partition("=")
    section, dot, name = key.strip().partition(".")
    if not (equals and dot and section and name):
        raise argparse.ArgumentTypeError(f"{item!r}: write SECTION.KEY=VALUE, e.g. encoder.quantization=fp8")
    try:
        return section, name, tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        if value.strip().replace("_", "").replace("-", "").isalnum():
            return section, name, value.strip()
        raise argparse.ArgumentTypeError(f"{item!r}: VALUE is neither TOML nor a bare word") from None


def start_stack(
    run: Run, model: Path, extra: Settings = (), env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """supervisord with the repository's deploy (ops.deploy, or common.deploy before it), healthy or raise; with
    ``extra`` settings after ``--set``'s and ``env`` added to its environment."""
    if missing := missing_distributions(run):  # fail in seconds, not after the health wait
        raise RuntimeError(
            f"the stack needs {', '.join(missing)}, missing here: carry their wheels in .whl "
            f"(../shared/tools/device-wheels.sh {' '.join(missing)})"
        )
    env = {**run.env(), **(env or {}), "VLM_CONFIG": str(stack_config(run, extra)), "VLM_MODEL": str(model)}
    deploy = "ops.deploy" if (run.repo / "ops" / "deploy.py").exists() else "common.deploy"
    conf = run.repo / "run" / str(PORT) / "supervisord.conf"
    shutil.rmtree(conf.parent / "logs", ignore_errors=True)
    subprocess.run([sys.executable, "-m", deploy, str(conf)], cwd=run.repo, env=env, check=True)
    (conf.parent / "logs").mkdir(parents=True, exist_ok=True)  # (ops/serve made it before ops.deploy did)
    with open(run.raw / "supervisord.out", "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "supervisor.supervisord", "-c", str(conf)],
            cwd=run.repo,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    if not wait_healthy(f"http://127.0.0.1:{PORT}", 240, process):
        stop_stack(run, process)
        raise RuntimeError("the stack did not become healthy (see raw/ for its logs)")
    log("stack healthy")
    return process


def wait_healthy(url: str, seconds: int, process: subprocess.Popen[bytes] | None = None) -> bool:
    for _ in range(seconds):
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return True
        except OSError:
            if process is not None and process.poll() is not None:
                return False
            time.sleep(1)
    return False


def stop_stack(run: Run, process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to supervisord (it stops its programs), SIGKILL to its process group if it lingers; logs kept."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    for log_file in (run.repo / "run" / str(PORT) / "logs").glob("*.log"):
        shutil.copy(log_file, run.raw / log_file.name)


# --- parts ----------------------------------------------------------------------------------------------------


def part_tests(run: Run) -> None:
    code = run.python(
        "pytest-gpu",
        "pytest",
        "-q",
        "-m",
        "gpu",
        "-p",
        "no:cacheprovider",
        "-o",
        "faulthandler_timeout=150",
        *GPU_TESTS,
        timeout=run.args.timeout,
    )
    pytest_row(run, "pytest-gpu", code)


def pytest_row(run: Run, name: str, code: int) -> None:
    """The summary row of a pytest run logged as ``name``: its exit code and its last verdict line."""
    lines = (run.raw / f"{name}.log").read_text().strip().splitlines()
    verdict = [line for line in lines if " passed" in line or " failed" in line or " error" in line][-1:]
    run.rows.append({"name": name, "exit": code, "verdict": " ".join(verdict)})


def part_kernels(run: Run) -> None:
    run.python("kernels", "benchmarks.kernels", timeout=run.args.timeout)
    run.python(
        "kernels_prefill",
        "benchmarks.kernels_prefill",
        "--out",
        str(run.raw / "kernels_prefill.json"),
        timeout=run.args.timeout,
    )
    run.keep("kernels_prefill", run.raw / "kernels_prefill.json")
    run.python(
        "decode_gemms", "benchmarks.decode_gemms", "--out", str(run.raw / "decode_gemms.json"), timeout=run.args.timeout
    )
    run.keep("decode_gemms", run.raw / "decode_gemms.json")


def part_engine(run: Run) -> None:
    model = checkpoint(run.args)
    extra = shlex.split(run.args.engine_args)
    run.python(
        "engine",
        "benchmarks.engine",
        "--model",
        str(model),
        "--out",
        str(run.raw / "engine.json"),
        *extra,
        timeout=run.args.timeout,
    )
    run.keep("engine", run.raw / "engine.json")


def part_vision(run: Run) -> None:
    model = checkpoint(run.args)
    parts = [("vision", "benchmarks.vision"), ("vit_profile", "benchmarks.vit_profile")]
    model_type = json.loads((model / "config.json").read_text()).get("model_type")
    if model_type != "qwen2_vl":  # the profile takes Qwen2-VL's tower apart (its SDPA kernels, its blocks)
        log(f"vit_profile: skipped, it profiles Qwen2-VL's tower and the checkpoint is {model_type}")
        parts = parts[:1]
    for name, module in parts:
        run.python(
            name, module, "--model", str(model), "--out", str(run.raw / f"{name}.json"), timeout=run.args.timeout
        )
        run.keep(name, run.raw / f"{name}.json")


FP8_TESTS = [
    "tests/gpu/test_fp8_gpu.py",
    "tests/gpu/test_vision_fp8_gpu.py",
    "tests/gpu/test_fp8_engine_gpu.py",
    "tests/gpu/test_kv_fp8_gpu.py",
]


def fp8_checkpoint(args: argparse.Namespace) -> Path | None:
    """The block-wise FP8 copy of ``--family``/``--size``'s synthetic checkpoint (the same seed, so the same weights
    before quantization), generated beside it the first time; None with ``--model`` (nothing to copy from)."""
    return None if args.model else synthetic_checkpoint(args, "fp8-block")


def part_fp8(run: Run) -> None:
    """Issue 29 on the GPU, the kernels first: the FP8 GPU tests (each kernel against the dequantized reference, the
    FP8 tower's distance to bf16), the GEMMs against bf16 (`benchmarks.fp8_gemm`), the tower's images/s at 768x1024
    quantized at load against bf16 (`benchmarks.vision --quantization fp8`), and the engine (batch-1 and 32 TPOT) in
    bf16, quantized at load (`[model] quantization = "fp8"`) and on the block-wise FP8 checkpoint. The serving
    figures then come from ``serve``/``hf-parity``/``vllm`` with ``--model`` that FP8 checkpoint (its path is
    logged), ``--set model.quantization=...`` and ``--set encoder.quantization=fp8`` as the run needs."""
    code = run.python("pytest-fp8", "pytest", "-q", "-p", "no:cacheprovider", *FP8_TESTS, timeout=run.args.timeout)
    pytest_row(run, "pytest-fp8", code)
    run.python("fp8_gemm", "benchmarks.fp8_gemm", "--out", str(run.raw / "fp8_gemm.json"), timeout=run.args.timeout)
    run.keep("fp8_gemm", run.raw / "fp8_gemm.json")
    model, fp8_model = checkpoint(run.args), fp8_checkpoint(run.args)
    vision = ["--model", str(model), "--quantization", "fp8", "--sizes", "768x1024", "--skip-hf"]
    run.python(
        "vision-fp8", "benchmarks.vision", *vision, "--out", str(run.raw / "vision-fp8.json"), timeout=run.args.timeout
    )
    run.keep("vision-fp8", run.raw / "vision-fp8.json")
    engines = [("engine-bf16", model, "auto"), ("engine-fp8-at-load", model, "fp8")]
    if fp8_model is not None:
        log(f"the FP8 checkpoint for serve/hf-parity/vllm: --model {fp8_model}")
        engines.append(("engine-fp8-block", fp8_model, "auto"))
    for name, path, quantization in engines:
        out = run.raw / f"{name}.json"
        argv = ["--model", str(path), "--quantization", quantization, "--quick", "--skip-hf", "--out", str(out)]
        run.python(name, "benchmarks.engine", *argv, timeout=run.args.timeout)
        run.keep(name, out)


def part_hf(run: Run) -> None:
    model = checkpoint(run.args)
    run.python(
        "hf-seed3img",
        "benchmarks.baseline_hf",
        "--model",
        str(model),
        "--workload",
        "seed3img",
        "--batch-sizes",
        "1,8",
        "--num-requests",
        "8",
        "--seed",
        "0",
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--out",
        str(run.raw / "hf-seed3img.json"),
        timeout=run.args.timeout,
    )
    run.keep("hf-seed3img", run.raw / "hf-seed3img.json")


def part_hf_parity(run: Run) -> None:
    """transformers' bf16 answers to `benchmarks.parity`'s prompts on the checkpoint, compared with each server's
    answers recorded before (the ``parity`` workload of ``serve``, ``units`` and ``vllm``) within
    ``--parity-tolerance``."""
    reference = run.raw / "hf-parity.json"
    argv = ["reference", "--model", str(checkpoint(run.args)), "--out", str(reference), "--device", run.args.hf_device]
    if run.python("hf-parity", "benchmarks.parity", *argv, timeout=run.args.timeout, cwd=HERE):
        run.rows.append({"name": "hf-parity", "failed": "benchmarks.parity reference (raw/hf-parity.log)"})
        return
    shutil.copy(reference, run.out / "hf-parity.json")
    recorded = [path for path in sorted(run.raw.glob("*parity.json")) if path != reference]
    for answers in recorded:
        server = answers.name.removesuffix("parity.json")  # "", "vllm-", "units-2enc-"
        name = f"{server}parity-vs-hf"
        verdict = run.raw / f"{name}.json"
        argv = ["compare", str(reference), str(answers), "--tolerance", str(run.args.parity_tolerance)]
        code = run.python(name, "benchmarks.parity", *argv, "--out", str(verdict), timeout=120, cwd=HERE)
        shutil.copy(answers, run.out / answers.name)
        if verdict.exists():
            shutil.copy(verdict, run.out / verdict.name)
        lines = (run.raw / f"{name}.log").read_text().strip().splitlines()
        run.rows.append({"name": name, "exit": code, "verdict": lines[-1] if lines else ""})
    if not recorded:
        note = "no server answers to compare: run serve, units or vllm with parity first"
        run.rows.append({"name": "hf-parity", "note": note})


def workload_argv(workload: str, clients: int, requests: int | None, prefix: str = "") -> list[tuple[str, list[str]]]:
    """(name, `benchmarks.serve` arguments) of one workload at ``clients``. Each has a seed of its own: workloads
    with one seed share images and prompts, and would hit the prefix cache a previous one filled. ``prefix``: the
    names' (a run that another of the same workload names, as ``structured``'s control names its pair)."""
    anchor = ["--image-size", "768x1024", "--max-tokens-spread", "0"]  # ANCHORS' vLLM rows exactly
    one = clients == 1
    if workload == "seed3img":
        return [
            (
                f"seed3img-c{clients}",
                [
                    "--workload",
                    "seed3img",
                    "--concurrency",
                    str(clients),
                    "--num-requests",
                    str(requests or (8 if one else 2 * clients)),
                    "--seed",
                    "4" if one else "0",
                ],
            )
        ]
    if workload == "seed3img-anchor":
        return [
            (
                f"seed3img-anchor-c{clients}",
                [
                    "--workload",
                    "seed3img",
                    "--concurrency",
                    str(clients),
                    "--num-requests",
                    str(requests or 2 * clients),
                    "--seed",
                    "3",
                    *anchor,
                ],
            )
        ]
    if workload == "multiturn":
        return [
            (
                f"multiturn-c{clients}",
                [
                    "--workload",
                    "multiturn",
                    "--concurrency",
                    str(clients),
                    "--num-requests",
                    str(requests or clients),
                    "--seed",
                    "5",
                ],
            )
        ]
    if workload == "text":
        return [
            (
                f"text-c{clients}",
                [
                    "--workload",
                    "text",
                    "--concurrency",
                    str(clients),
                    "--num-requests",
                    str(requests or 2 * clients),
                    "--seed",
                    "6",
                ],
            )
        ]
    if workload == "structured":
        structured = ["--workload", "structured", "--concurrency", str(clients), "--num-requests"]
        structured.append(str(requests or 8 * clients))
        return [
            (f"structured-c{clients}", [*structured, "--seed", "7"]),
            (
                f"structured-control-c{clients}",
                # the same prompts' lengths at the same cadence, only without the grammar: see benchmarks.serve
                [
                    *structured,
                    "--seed",
                    "8",
                    "--constrained-share",
                    "0",
                    "--paired-with",
                    f"{prefix}structured-c{clients}.json",
                ],
            ),
        ]
    if workload != "mixed":
        raise ValueError(f"{workload} is not a benchmarks.serve workload ({', '.join(SERVE_WORKLOADS)})")
    mixed = [
        "--workload",
        "mixed",
        "--concurrency",
        str(clients),
        "--vision-rate",
        "6",
        "--num-requests",
        str(requests or 60),
        *anchor,
    ]
    return [
        (f"mixed-c{clients}", [*mixed, "--seed", "1"]),
        (f"mixed-text-only-c{clients}", [*mixed, "--seed", "2", "--vision-off"]),
    ]


def run_workloads(run: Run, url: str, prefix: str = "") -> None:
    """Every ``--workloads`` at every ``--clients`` against ``url``, with the client of this checkout."""
    for workload in run.args.workloads:
        if workload == "vllm-bench":
            for clients in run.args.clients:
                vllm_bench(run, url, f"{prefix}vllm-bench-c{clients}", clients)
            continue
        if workload == "parity":
            path = run.raw / f"{prefix}parity.json"
            run.python(
                f"{prefix}parity",
                "benchmarks.parity",
                "record",
                "--url",
                url,
                "--out",
                str(path),
                timeout=300,
                cwd=HERE,
            )
            continue
        for clients in run.args.clients:
            for name, argv in workload_argv(workload, clients, run.args.requests, prefix):
                name = prefix + name
                with open(run.raw / f"{name}.dmon", "w") as trace:  # power, utilisation, clocks, memory
                    dmon = gpu_trace(trace)
                    run.python(
                        name,
                        "benchmarks.serve",
                        "--url",
                        url,
                        "--time-limit",
                        str(run.args.time_limit),
                        "--out",
                        str(run.raw / f"{name}.json"),
                        *argv,
                        *shlex.split(run.args.client_args),
                        timeout=run.args.time_limit + 60,
                        cwd=HERE,
                    )
                    if dmon is not None:
                        dmon.terminate()
                save_metrics(url, run.raw / f"{name}.metrics")
                run.keep(name, run.raw / f"{name}.json")


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
        return json.load(response)["data"][0]["id"]


def vllm_bench(run: Run, url: str, name: str, clients: int) -> None:
    """vLLM's own client (`vllm bench serve`, from the carried peer) against ``url``: ANCHORS' 3 x 768x1024
    images, 120 output tokens, ``ignore_eos``; the same arguments whichever server it measures."""
    requests = run.args.requests or 4 * clients
    bench = [
        "vllm_bench", "--base-url", url, "--model", served_model(url), "--tokenizer", str(checkpoint(run.args)),
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--dataset-name", "random-mm",
        "--random-input-len", "100", "--random-output-len", "120", "--random-range-ratio", "0",
        "--random-mm-base-items-per-request", "3", "--random-mm-num-mm-items-range-ratio", "0",
        "--random-mm-limit-mm-per-prompt", '{"image":3,"video":0}',
        "--random-mm-bucket-config", "{(768,1024,1):1.0}", "--ignore-eos",
        "--max-concurrency", str(clients), "--num-prompts", str(requests),
        "--save-result", "--result-dir", str(run.raw), "--result-filename", f"{name}.json",
    ]  # fmt: skip
    script = f"source {shlex.quote(peer_script(run))} && {shlex.join(bench)}"
    log(f"{name}: {shlex.join(bench)}")
    with open(run.raw / f"{name}.log", "w") as out:
        code = subprocess.run(
            ["bash", "-c", script], cwd=HERE, stdout=out, stderr=subprocess.STDOUT, timeout=run.args.time_limit + 120
        ).returncode
    if code:
        log(f"{name}: exit {code}")
    run.keep(name, run.raw / f"{name}.json")


def gpu_trace(trace: IO[str]) -> subprocess.Popen[bytes] | None:
    """`nvidia-smi dmon` samples into ``trace`` while a workload runs (none off a GPU host)."""
    if shutil.which("nvidia-smi") is None:
        return None
    return subprocess.Popen(["nvidia-smi", "dmon", "-s", "pucm", "-d", "2"], stdout=trace, stderr=subprocess.DEVNULL)


def save_metrics(url: str, path: Path) -> None:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            path.write_bytes(response.read())
    except OSError:
        pass  # vLLM's and ours differ; neither is a figure of the run


def part_serve(run: Run) -> None:
    if run.args.url:
        run_workloads(run, run.args.url)
        return
    venv_wrapper(run.repo)
    process = start_stack(run, checkpoint(run.args))
    try:
        run_workloads(run, f"http://127.0.0.1:{PORT}")
    finally:
        stop_stack(run, process)


def part_units(run: Run) -> None:
    """Issue 31's split (`benchmarks.units`): for each plan, the encoder unit on its GPUs and the pd unit on GPU 0,
    over loopback tcp:// + CurveZMQ, the ``--workloads`` at each ``--clients`` named ``units-Kenc-...``."""
    venv_wrapper(run.repo)
    keys = run.raw / "keys"
    if not (keys / "public").is_dir() and run.python("keys", "ops.cli", "keys", "--dir", str(keys), timeout=60):
        raise RuntimeError("ops.cli keys failed (raw/keys.log)")
    secured = [("security", "keys_dir", str(keys))]
    model = checkpoint(run.args)
    for plan in plans(gpu_count(Config(), os.environ)):
        log(f"units: pd on GPU {plan.visible_devices('pd')}, encoders on GPU {plan.visible_devices('encoder')}")
        units_run(run, plan, model, secured)


def units_run(run: Run, plan: UnitsPlan, model: Path, secured: Settings) -> None:
    config = stack_config(run, [*plan.settings("encoder"), *secured], file_name=f"{plan.prefix}encoder-unit.toml")
    env = {**run.env(), "VLM_MODEL": str(model), "CUDA_VISIBLE_DEVICES": plan.visible_devices("encoder")}
    encoders = EncoderUnit(run.repo, config, run.repo / "run" / "encoder-unit", env, len(plan.encoder_gpus))
    try:
        encoders.start(logs_to=run.raw / f"{plan.prefix}encoder-unit")
        pd_env = {"CUDA_VISIBLE_DEVICES": plan.visible_devices("pd")}
        process = start_stack(run, model, [*plan.settings("pd"), *secured], pd_env)
        try:
            run_workloads(run, f"http://127.0.0.1:{PORT}", prefix=plan.prefix)
        finally:
            stop_stack(run, process)
    finally:
        encoders.stop()


def peer_script(run: Run) -> str:
    return str((HERE / run.args.peer_dir / "device.sh").resolve())


PEER_SITE = Path(tempfile.gettempdir()) / "vllm-peer" / "site"  # where vllm-peer's device.sh unpacks vLLM
PEER_EXTRA_WHEELS = HERE / ".peer4"  # small wheels carried beside vLLM (its setup installs them on a fresh box)

# vLLM 0.22 resolves any quantization config (an FP8 checkpoint's) through a registry that imports every method's
# module, and its `humming` module imports the optional `humming` package (not on PyPI) whenever CUDA is present:
# without it vLLM cannot load a quantized checkpoint at all. Its own `fp8` method never calls humming, so an inert
# stand-in that only satisfies those imports lets vLLM serve FP8 as it would with humming installed.
HUMMING_MODULES = ("dtypes", "config", "layer", "schema", "utils/__init__", "utils/weight")
HUMMING_STUB = '''"""An inert stand-in for the optional `humming` package, written by benchmarks.gpu (vllm part)."""


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("humming is not installed: an inert stub stands in so that vLLM can import")


def __getattr__(name):
    return type(name, (_Unavailable,), {})
'''


def peer_quantization_imports(site: Path) -> None:
    """What vLLM needs to read a quantization config, where the peer's site lacks it: the carried extra wheels
    (loguru, which compressed-tensors imports) and the humming stand-in (logged when written)."""
    for wheel in sorted(PEER_EXTRA_WHEELS.glob("*.whl")):
        distribution = wheel.name.split("-")[0].lower()
        if not any(site.glob(f"{distribution}-*.dist-info")):
            command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
            subprocess.run([*command, "--target", str(site), str(wheel)], check=True)
    if not (site / "humming").exists():
        log(f"vLLM: writing an inert `humming` stand-in into {site} (vLLM 0.22 imports it for any quantized model)")
        write_humming_stub(site)


def write_humming_stub(site: Path) -> None:
    package = site / "humming"
    (package / "utils").mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text('"""An inert stand-in for the optional `humming` package."""\n')
    for module in HUMMING_MODULES:
        (package / f"{module}.py").write_text(HUMMING_STUB)


def part_vllm(run: Run) -> None:
    """vLLM on the same checkpoint, the same workloads and client; one server at a time."""
    subprocess.run(["bash", peer_script(run), "setup"], cwd=HERE, check=True)
    peer_quantization_imports(PEER_SITE)
    model = checkpoint(run.args)
    start = f"source {shlex.quote(peer_script(run))} && vllm_start {shlex.quote(str(model))} {PEER_PORT} && wait"
    # On Hopper vLLM 0.22 serves block FP8 through DeepGEMM, whose kernels it JIT-compiles at start-up for longer
    # than a device call lasts; without it, its CUTLASS block-scaled GEMM (no warm-up). The caller's value wins.
    env = {"VLLM_USE_DEEP_GEMM": "0", **os.environ}
    log(f"vLLM: VLLM_USE_DEEP_GEMM={env['VLLM_USE_DEEP_GEMM']}")
    with open(run.raw / "vllm.log", "w") as out:
        server = subprocess.Popen(
            ["bash", "-c", start], cwd=HERE, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        if not wait_healthy(f"http://127.0.0.1:{PEER_PORT}", 420, server):
            raise RuntimeError("vLLM did not start (raw/vllm.log)")
        run_workloads(run, f"http://127.0.0.1:{PEER_PORT}", prefix="vllm-")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait()


# The GPU soak (issue 30, acceptance 2) and overload (acceptance 3): seed3img-sized traffic, full-size images.
SOAK_ARGS = ("--image-scale", "1", "--max-tokens", "120", "--prompt-tokens", "1000", "--concurrency", "32")


def part_soak(run: Run, name: str, argv: list[str]) -> None:
    """`benchmarks.soak` on the checkpoint (its own stack under supervisord, its logs into raw/NAME-stack/logs),
    within the time its own plan needs (`soak_time_bound`) rather than ``--timeout``; the JSON without its requests
    and samples, and the plot, beside the summaries (the whole JSON in raw/)."""
    if missing := missing_distributions(run):  # fail in seconds, not after the health wait
        raise RuntimeError(f"the stack needs {', '.join(missing)}, missing here: carry their wheels in .whl")
    venv_wrapper(run.repo)  # (ops/vlm.conf's programs run .venv/bin/python)
    model = checkpoint(run.args)
    raw = run.raw / f"{name}.json"
    argv = ["--model", str(model), "--stack-dir", str(run.raw / f"{name}-stack"), *SOAK_ARGS, *argv, "--out", str(raw)]
    run.python(name, "benchmarks.soak", *argv, timeout=soak_time_bound(run, argv))
    if not raw.exists():
        run.rows.append({"name": name, "missing": True})
        return
    data = load_json(raw)
    kept = {k: v for k, v in data.items() if k not in ("requests", "samples")}  # type: ignore[union-attr]
    (run.out / f"{name}.json").write_text(json.dumps(kept, indent=1, default=str) + "\n")
    shutil.copy(raw.with_suffix(".png"), run.out / f"{name}.png")
    run.rows.append({"name": name, "ok": kept["verdict"]["ok"], "reasons": "; ".join(kept["verdict"]["reasons"])})


def soak_time_bound(run: Run, argv: list[str]) -> int:
    """The longest `benchmarks.soak` with ``argv`` may take (its ``--time-bound``: the stack's start, the traffic,
    the drain, the stop, every wait at its limit)."""
    bound = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", *argv, "--time-bound"],
        cwd=run.repo,
        env=run.env(),
        capture_output=True,
        text=True,
        check=True,
    )
    return int(bound.stdout.strip())


def part_grammar(run: Run) -> None:
    """`benchmarks.grammar_cost` with this Python (llguidance), then with vLLM's where its peer is carried and set
    up (its llguidance and xgrammar), on the checkpoint's tokenizer."""
    model = checkpoint(run.args)
    out = run.raw / "grammar_cost.json"
    extra = shlex.split(run.args.grammar_args)
    argv = ["--checkpoint", str(model), "--out", str(out), *extra]
    run.python("grammar_cost", "benchmarks.grammar_cost", *argv, timeout=run.args.timeout, cwd=HERE)
    run.keep("grammar_cost", out)
    if not Path(peer_script(run)).exists():
        run.rows.append({"name": "vllm-grammar_cost", "note": f"no vLLM peer at {run.args.peer_dir}"})
        return
    setup = subprocess.run(["bash", peer_script(run), "setup"], cwd=HERE, capture_output=True, text=True)
    if setup.returncode:
        run.rows.append({"name": "vllm-grammar_cost", "note": f"the peer is not set up: {setup.stdout[-300:]}"})
        return
    out = run.raw / "vllm-grammar_cost.json"
    command = ["python3", "-m", "benchmarks.grammar_cost", "--checkpoint", str(model), "--out", str(out), *extra]
    script = f'source {shlex.quote(peer_script(run))} && PYTHONPATH="$P/site:{HERE}" {shlex.join(command)}'
    log(f"vllm-grammar_cost: {script}")
    with open(run.raw / "vllm-grammar_cost.log", "w") as log_file:
        try:
            code = subprocess.run(
                ["bash", "-c", script], cwd=HERE, stdout=log_file, stderr=subprocess.STDOUT, timeout=run.args.timeout
            ).returncode
        except subprocess.TimeoutExpired:
            code = 124
    if code:
        log(f"vllm-grammar_cost: exit {code}")
    run.keep("vllm-grammar_cost", out)


def part_vllm_copy(run: Run, number: int) -> None:
    subprocess.run(["bash", peer_script(run), "part", str(number)], cwd=HERE, check=True)


# --- the record -----------------------------------------------------------------------------------------------


def write_record(run: Run, info: dict[str, Any]) -> None:
    """machine.json and summary.md: the command, machine, revision, date and a table of what the parts wrote; a
    result folder used again by a later call (``hf-parity`` after ``serve``) keeps the earlier calls' sections."""
    (run.out / "machine.json").write_text(json.dumps(info, indent=1) + "\n")
    calls = [*run.earlier_calls, {"info": info, "rows": run.rows}]
    (run.out / "calls.json").write_text(json.dumps(calls, indent=1) + "\n")
    lines = [f"# {run.out.name}", ""]
    for call in calls:
        done, rows = call["info"], call["rows"]
        lines += [
            f"Command: `{done['command']}`",
            "",
            f"Machine: {done['gpu']}; {done['software']}. "
            f"Revision {done['revision']} ({done['repo']}), {done['date']}.",
            "",
            "| run | figures |",
            "| --- | --- |",
        ]
        lines += [f"| {row['name']} | {json.dumps({k: v for k, v in row.items() if k != 'name'})} |" for row in rows]
        lines.append("")
    (run.out / "summary.md").write_text("\n".join(lines))


def ship(result_dir: Path, ship_dir: Path | None) -> None:
    if ship_dir is not None:
        ship_dir.mkdir(parents=True, exist_ok=True)
        with tarfile.open(ship_dir / "results.tgz", "w:gz") as archive:
            archive.add(result_dir, arcname=result_dir.name)


def run_part(run: Run, part: str) -> None:
    runners = {
        "tests": part_tests,
        "kernels": part_kernels,
        "engine": part_engine,
        "vision": part_vision,
        "serve": part_serve,
        "units": part_units,
        "hf": part_hf,
        "hf-parity": part_hf_parity,
        "vllm": part_vllm,
        "vllm-part1": lambda r: part_vllm_copy(r, 1),
        "vllm-part2": lambda r: part_vllm_copy(r, 2),
        "grammar": part_grammar,
        "fp8": part_fp8,
        "soak": lambda r: part_soak(r, "soak", ["--duration", str(r.args.soak_s), "--chaos-every", "45"]),
        # (at the defaults, as every part: shedding at max_queue_wait_s 5 s; `--set server.max_queue_wait_s=S` else)
        "overload": lambda r: part_soak(r, "overload", ["--burst", "--burst-workload", "seed3img"]),
    }
    try:
        runners[part](run)
    except (RuntimeError, subprocess.CalledProcessError, OSError) as error:  # the next part still runs
        log(f"{part} failed: {error}")
        run.rows.append({"name": part, "failed": str(error)})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parts", nargs="+", choices=PARTS)
    p.add_argument("--result-dir", type=Path, required=True, help="where summaries (and raw/) go")
    p.add_argument(
        "--repo",
        type=Path,
        action="append",
        help="a checkout to run the parts against (repeat: side "
        "by side, each into RESULT_DIR/<its folder name>); default: this one",
    )
    p.add_argument(
        "--rev",
        help="this checkout's revision to record (its git metadata may lag on the device); "
        "another checkout's comes from its .revision file",
    )
    p.add_argument("--model", type=Path, help="a checkpoint (default: the synthetic one of --family and --size)")
    p.add_argument(
        "--family", default="qwen2_vl", choices=SUPPORTED_MODEL_TYPES, help="the synthetic checkpoint's model_type"
    )
    p.add_argument(
        "--size", default="2b", help="the synthetic checkpoint's shape (workers.models.synth: 2b, 7b, 3b, 8b...)"
    )
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=Path("/tmp/vlm-checkpoints"),
        help="where synthetic checkpoints are generated once and kept for later parts and calls",
    )
    p.add_argument(
        "--parity-tolerance",
        type=float,
        default=PARITY_TOLERANCE,
        help="hf-parity: nats (the bound used for Qwen2-VL)",
    )
    p.add_argument("--hf-device", default="cuda", help="hf-parity: transformers' device (cpu: fp32, for the tests)")
    p.add_argument(
        "--workloads",
        type=lambda s: s.split(","),
        default=["seed3img"],
        help=f"serve/vllm: a comma list of {', '.join(WORKLOADS)}",
    )
    p.add_argument(
        "--clients",
        type=lambda s: [int(c) for c in s.split(",")],
        default=[32],
        help="serve/vllm: concurrency (text streams for mixed), a comma list",
    )
    p.add_argument("--requests", type=int, help="serve/vllm: requests per workload (default: per workload)")
    p.add_argument("--time-limit", type=int, default=90, help="serve/vllm: seconds one workload may run")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        type=setting,
        metavar="SECTION.KEY=VALUE",
        help="serve: a setting over benchmarks/gpu.toml, in TOML or a bare word (--set encoder.quantization=fp8)",
    )
    p.add_argument("--url", help="serve: a server already running; no stack is started")
    p.add_argument("--client-args", default="", help="serve/vllm: more arguments for benchmarks.serve (--small)")
    p.add_argument("--engine-args", default="", help="engine: more arguments for benchmarks.engine, one string")
    p.add_argument(
        "--grammar-args", default="", help="grammar: more arguments for benchmarks.grammar_cost (ours and the peer's)"
    )
    p.add_argument("--peer-dir", type=Path, default=Path(".vllm-peer"), help="vllm: the copy of vllm-peer/")
    p.add_argument(
        "--timeout",
        type=int,
        default=300,
        help="seconds each tool of a part may take (then SIGTERM, SIGKILL 90 s later); not soak and overload, whose "
        "limit is what their plan needs (benchmarks.soak --time-bound)",
    )
    p.add_argument(
        "--soak-s",
        type=int,
        default=480,
        help="the soak part's seconds of traffic; the part takes about this plus 2 minutes (the 7B stack's start, "
        "drain, stop), so 480 needs a device call of about 10 to 11 minutes",
    )
    p.add_argument("--ship", type=Path, help="pack the result folder into SHIP/results.tgz after every part")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    install_wheels()
    repos = [r.resolve() for r in args.repo or [HERE]]
    result_dir = args.result_dir.resolve()
    runs = [Run(repo, result_dir / repo.name if len(repos) > 1 else result_dir, args) for repo in repos]
    for run in runs:
        run.raw.mkdir(parents=True, exist_ok=True)
        if (run.out / "calls.json").exists():
            run.earlier_calls = json.loads((run.out / "calls.json").read_text())
    for part in args.parts:
        for run in runs:  # part by part, the checkouts alternating: the same machine state for both
            log(f"{part} on {run.repo}")
            run_part(run, part)
            write_record(run, machine(run))
            ship(result_dir, args.ship)


if __name__ == "__main__":
    main()
