"""``remat simulate --tp T [--sp]``: one tensor-parallel rank's bytes per strategy."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from remat.cli import app
from remat.simulate.tensor_parallel import tp_rank_bytes

runner = CliRunner()


def test_simulate_tp_rows_are_tp_rank_bytes() -> None:
    result = runner.invoke(app, ["simulate", "--model", "llama-tiny", "--seq", "32",
                                 "--batch", "1,2", "--dtype", "fp32", "--tp", "2", "--sp",
                                 "--strategies", "none,full", "--json", "-"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["tensor_parallel"]
    assert [(r["strategy"], r["batch_size"]) for r in rows] == [
        ("none", 1), ("none", 2), ("full", 1), ("full", 2)]
    for r in rows:
        want = tp_rank_bytes("llama-tiny", seq_len=32, batch_size=r["batch_size"], tp=2,
                             sequence_parallel=True, strategy=r["strategy"], dtype="fp32")
        assert (r["param_bytes"], r["optimizer_bytes"], r["activation_bytes"],
                r["peak_bytes"]) == (want.param_bytes, want.optimizer_bytes,
                                     want.activation_bytes, want.peak_bytes)
    by = {(r["strategy"], r["batch_size"]): r for r in rows}
    assert by["full", 2]["activation_bytes"] < by["none", 2]["activation_bytes"]


def test_simulate_tp_refuses_what_it_does_not_model() -> None:
    sp_alone = runner.invoke(app, ["simulate", "--model", "llama-tiny", "--sp"])
    assert sp_alone.exit_code == 2 and "--sp needs --tp > 1" in sp_alone.output
    with_dp = runner.invoke(app, ["simulate", "--model", "llama-tiny", "--tp", "2",
                                  "--world-size", "2"])
    assert with_dp.exit_code == 2 and "--tp with --world-size > 1" in with_dp.output
