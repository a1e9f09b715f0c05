"""How the kernel tests get Triton: compiled on a GPU (tests/gpu) or in its interpreter on the CPU (tests/unit).
Nothing here imports triton at module level: which of the two a process gets is decided by its first import."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from workers.kernels._launch import triton_available


def compiled_kernels_skip_reason() -> str | None:
    """Why the compiled-kernel tests cannot run in this process (None: they can)."""
    # Order matters: importing triton on a machine without CUDA would stop the unit tests collected later in the
    # same process from importing it under the interpreter.
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if not triton_available():
        return "triton is not installed"
    from workers.kernels._launch import interpreted

    if os.environ.get("TRITON_INTERPRET") == "1" or interpreted():
        return "TRITON_INTERPRET=1 makes every kernel run in the interpreter: run tests/gpu without it"
    return None


FP8_INTERPRETER_CHILD = "VLM_FP8_INTERPRETER_CHILD"  # set in the child process the FP8 kernel tests run in


def interpreted_in_child(child_env: str, kernels_module: str) -> bool:
    """Import ``kernels_module`` (and so triton) under TRITON_INTERPRET=1 where this process still can: it is the
    child process a test started with ``child_env`` = 1, and nothing has imported triton yet."""
    if importlib.util.find_spec("triton") is None or os.environ.get(child_env) != "1" or "triton" in sys.modules:
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    importlib.import_module(kernels_module)
    from workers.kernels._launch import interpreted

    if interpreted():
        fix_interpreter_scalar_index()
    return interpreted()


def fix_interpreter_scalar_index() -> None:
    """Let `range(scalar tensor)` work in the interpreter of triton < 3.7 under numpy >= 2.4.

    The interpreter holds scalars as 1-element arrays and converts them with int(), which numpy 2.4 refuses
    for arrays that are not 0-d (triton-lang/triton#9171, fixed upstream by squeezing first). The kernels'
    loops have tensor bounds, so without this every kernel with a loop fails in the interpreter only.
    """
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "scalar_index_fixed", False):
        return

    def patched(tensor: object, scope: interpreter._LangPatchScope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.scalar_index_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


def run_sharded(test_file: str, env: Mapping[str, str], *pytest_args: str) -> None:
    """Run ``test_file`` under pytest in processes of their own with ``env`` added, one per core (up to 4), each
    taking every n-th selected test (``VLM_TEST_SHARD``, tests/unit/conftest.py): under Triton's interpreter a test
    is CPU-bound on one core. Fails unless every process passed with nothing skipped (the kernels ran) and all of
    them collected the same tests (so each selected test ran in exactly one)."""
    shards = max(1, min(4, len(os.sched_getaffinity(0))))
    command = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", "-x", *pytest_args]
    runs = [
        subprocess.Popen(
            command,
            env={**os.environ, **env, "VLM_TEST_SHARD": f"{k}/{shards}"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        for k in range(shards)
    ]
    try:  # (a bound for a hang, not a speed check)
        outputs = [run.communicate(timeout=600) for run in runs]
    finally:
        for run in runs:
            run.kill()  # (a no-op for those that ended)
    totals = set()
    for run, (stdout, stderr) in zip(runs, outputs, strict=True):
        tail = "\n".join(stdout.splitlines()[-15:])
        assert run.returncode == 0, tail + stderr[-3000:]
        found = {word: int(n) for n, word in re.findall(r"(\d+) (passed|skipped|deselected)", tail.splitlines()[-1])}
        assert not found.get("skipped") and found.get("passed"), tail
        totals.add(found["passed"] + found.get("deselected", 0))
    assert len(totals) == 1, f"the processes collected different tests: {totals}"
