"""The ``remat simulate`` and ``remat estimate`` commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from remat.cli import app

runner = CliRunner()


def test_simulate_table_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    result = runner.invoke(app, [
        "simulate", "--model", "llama-tiny", "--seq", "16", "--batch", "2,1",
        "--strategies", "none,full", "--device", "l4", "--no-plan",
        "--json", str(out), "--plot", str(png),
    ])
    assert result.exit_code == 0, result.output
    assert "Largest micro-batch that fits" in result.output
    assert "llama-tiny: seq 16, bf16 + adamw on l4" in result.output
    data = json.loads(out.read_text())
    assert data["batch_sizes"] == [1, 2] and data["strategies"] == ["none", "full"]
    assert data["largest_batch"] == {"none": 2, "full": 2}
    assert len(data["rows"]) == 4 and all(r["fits"] for r in data["rows"])
    assert png.stat().st_size > 10_000


def test_simulate_fsdp_json_to_stdout() -> None:
    result = runner.invoke(app, [
        "simulate", "--model", "llama-tiny", "--seq", "16", "--batch", "1",
        "--strategies", "none", "--world-size", "2", "--no-plan", "--json", "-",
    ])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["sharding"], data["world_size"]) == ("fsdp", 2)


def test_estimate_command() -> None:
    result = runner.invoke(app, ["estimate", "--model", "llama-tiny", "--seq", "16",
                                 "--batch", "1", "--dtype", "fp32", "--json", "-"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["n_layers"] == 2 and len(data["rows"]) == 2
    assert data["rows"][1]["simulated_bytes"] == 16 * 64 * 4
    table = runner.invoke(app, ["estimate", "--model", "llama-tiny", "--seq", "16",
                                "--batch", "1"])
    assert table.exit_code == 0 and "Korthikanti" in table.output


def test_bad_options_exit_2() -> None:
    both = runner.invoke(app, ["simulate", "--model", "llama-tiny", "--hf", "llama"])
    assert both.exit_code == 2 and "pass one of --model, --hf, --hf-config" in both.output
    device = runner.invoke(app, ["simulate", "--model", "llama-tiny", "--device", "tpu-v5"])
    assert device.exit_code == 2 and "h100-80gb" in device.output
    batch = runner.invoke(app, ["simulate", "--model", "llama-tiny", "--batch", "1,x"])
    assert batch.exit_code == 2
    ddp = runner.invoke(app, ["simulate", "--model", "llama-tiny", "--world-size", "2",
                              "--sharding", "none"])
    assert ddp.exit_code == 2


def test_simulate_exact_flag_gives_the_same_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    import remat.simulate.run as run

    seen: list[bool] = []
    original = run.simulate

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(bool(kwargs.get("exact")))
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(run, "simulate", spy)
    rows = []
    for flags in ([], ["--exact"]):
        result = runner.invoke(app, [
            "simulate", "--model", "llama-tiny", "--seq", "16", "--batch", "1,2",
            "--strategies", "none,full", "--device", "l4", "--no-plan", "--json", "-",
            *flags,
        ])
        assert result.exit_code == 0, result.output
        rows.append(json.loads(result.stdout)["rows"])
    assert seen == [False, True]
    assert [r["peak_bytes"] for r in rows[0]] == [r["peak_bytes"] for r in rows[1]]
