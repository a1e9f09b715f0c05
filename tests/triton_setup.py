"""How the kernel tests get Triton: compiled on a GPU (tests/gpu) or in its interpreter on the CPU (tests/unit).
Nothing here imports triton at module level: which of the two a process gets is decided by its first import."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

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
