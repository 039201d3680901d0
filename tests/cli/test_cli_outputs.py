"""Output paths are checked before any work: a path that cannot be written is
refused at once with exit code 2, never after minutes of planning, never reported as written."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from remat.cli import app

UNWRITABLE = "/proc/remat-cannot-write-here.json"


@pytest.mark.parametrize("args", [
    ["plan", "--model", "gpt-tiny", "--budget", "60%", "--out", UNWRITABLE],
    ["plan", "--model", "gpt-tiny", "--budget", "60%", "--json", UNWRITABLE],
    ["plan", "--model", "gpt-tiny", "--budget", "60%", "--plot", UNWRITABLE],
    ["profile", "--model", "gpt-tiny", "--trace", UNWRITABLE],
    ["profile", "--model", "gpt-tiny", "--json", UNWRITABLE],
    ["compare", "--model", "gpt-tiny", "--json", UNWRITABLE],
    ["simulate", "--model", "gpt-tiny", "--batch", "1", "--plot", UNWRITABLE],
])
def test_unwritable_output_is_refused_before_the_work(args: list[str]) -> None:
    start = time.perf_counter()
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "cannot write" in result.output and "Wrote" not in result.output
    assert time.perf_counter() - start < 5.0  # refused before measuring anything


def test_a_directory_is_refused_and_missing_parents_are_fine(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["profile", "--model", "gpt-tiny", "--json",
                                      str(tmp_path)])
    assert result.exit_code == 2 and "directory" in result.output
    target = tmp_path / "new" / "dir" / "profile.json"
    result = CliRunner().invoke(app, ["profile", "--model", "gpt-tiny", "--batch", "1",
                                      "--repeats", "1", "--json", str(target)])
    assert result.exit_code == 0, result.output
    assert target.read_text().startswith("{")
