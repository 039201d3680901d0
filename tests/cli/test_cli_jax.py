"""`remat compare/plan --framework jax` through typer's CliRunner (gpt-tiny, short sequences)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("jax")
pytest.importorskip("flax")

from remat.cli import app  # noqa: E402
from remat.core.rows import ComparisonResult  # noqa: E402

runner = CliRunner()
TINY = ["--model", "gpt-tiny", "--batch", "2", "--seq", "16"]


def test_compare_jax_table_json_and_plot(tmp_path: Path) -> None:
    json_path, plot_path = tmp_path / "c.json", tmp_path / "plots" / "c.png"
    result = runner.invoke(app, ["compare", "--framework", "jax", *TINY, "--strategies",
                                 "full", "--repeats", "0", "--plan-budget", "90%", "--json",
                                 str(json_path), "--plot", str(plot_path)])
    assert result.exit_code == 0, result.output
    assert "remat compare: gpt-tiny (JAX), batch 2, seq 16 on jax:cpu" in result.stdout
    for name in ("none", "full"):  # a narrow terminal may elide the plan row's name
        assert name in result.stdout
    data = ComparisonResult.from_dict(json.loads(json_path.read_text()))
    assert data.strategies == ("none", "full", "plan")
    assert data.meta["framework"] == "jax" and data.meta["model"] == "gpt-tiny"
    assert data.row("full").peak_bytes < data.row("none").peak_bytes
    budget_bytes = data.meta["plan"]["budget_bytes"]
    assert budget_bytes == int(0.9 * data.row("none").peak_bytes)
    assert data.row("plan").peak_bytes <= budget_bytes < data.row("none").peak_bytes
    assert all(row.grad_passed for row in data.rows)
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_jax_plan_budget_too_small_keeps_the_table() -> None:
    result = runner.invoke(app, ["compare", "--framework", "jax", *TINY, "--strategies",
                                 "full", "--repeats", "0", "--no-check-grads",
                                 "--plan-budget", "1000", "--json", "-"])
    assert result.exit_code == 0, result.output
    assert "No plan row" in result.stderr
    data = ComparisonResult.from_dict(json.loads(result.stdout))
    assert data.strategies == ("none", "full")


def test_plan_jax_summary_and_out(tmp_path: Path) -> None:
    import remat.jax as rj

    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", "--framework", "jax", *TINY, "--budget", "90%",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "remat.jax plan" in result.stdout and "budget" in result.stdout
    plan = rj.Plan.from_json(out.read_text())
    assert plan.framework == "jax" and plan.batch_size == 2
    assert plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes <= plan.budget_bytes


def test_plan_jax_json_to_stdout() -> None:
    result = runner.invoke(app, ["plan", "--framework", "jax", *TINY, "--budget", "200%",
                                 "--json", "-"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["plan"]["framework"] == "jax" and data["plan"]["decisions"] == {}
    assert data["meta"]["framework"] == "jax"


@pytest.mark.parametrize("command, extra, flag", [
    ("plan", ["--cost", "measured"], "--cost"),
    ("plan", ["--maximize", "throughput"], "--maximize"),
    ("plan", ["--simulate"], "--simulate"),
    ("plan", ["--optimizer", "adamw"], "--optimizer"),
    ("plan", ["--plot", "f.png"], "--plot"),
    ("compare", ["--device", "cpu"], "--device"),
])
def test_options_without_meaning_for_jax_are_refused(command: str, extra: list[str],
                                                     flag: str) -> None:
    result = runner.invoke(app, [command, "--framework", "jax", *TINY, *extra])
    assert result.exit_code == 2, result.output
    assert f"{flag} is not supported with --framework jax" in result.output


def test_unknown_jax_preset_and_strategy() -> None:
    result = runner.invoke(app, ["compare", "--framework", "jax", "--model", "llama-tiny"])
    assert result.exit_code == 2 and "JAX preset" in result.output, result.output
    result = runner.invoke(app, ["compare", "--framework", "jax", *TINY, "--strategies",
                                 "attn"])
    assert result.exit_code == 2 and "JAX strategies" in result.output, result.output


def test_missing_jax_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "remat.jax", None)
    result = runner.invoke(app, ["plan", "--framework", "jax", *TINY])
    assert result.exit_code == 2
    assert "pip install 'remat[jax]'" in result.output


def test_help_names_the_framework() -> None:
    for command in ("compare", "plan"):
        result = runner.invoke(app, [command, "--help"])
        assert result.exit_code == 0 and "--framework" in result.output
