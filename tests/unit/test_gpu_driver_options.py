"""benchmarks.gpu's command line and the vLLM peer's quantization imports, without a GPU."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu import setting, write_humming_stub


def test_a_setting_takes_toml_or_a_bare_word() -> None:
    assert setting("encoder.mps=true") == ("encoder", "mps", True)
    assert setting("server.max_queue_wait_s=2.5") == ("server", "max_queue_wait_s", 2.5)
    assert setting('encoder.quantization="fp8"') == ("encoder", "quantization", "fp8")
    assert setting("encoder.quantization=fp8") == ("encoder", "quantization", "fp8")
    assert setting("model.quantization=fp8-block") == ("model", "quantization", "fp8-block")


@pytest.mark.parametrize("bad", ["encoder.quantization", "quantization=fp8", ".x=1", "a.b=two words", "a.b=[1,"])
def test_a_malformed_setting_fails_when_the_command_line_is_read(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"SECTION\.KEY=VALUE|neither TOML nor a bare word"):
        setting(bad)


def test_the_humming_stand_in_satisfies_vllms_imports_and_refuses_use(tmp_path: Path) -> None:
    """The imports vLLM 0.22's quantization/humming.py and fused_humming_moe.py make at module level."""
    write_humming_stub(tmp_path)
    script = """
from humming import dtypes
from humming.config import GemmType
from humming.dtypes import DataType
from humming.layer import HummingInputSchema, HummingLayerMeta, HummingMethod
from humming.schema import BaseInputSchema, BaseWeightSchema, HummingWeightSchema
from humming.utils.weight import quantize_weight
class Subclass(HummingMethod):
    pass
try:
    DataType()
except RuntimeError as error:
    print("refused:", error)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], env={"PYTHONPATH": str(tmp_path)}, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "refused: humming is not installed" in result.stdout
