"""`remat compare` end to end through typer's CliRunner (tiny presets, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from remat.cli import app
from remat.compare.runner import ComparisonResult
from remat.strategies.registry import default_strategies

runner = CliRunner()
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_compare_json_and_plot(tmp_path: Path) -> None:
    json_path = tmp_path / "compare.json"
    plot_path = tmp_path / "missing" / "dir" / "compare.png"
    result = runner.invoke(app, [
        "compare", "--model", "gpt-tiny", "--batch", "2", "--repeats", "1", "--device", "cpu",
        "--json", str(json_path), "--plot", str(plot_path),
        "--plan-budget", "off",  # the plan row: test_compare_plan_row_and_infeasible_...
    ])
    assert result.exit_code == 0, result.output
    # The table goes to stdout, with every strategy in it.
    assert "remat compare: gpt-tiny, batch 2, seq 32 on cpu" in result.stdout
    for name in default_strategies("compare"):
        assert name in result.stdout
    assert "FAIL" not in result.stdout

    data = json.loads(json_path.read_text())
    assert data["meta"]["model"] == "gpt-tiny" and data["meta"]["batch_size"] == 2
    rows = {row["strategy"]: row for row in data["rows"]}
    assert list(rows) == default_strategies("compare")
    assert rows["none"]["recompute_flops"] == 0
    assert rows["none"]["recompute_overhead_pct"] == 0.0
    assert rows["full"]["activation_bytes"] < rows["none"]["activation_bytes"]
    assert rows["full"]["recompute_overhead_pct"] > 0
    assert all(row["grad_passed"] is True for row in rows.values())
    assert ComparisonResult.from_dict(data).row("full").strategy == "full"

    png = plot_path.read_bytes()
    assert png[:8] == PNG_SIGNATURE and len(png) > 1000


def test_compare_json_to_stdout_only() -> None:
    result = runner.invoke(app, [
        "compare", "--model", "llama-tiny", "--batch", "1", "--seq", "8", "--device", "cpu",
        "--strategies", "none,full", "--repeats", "0", "--no-check-grads", "--json", "-",
        "--plan-budget", "off",
    ])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # nothing but JSON on stdout
    assert [row["strategy"] for row in data["rows"]] == ["none", "full"]
    assert data["meta"]["seq_len"] == 8
    assert data["rows"][1]["grad_passed"] is None and data["rows"][1]["step_ms"] is None


def test_compare_plan_row_and_infeasible_plan_budget() -> None:
    base = ["compare", "--model", "gpt-tiny", "--batch", "2", "--device", "cpu",
            "--strategies", "none,full", "--repeats", "0", "--json", "-"]
    result = runner.invoke(app, [*base, "--plan-budget", "80%"])
    assert result.exit_code == 0, result.output
    rows = {row["strategy"]: row for row in json.loads(result.stdout)["rows"]}
    assert list(rows) == ["none", "full", "plan"]
    assert rows["plan"]["peak_bytes"] <= 0.8 * rows["none"]["peak_bytes"]
    assert rows["plan"]["grad_passed"] is True
    result = runner.invoke(app, [*base, "--plan-budget", "10%"])
    assert result.exit_code == 0, result.output
    assert [r["strategy"] for r in json.loads(result.stdout)["rows"]] == ["none", "full"]
    assert "No plan row: no plan fits --plan-budget 10%" in result.stderr


@pytest.mark.parametrize(("args", "expected"), [
    (["--model", "gpt-huge"], ["Invalid value for '--model'", "unknown preset 'gpt-huge'",
                               "gpt-tiny", "llama-7b"]),
    (["--strategies", "none,bogus"], ["unknown strategy 'bogus'", "valid strategies:",
                                      "every:N", "offload"]),
    (["--strategies", "every:0"], ["every:N with an integer N >= 1"]),
    (["--strategies", "full,full"], ["'full' is listed twice"]),
    (["--model", "gpt-tiny", "--seq", "64"], ["seq_len=64 exceeds", "max_seq_len=32"]),
    (["--batch", "0"], ["Invalid value for '--batch'"]),
    (["--device", "tpu"], ["fix: use auto, cpu, cuda or cuda:N"]),
])
def test_compare_bad_values_exit_2(args: list[str], expected: list[str]) -> None:
    result = runner.invoke(app, ["compare", *args])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    text = " ".join(result.output.split()).replace("│", "")
    text = " ".join(text.split())
    for fragment in expected:
        assert fragment in text, text


def test_compare_help_has_examples() -> None:
    result = runner.invoke(app, ["compare", "--help"])
    assert result.exit_code == 0
    assert "Examples" in result.output
    assert "remat compare --model llama-small" in result.output


def test_compare_refuses_what_cannot_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    import remat.cli.common as common

    monkeypatch.setattr(common, "_available_bytes", lambda device: 1024)
    result = runner.invoke(app, ["compare", "--model", "gpt-tiny", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "gpt-tiny has 463.00 KiB of parameters" in text
    assert "but cpu has 1.00 KiB free" in text and "remat simulate" in text
