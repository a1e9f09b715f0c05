"""When the Triton kernels run, and how.

Importing this module never imports triton; `triton_available` tells whether it can be. Triton decides
once, when it is imported, whether ``@triton.jit`` compiles or interprets: with ``TRITON_INTERPRET=1`` in
the environment at that moment every kernel (and triton.language's own helpers) runs in the interpreter,
on the host, and can take CPU tensors. That is how the kernels are checked without a GPU.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the dispatching entry points should launch Triton: CUDA tensors and triton importable."""
    return all(t.is_cuda for t in tensors) and triton_available()


def interpreted() -> bool:
    """Whether triton was imported under TRITON_INTERPRET=1 (the variable may have changed since)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.cdiv, InterpretedFunction)


def check_launchable(device: torch.device) -> None:
    """RuntimeError where a launch could only fail deep inside triton with a less helpful message."""
    if device.type != "cuda" and not interpreted():
        raise RuntimeError(
            f"Triton kernels take {device} tensors only in the interpreter: set TRITON_INTERPRET=1 before triton "
            "is first imported"
        )


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
