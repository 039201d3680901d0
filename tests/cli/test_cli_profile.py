"""`remat profile` end to end through typer's CliRunner (tiny presets, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from remat.cli import app

runner = CliRunner()


def test_profile_llama_tiny() -> None:
    result = runner.invoke(app, ["profile", "--model", "llama-tiny", "--batch", "2",
                                 "--repeats", "1", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "remat profile: llama-tiny, batch 2, seq 32, strategy none on cpu" in out
    assert "blocks.0" in out and "blocks.1" in out
    for label in ("Peak memory", "Activations", "Parameters", "Gradients", "Optimizer state",
                  "Batch", "Backward/forward time ratio"):
        assert label in out


def test_profile_json_and_trace(tmp_path: Path) -> None:
    trace = tmp_path / "traces" / "step.json"
    out = tmp_path / "profile.json"
    result = runner.invoke(app, [
        "profile", "--model", "gpt-tiny", "--batch", "2", "--strategy", "full",
        "--optimizer", "adamw", "--repeats", "1", "--device", "cpu",
        "--trace", str(trace), "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    events = json.loads(trace.read_text())["traceEvents"]
    assert isinstance(events, list) and events
    names = {event.get("name") for event in events}
    assert {"remat.forward", "remat.backward", "remat.optimizer"} <= names

    data = json.loads(out.read_text())
    assert data["strategy"] == "full" and data["optimizer"] == "adamw"
    assert [b["name"] for b in data["blocks"]] == ["blocks.0", "blocks.1"]
    assert data["recompute_flops"] > 0
    # AdamW keeps two fp32 moments per parameter.
    assert data["optimizer_bytes"] >= 2 * data["param_bytes"]
    assert data["backward_forward_ratio"] > 0
    assert any(op["phase"] == "recompute" for op in data["ops"])


def test_profile_bad_strategy_exit_2() -> None:
    result = runner.invoke(app, ["profile", "--model", "gpt-tiny", "--strategy", "half"])
    assert result.exit_code == 2
    text = " ".join(result.output.replace("│", " ").split())
    assert "unknown strategy 'half'" in text and "valid strategies:" in text
    assert "Traceback" not in result.output


def test_profile_one_strategy_only() -> None:
    result = runner.invoke(app, ["profile", "--model", "gpt-tiny", "--strategy", "none,full"])
    assert result.exit_code == 2
    assert "expected one strategy" in " ".join(result.output.replace("│", " ").split())


def test_profile_help_has_examples() -> None:
    result = runner.invoke(app, ["profile", "--help"])
    assert result.exit_code == 0
    assert "Examples" in result.output and "--trace out/trace.json" in result.output
