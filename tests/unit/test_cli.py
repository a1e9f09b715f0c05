"""``vlm-serve``, the console script: pyproject names it, it imports, and every option has help text."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
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
    assert set(subcommands()) == {"serve", "config", "keys", "render-k8s"}
    for name, sub in subcommands().items():
        for action in sub._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, f"vlm-serve {name}: {action.dest} has no help text"


@pytest.mark.parametrize("command", ["serve", "config", "keys", "render-k8s"])
def test_help_exits_cleanly(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main([command, "--help"])
    assert stopped.value.code == 0
    assert f"usage: vlm-serve {command}" in capsys.readouterr().out


def without_serve_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """No VLM_* variable a command sets from its options (set first, so that monkeypatch restores what it sets)."""
    for variable in cli.SERVE_ENV.values():
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)


def test_serve_options_become_the_stacks_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What serve hands the stack: the VLM_* variables every process reads, then the rendered configuration."""
    without_serve_variables(monkeypatch)
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


def test_serve_refuses_tcp_endpoints_without_keys_before_supervisord(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    without_serve_variables(monkeypatch)
    config = tmp_path / "vlm.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\n[endpoints]\ncache = "tcp://127.0.0.1:5555"\n')
    monkeypatch.setattr(cli, "write_supervisord_conf", lambda *_: pytest.fail("rendered a stack that cannot start"))
    with pytest.raises(SystemExit, match=r"vlm-serve: .*tcp://127\.0\.0\.1:5555.*\./ops/keys"):
        cli.main(["serve", "--config", str(config)])


def test_keys_writes_a_keypair_per_role_where_the_config_says(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    without_serve_variables(monkeypatch)
    config = tmp_path / "vlm.toml"
    config.write_text(f'[security]\nkeys_dir = "{tmp_path / "keys"}"\n')
    cli.main(["keys", "--config", str(config)])
    printed = capsys.readouterr().out.split()
    assert str(tmp_path / "keys" / "public" / "decoder.key") in printed
    assert str(tmp_path / "keys" / "private" / "decoder.key_secret") in printed
    cli.main(["keys", "--config", str(config)])  # again: nothing new
    assert capsys.readouterr().out == ""


def _no_script_anywhere(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An interpreter with no supervisord beside it and a PATH without one (the GPU box's ``pip install --target``)."""
    python = tmp_path / "bin" / "python3"
    python.parent.mkdir()
    python.touch()
    monkeypatch.setattr(cli.sys, "executable", str(python))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    return python


def test_supervisord_is_run_from_its_package_when_no_script_is_found(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    python = _no_script_anywhere(monkeypatch, tmp_path)
    assert cli.supervisord_argv() == [str(python), "-m", "supervisor.supervisord"]


def test_supervisord_script_beside_the_interpreter_or_on_path_comes_first(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    python = _no_script_anywhere(monkeypatch, tmp_path)
    on_path = tmp_path / "empty" / "supervisord"
    on_path.parent.mkdir()
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(0o755)
    assert cli.supervisord_argv() == [str(on_path)]
    beside = python.with_name("supervisord")
    beside.touch()
    assert cli.supervisord_argv() == [str(beside)]


def test_no_supervisord_at_all_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _no_script_anywhere(monkeypatch, tmp_path)
    monkeypatch.setitem(sys.modules, "supervisor", None)  # (import supervisor fails)
    with pytest.raises(SystemExit, match="supervisord is not installed"):
        cli.supervisord_argv()


def test_serve_execs_this_interpreter_on_the_supervisor_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """serve execs the module fallback with the rendered configuration, and that command line is supervisord's."""
    without_serve_variables(monkeypatch)
    config = tmp_path / "vlm.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\n')
    real_python = sys.executable
    python = _no_script_anywhere(monkeypatch, tmp_path)
    execed: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(cli.os, "execv", lambda path, argv: execed.append((path, argv)))
    cli.main(["serve", "--config", str(config)])
    conf = str(tmp_path / "run" / "supervisord.conf")
    assert execed == [(str(python), [str(python), "-m", "supervisor.supervisord", "-c", conf])]
    check = subprocess.run(
        [real_python, *execed[0][1][1:3], "--help"], capture_output=True, text=True, timeout=60, env=os.environ
    )
    assert "supervisord -- run a set of applications as daemons" in check.stdout + check.stderr
