"""``vlm-serve``, the console script: pyproject names it, it imports, and every option has help text."""

from __future__ import annotations

import argparse
import importlib
import tomllib
from pathlib import Path

import pytest

from ops import cli

REPO = Path(__file__).resolve().parents[2]


def test_the_console_script_is_ops_cli_main() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["vlm-serve"] == "ops.cli:main"
    module, _, name = scripts["vlm-serve"].partition(":")
    assert callable(getattr(importlib.import_module(module), name))


def subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_of_every_subcommand_has_help() -> None:
    assert set(subcommands()) == {"serve", "config"}
    for name, sub in subcommands().items():
        for action in sub._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, f"vlm-serve {name}: {action.dest} has no help text"


@pytest.mark.parametrize("command", ["serve", "config"])
def test_help_exits_cleanly(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main([command, "--help"])
    assert stopped.value.code == 0
    assert f"usage: vlm-serve {command}" in capsys.readouterr().out


def test_serve_options_become_the_stacks_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What serve hands the stack: the VLM_* variables every process reads, then the rendered configuration."""
    for variable in cli.SERVE_ENV.values():  # (set first, so that monkeypatch restores what serve sets)
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)
    config = tmp_path / "vlm.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\n')
    seen: dict[str, object] = {}

    def write(cfg: object, out: Path) -> None:
        seen["cfg"], seen["out"] = cfg, out
        raise ValueError("stopped before supervisord")

    monkeypatch.setattr(cli, "write_supervisord_conf", write)
    with pytest.raises(SystemExit, match="vlm-serve: stopped before supervisord"):
        cli.main(["serve", str(tmp_path / "model"), "--host", "0.0.0.0", "--port", "8123", "--config", str(config)])
    cfg = seen["cfg"]
    assert cfg.model.path == str(tmp_path / "model") and cfg.server.host == "0.0.0.0"  # type: ignore[attr-defined]
    assert cfg.server.port == 8123 and cfg.source == str(config)  # type: ignore[attr-defined]
    assert seen["out"] == tmp_path / "run" / "supervisord.conf"
