"""The CLI's shape: command modules stand alone, help comes from the registry, one optimizer
factory, and progress never reaches stdout."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from typer.testing import CliRunner

import remat.cli
from remat.cli import app
from remat.cli.common import make_optimizer
from remat.strategies import register_strategy, unregister_strategy
from remat.strategies.builtin.full import Full, FullHandler
from remat.strategies.registry import default_strategies

runner = CliRunner()
CLI_DIR = Path(remat.cli.__file__).parent
COMMAND_MODULES = [name for name, _ in remat.cli._COMMAND_MODULES]
WIDE = {"COLUMNS": "300"}


def _imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_command_modules_do_not_import_each_other() -> None:
    for name in COMMAND_MODULES:
        imported = _imported_modules(CLI_DIR / f"{name}.py")
        others = {f"remat.cli.{other}" for other in COMMAND_MODULES if other != name}
        assert not imported & others, f"remat.cli.{name} imports {sorted(imported & others)}"


def test_cli_modules_are_small() -> None:
    for path in CLI_DIR.glob("*.py"):
        lines = path.read_text().count("\n")
        assert lines < 400, f"{path.name} has {lines} lines"


def test_top_level_help_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = ("import sys; from typer.testing import CliRunner; from remat.cli import app; "
            "assert CliRunner().invoke(app, ['--help']).exit_code == 0; "
            "assert 'torch' not in sys.modules, 'remat --help imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_help_lists_the_registry_including_strategies_registered_later() -> None:
    compare = runner.invoke(app, ["compare", "--help"], env=WIDE)
    assert compare.exit_code == 0
    assert ",".join(default_strategies("compare")) in compare.output
    assert "<compare-defaults>" not in compare.output

    @dataclass(frozen=True)
    class Twice(Full):
        name: ClassVar[str] = "twice"

    register_strategy(Twice, FullHandler)
    try:
        simulate = runner.invoke(app, ["simulate", "--help"], env=WIDE)
        assert simulate.exit_code == 0
        assert "Default: " + ",".join(default_strategies("simulate")) in simulate.output
        assert default_strategies("simulate")[-1] == "twice" and ",twice" in simulate.output
        profile = runner.invoke(app, ["profile", "--help"], env=WIDE)
        assert "ops, offload, full_offload, chunked_head:N or twice" in profile.output
    finally:
        unregister_strategy("twice")
    assert "twice" not in runner.invoke(app, ["simulate", "--help"], env=WIDE).output
    plan = runner.invoke(app, ["plan", "--help"], env=WIDE)
    assert "(none, full, every:N, sqrt, attn, mlp, ops)" in plan.output
    assert 'remat.Plan.from_json(open("plan.json").read())' in plan.output
    assert "remat.plan.Plan" not in plan.output


def test_one_optimizer_factory_as_a_training_script_builds_it() -> None:
    model = torch.nn.Linear(2, 2)
    assert make_optimizer("none", model) is None
    sgd = make_optimizer("sgd", model)
    assert isinstance(sgd, torch.optim.SGD)
    assert sgd.defaults == torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9).defaults
    adamw = make_optimizer("adamw", model)
    assert adamw.defaults == torch.optim.AdamW(model.parameters(), lr=1e-3).defaults
    assert isinstance(make_optimizer("adam", model), torch.optim.Adam)


def test_simulate_progress_goes_to_stderr_and_json_stdout_stays_clean() -> None:
    result = runner.invoke(app, [
        "simulate", "--model", "llama-tiny", "--seq", "16", "--batch", "1,2",
        "--strategies", "none,full", "--device", "l4", "--no-plan", "--json", "-",
    ])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # nothing but JSON on stdout
    assert len(data["rows"]) == 4
    # stderr is not a terminal here, so each row is logged as a plain line.
    assert "simulate llama-tiny: none batch 1 (0/4)" in result.stderr
    assert "simulate llama-tiny: full batch 2 (3/4)" in result.stderr
    assert "simulate llama-tiny: done (4/4)" in result.stderr
