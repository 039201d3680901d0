"""The typer app: command modules are loaded, optional ones skipped, broken ones fail loudly."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import remat.cli
from remat.cli import app

runner = CliRunner()


def test_top_level_help_lists_commands() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "compare" in result.output and "profile" in result.output


def test_missing_optional_module_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remat.cli, "_COMMAND_MODULES", (("no_such_command", False),))
    remat.cli._load_command_modules()  # no error


def test_missing_required_module_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remat.cli, "_COMMAND_MODULES", (("no_such_command", True),))
    with pytest.raises(ModuleNotFoundError):
        remat.cli._load_command_modules()


def test_broken_optional_module_reraises(monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    (tmp_path / "broken_command.py").write_text("import a_module_that_does_not_exist\n")
    monkeypatch.setattr(remat.cli, "__path__", [*remat.cli.__path__, str(tmp_path)])
    monkeypatch.setattr(remat.cli, "_COMMAND_MODULES", (("broken_command", False),))
    with pytest.raises(ModuleNotFoundError, match="a_module_that_does_not_exist"):
        remat.cli._load_command_modules()
