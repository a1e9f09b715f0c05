"""``VLM_TEST_SHARD=i/n``: run only every n-th collected test, starting at the i-th (0-based); the rest are
deselected. `test_kernels.test_interpreter_in_subprocess` runs its module in n such processes at once: under
Triton's interpreter it is CPU-bound, one core per process."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shard = os.environ.get("VLM_TEST_SHARD")
    if not shard:
        return
    index, count = (int(part) for part in shard.split("/"))
    kept = [item for k, item in enumerate(items) if k % count == index]
    config.hook.pytest_deselected(items=[item for k, item in enumerate(items) if k % count != index])
    items[:] = kept
