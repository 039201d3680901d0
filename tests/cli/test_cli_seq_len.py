"""``remat plan --maximize seq-len`` and ``remat simulate --seq S1,S2``: the longest sequence."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

import remat
from remat.cli import app
from remat.models import build_model, make_batch


def test_plan_maximize_seq_len_json_matches_profile(tmp_path: Path) -> None:
    out = tmp_path / "seq.json"
    result = CliRunner().invoke(app, [
        "plan", "--model", "gpt-tiny", "--budget", str(3 * 2**20), "--maximize", "seq-len",
        # 96 and 128 tokens: `none` fits the first only, `full` and the plan both (two
        # plans, each a full prepare, are the cost of this test)
        "--min-seq", "96", "--seq", "128", "--seq-multiple", "32", "--strategies", "none,full",
        "--simulate",
        "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "Longest seq" in result.output and "The plan at seq" in result.output
    data = json.loads(out.read_text())
    assert data["meta"]["maximize"] == "seq-len"
    found = data["seq_len_search"]
    assert (found["batch_size"], found["max_seq_len"], found["multiple_of"]) == (1, 128, 32)
    rows = {r["strategy"]: r for r in found["rows"]}
    assert list(rows) == ["none", "full", "plan"]
    model = build_model("gpt-tiny", max_seq_len=128)  # what --seq 128 builds
    none = rows["none"]
    peak = remat.profile(model, make_batch(model, 1, seq_len=none["seq_len"]), simulate=True)
    assert peak.peak_bytes == none["peak_bytes"] <= 3 * 2**20 < none["next_peak_bytes"]
    assert rows["plan"]["seq_len"] >= rows["full"]["seq_len"] > none["seq_len"]
    assert found["plan"]["batch_size"] == 1


def test_simulate_several_seqs_reports_the_longest_that_fits(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(app, [
        "simulate", "--model", "gpt-small", "--seq", "4096,1024,16384", "--batch", "1,2",
        "--strategies", "none,full", "--no-plan", "--device", "l4", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "Longest sequence that fits, per strategy" in result.output
    data = json.loads(out.read_text())
    assert [r["seq_len"] for r in data["runs"]] == [1024, 4096, 16384]
    l4 = data["runs"][0]["device_memory_bytes"]
    for name in ("none", "full"):
        longest = data["longest_seq"][name]
        run = next(r for r in data["runs"] if r["seq_len"] == longest["seq_len"])
        fitting = [r for r in run["rows"] if r["strategy"] == name and r["fits"]]
        assert max(r["batch_size"] for r in fitting) == longest["batch_size"]
        longer = [r for r in data["runs"] if r["seq_len"] > longest["seq_len"]]
        assert all(not r["fits"] for run in longer for r in run["rows"] if r["strategy"] == name)
        assert longest["peak_bytes"] <= l4
    assert data["longest_seq"]["none"]["seq_len"] == 4096  # 16384 needs ~150 GiB
