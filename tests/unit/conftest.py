"""``VLM_TEST_SHARD=i/n``: run only every n-th collected test, starting at the i-th (0-based); the rest are
deselected. `test_kernels.test_interpreter_in_subprocess` runs its module in n such processes at once: under
Triton's interpreter it is CPU-bound, one core per process.

``SLOW`` marks the unit tests that ``./ops/test --fast`` leaves out (``-m "not slow"``)."""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

import pytest

# The unit tests that take seconds each, as patterns of their ids below tests/unit: child processes (tensor-parallel
# ranks, Triton's interpreter, a stalled loop, an encoder over its socket), whole-engine parity and benchmark runs,
# ONNX exports, the largest images. The rest is the fast tier; the full run (./ops/test) runs them all.
SLOW = (
    "test_kernels.py::test_interpreter_in_subprocess",
    "test_tensor_parallel.py::*",
    "test_engine.py::test_steps_staged_ahead_of_prefills_and_arrivals_emit_what_synchronous_steps_do*",
    "test_engine.py::test_overlapped_steps_emit_exactly_what_synchronous_steps_do*",
    "test_engine.py::test_seeded_sampling_reproduces*",
    "test_engine_mixed_bench.py::*",
    "test_gateway_load_bench.py::*",
    "test_encoder_batching.py::test_the_worker_batches_queued_jobs_over_its_socket*",
    "test_onnx_backend.py::*",
    "test_vision_backends.py::test_onnxruntime_backend_matches_the_torch_tower_and_exports_once",
    "test_stall_watchdog.py::*",
    "test_image_preprocess.py::*h3000_w4000*",
    "test_gateway_without_torch.py::*",
    "test_decoder_start_imports.py::*",
)
HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent == HERE and any(fnmatch.fnmatchcase(item.nodeid.split("/")[-1], p) for p in SLOW):
            item.add_marker(pytest.mark.slow)
    shard = os.environ.get("VLM_TEST_SHARD")
    if not shard:
        return
    index, count = (int(part) for part in shard.split("/"))
    kept = [item for k, item in enumerate(items) if k % count == index]
    config.hook.pytest_deselected(items=[item for k, item in enumerate(items) if k % count != index])
    items[:] = kept
