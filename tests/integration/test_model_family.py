"""A checkpoint of a model type the server does not implement stops start-up with one clear message: the launcher
before it starts supervisord, and each process started alone, naming the type found and the supported types."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gateway_load import free_port
from common.model_files import SUPPORTED_MODEL_TYPES
from tests.integration.conftest import REPO, stack_config


def llava_checkpoint(root: Path) -> Path:
    """A checkpoint directory whose every file is there, of model_type "llava"."""
    root.mkdir()
    config = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"]}
    (root / "config.json").write_text(json.dumps(config))
    (root / "preprocessor_config.json").write_text("{}")
    (root / "tokenizer.json").write_text("{}")
    (root / "model.safetensors").write_bytes(b"")
    return root


def assert_names_the_types(output: str) -> None:
    assert "model_type 'llava'" in output, output
    assert "supported model types: " + ", ".join(SUPPORTED_MODEL_TYPES) in output, output


@pytest.fixture
def settings(tmp_path: Path) -> Path:
    config = stack_config(tmp_path, free_port())
    config.write_text(f'run_dir = "{tmp_path / "run"}"\n' + config.read_text())
    return config


def test_serve_refuses_an_unsupported_model_type_before_supervisord(tmp_path: Path, settings: Path) -> None:
    model = llava_checkpoint(tmp_path / "llava")
    command = [sys.executable, "-m", "ops.cli", "serve", str(model), "--config", str(settings)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert_names_the_types(done.stderr)
    assert not (tmp_path / "run" / "supervisord.conf").exists()  # stopped before supervisord was started


@pytest.mark.parametrize("module", ["gateway", "workers.fetcher", "workers.encoder", "workers.decoder"])
def test_each_process_started_alone_refuses_it(tmp_path: Path, settings: Path, module: str) -> None:
    model = llava_checkpoint(tmp_path / "llava")
    env = {**os.environ, "VLM_MODEL": str(model)}
    command = [sys.executable, "-m", module, "--config", str(settings)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert_names_the_types(done.stderr)
