"""The frontier, remat compare's plan row, and the `remat plan` command (tiny presets, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from remat.cli import app
from remat.compare.frontier import add_plan_row, frontier, manual_strategies
from remat.compare.runner import compare_preset
from remat.planning import Plan, plan
from remat.planning.plans import PLAN_FORMAT_VERSION
from remat.report.plots import plot_frontier
from remat.report.tables import frontier_markdown

from .conftest import Prepared

runner = CliRunner()
PNG = b"\x89PNG\r\n\x1a\n"


def test_manual_strategies_cover_every_n() -> None:
    assert manual_strategies(4) == ["none", "full", "every:2", "every:3", "every:4", "sqrt",
                                    "attn", "mlp", "ops"]


def test_frontier_has_every_manual_strategy_and_the_plan(gpt_tiny: Prepared,
                                                         tmp_path: Path) -> None:
    budget = gpt_tiny.budget_at(0.5)
    result = plan(gpt_tiny.model, gpt_tiny.batch, budget=budget, context=gpt_tiny.context)
    front = frontier(gpt_tiny.model, gpt_tiny.batch, result,
                     strategies=["none", "full", "every:2", "mlp"])
    assert [p.name for p in front.points] == ["none", "full", "every:2", "mlp", "plan"]
    assert front.budget_bytes == budget and front.cost_device == "h100-80gb"
    none, full, plan_point = front.point("none"), front.point("full"), front.point("plan")
    assert none.recompute_ms == 0.0 and not none.fits and full.fits
    assert full.overhead_pct == 100.0 * full.recompute_ms / front.step_ms
    assert plan_point.peak_bytes == result.measured_peak_bytes and plan_point.fits
    best = front.best_manual()
    assert best is not None and plan_point.recompute_ms <= best.recompute_ms
    data = front.to_dict()
    assert data["best_manual"] == best.name and len(data["points"]) == 5
    assert "| plan |" in frontier_markdown(front)
    png = plot_frontier([front, front], tmp_path / "sub" / "front.png").read_bytes()
    assert png[:8] == PNG


def test_compare_gets_a_plan_row() -> None:
    result = compare_preset("gpt-tiny", 2, strategies=["none", "full"], repeats=0,
                            check_grads=False, device="cpu")
    extended = add_plan_row(result, budget="80%")
    assert extended.strategies == ("none", "full", "plan")
    row, base = extended.row("plan"), extended.row("none")
    assert row.peak_bytes <= int(0.8 * base.peak_bytes)
    assert row.grad_passed is True and row.step_ms is None
    assert row.peak_change_pct < 0 and row.recompute_flops >= 0
    assert extended.meta["plan"]["budget"] == "80%"


def test_cli_plan_prints_plan_and_frontier_and_writes_files(tmp_path: Path) -> None:
    out, plot, data = tmp_path / "plan.json", tmp_path / "f.png", tmp_path / "run.json"
    result = runner.invoke(app, [
        "plan", "--model", "gpt-tiny", "--batch", "2", "--budget", "90%", "--device", "cpu",
        "--out", str(out), "--plot", str(plot), "--json", str(data),
    ])
    assert result.exit_code == 0, result.output
    assert "Checkpointing plan" in result.stdout and "Frontier" in result.stdout
    for name in ("every:2", "sqrt", "attn", "mlp", "ops", "plan"):
        assert name in result.stdout
    saved = Plan.from_json(out.read_text())
    assert saved.measured_peak_bytes is not None
    assert saved.measured_peak_bytes <= saved.budget_bytes
    run = json.loads(data.read_text())
    assert run["meta"]["model"] == "gpt-tiny" and run["plan"]["version"] == PLAN_FORMAT_VERSION
    assert {p["name"] for p in run["frontier"]["points"]} >= {"none", "full", "plan"}
    assert plot.read_bytes()[:8] == PNG


def test_cli_plan_json_to_stdout_without_frontier() -> None:
    result = runner.invoke(app, [
        "plan", "--model", "llama-tiny", "--batch", "1", "--seq", "8", "--budget", "100%",
        "--device", "cpu", "--no-frontier", "--simulate", "--json", "-",
    ])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["frontier"] is None and data["meta"]["simulate"] is True
    assert data["plan"]["measured_peak_bytes"] <= data["plan"]["budget_bytes"]


def test_cli_plan_errors_are_clean() -> None:
    bad = runner.invoke(app, ["plan", "--model", "gpt-tiny", "--budget", "lots"])
    assert bad.exit_code == 2 and "cannot read budget" in bad.output
    torch.manual_seed(0)
    small = runner.invoke(app, ["plan", "--model", "gpt-tiny", "--batch", "1", "--budget",
                                "5%", "--device", "cpu", "--no-frontier", "--simulate"])
    assert small.exit_code == 1
    assert "no checkpointing plan fits" in small.output and "Traceback" not in small.output


def test_cli_plan_with_measured_costs_times_every_strategy(tmp_path: Path) -> None:
    data = tmp_path / "run.json"
    result = runner.invoke(app, [
        "plan", "--model", "gpt-tiny", "--batch", "2", "--budget", "90%", "--device", "cpu",
        "--cost", "measured", "--json", str(data),
    ])
    assert result.exit_code == 0, result.output
    assert "measured, cpu" in result.stdout and "timed step" in result.stdout
    run = json.loads(data.read_text())
    assert run["plan"]["cost_source"] == "measured" and run["plan"]["timed_on"] == "cpu"
    front = run["frontier"]
    assert front["cost_source"] == "measured" and front["step_ms"] > 0
    points = {p["name"]: p for p in front["points"]}
    assert points["none"]["recompute_ms"] == 0.0
    assert all(p["recompute_ms"] >= 0 for p in points.values())
    assert points["plan"]["peak_bytes"] <= run["plan"]["budget_bytes"]
    bad = runner.invoke(app, ["plan", "--model", "gpt-tiny", "--cost", "measured",
                              "--simulate", "--no-frontier"])
    assert bad.exit_code == 2 and "measured costs" in bad.output
