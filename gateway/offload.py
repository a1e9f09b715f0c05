"""Work proportional to a request's size, kept off the gateway's event loop when the request is large: on
the loop, every stream's next token waits for it (parsing a body of many megabytes, or encoding one, takes
tens of milliseconds: docs/performance.md)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

A = TypeVar("A")
R = TypeVar("R")

OFF_LOOP_BYTES = 1 << 20  # below this, on the loop: cheaper than the hop to a thread


async def off_loop_if_large(size: int, fn: Callable[[A], R], arg: A) -> R:
    """``fn(arg)``, in a worker thread when ``size`` (the bytes it works through) is ``OFF_LOOP_BYTES`` or more."""
    if size < OFF_LOOP_BYTES:
        return fn(arg)
    return await asyncio.get_running_loop().run_in_executor(None, fn, arg)
