"""``remat simulate --tp T [--sp]``: one tensor-parallel rank's bytes per strategy."""

from __future__ import annotations

import json
from pathlib import Path

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


PLAN_FILE = '''
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

MLP_ONLY = {"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2,
                                      n_positions=32))


def missing():
    return {"mlp.fc_in": ColwiseParallel()}
'''


def test_simulate_tp_takes_the_users_plan(tmp_path: Path) -> None:
    from remat.cli._user_model import load_attribute

    (tmp_path / "plans.py").write_text(PLAN_FILE)
    result = runner.invoke(app, ["simulate", "--model", "llama-tiny", "--seq", "32",
                                 "--batch", "2", "--dtype", "fp32", "--tp", "2",
                                 "--tp-plan", f"{tmp_path}/plans.py:MLP_ONLY",
                                 "--strategies", "full", "--json", "-"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)["tensor_parallel"]
    plan, _, _ = load_attribute(f"{tmp_path}/plans.py:MLP_ONLY", "test", option="--tp-plan")
    want = tp_rank_bytes("llama-tiny", seq_len=32, batch_size=2, tp=2, strategy="full",
                         dtype="fp32", tp_plan=plan)
    assert (row["param_bytes"], row["activation_bytes"], row["peak_bytes"]) == (
        want.param_bytes, want.activation_bytes, want.peak_bytes)


def test_simulate_tp_refusals_exit_2_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / "plans.py").write_text(PLAN_FILE)
    base = ["simulate", "--seq", "16", "--batch", "1", "--tp", "2", "--strategies", "none"]
    # Hugging Face GPT-2 (Conv1D, fused c_attn): remat's layout does not know it
    gpt2 = runner.invoke(app, [*base, "--module", f"{tmp_path}/plans.py:gpt2"])
    assert gpt2.exit_code == 2, gpt2.output
    assert "no block has projections" in gpt2.output and "--tp-plan" in gpt2.output
    missing = runner.invoke(app, [*base, "--model", "llama-tiny",
                                  "--tp-plan", f"{tmp_path}/plans.py:missing"])
    assert missing.exit_code == 2 and "'mlp.fc_in' names no module" in missing.output
    no_tp = runner.invoke(app, ["simulate", "--model", "llama-tiny",
                                "--tp-plan", f"{tmp_path}/plans.py:MLP_ONLY"])
    assert no_tp.exit_code == 2 and "--tp-plan needs --tp > 1" in no_tp.output
