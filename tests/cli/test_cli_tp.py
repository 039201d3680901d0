"""``remat simulate --tp T [--sp]``: one tensor-parallel rank's bytes per strategy."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from remat.cli import app
from remat.distributed.tensor_parallel import tp_rank_bytes
from remat.distributed.tp_step import simulate_ranks

runner = CliRunner()


def test_simulate_tp_rows_are_tp_rank_bytes() -> None:
    result = runner.invoke(app, ["simulate", "--model", "llama-tiny", "--seq", "32",
                                 "--batch", "1,2", "--dtype", "fp32", "--tp", "2", "--sp",
                                 "--strategies", "none,full", "--json", "-"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["tensor_parallel"]
    assert [(r["strategy"], r["batch_size"]) for r in rows] == [
        ("none", 1), ("none", 2), ("full", 1), ("full", 2)]
    by = {(r["strategy"], r["batch_size"]): r for r in rows}
    # The CLI simulates its four points in one batched call; tp_rank_bytes simulates one
    # point per call (two steps each). It is checked at the batched call's first and last
    # point, which between them cover each strategy and each batch size; (none, 2) and
    # (full, 1) go through the same per-point code and are left out for time.
    for strategy, batch_size in (("none", 1), ("full", 2)):
        r = by[strategy, batch_size]
        want = tp_rank_bytes("llama-tiny", seq_len=32, batch_size=batch_size, tp=2,
                             sequence_parallel=True, strategy=strategy, dtype="fp32")
        assert (r["param_bytes"], r["optimizer_bytes"], r["activation_bytes"],
                r["peak_bytes"]) == (want.param_bytes, want.optimizer_bytes,
                                     want.activation_bytes, want.peak_bytes)
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


def falcon_mqa():
    from transformers import FalconConfig, FalconForCausalLM

    return FalconForCausalLM(FalconConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, multi_query=True,
                                          parallel_attn=False))


FALCON_MLP = {"mlp.dense_h_to_4h": ColwiseParallel(), "mlp.dense_4h_to_h": RowwiseParallel()}


def missing():
    return {"mlp.fc_in": ColwiseParallel()}
'''


def test_simulate_tp_takes_the_users_plan(tmp_path: Path) -> None:
    from remat.cli.user_model import load_attribute

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


def test_simulate_tp_shards_gpt2s_fused_qkv(tmp_path: Path) -> None:
    import importlib.util

    (tmp_path / "plans.py").write_text(PLAN_FILE)
    result = runner.invoke(app, ["simulate", "--module", f"{tmp_path}/plans.py:gpt2",
                                 "--seq", "16", "--batch", "1", "--dtype", "fp32", "--tp", "2",
                                 "--strategies", "none", "--json", "-"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)["tensor_parallel"]
    spec = importlib.util.spec_from_file_location("plans", tmp_path / "plans.py")
    assert spec is not None and spec.loader is not None
    plans = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plans)
    (want,) = simulate_ranks(plans.gpt2, seq_len=16, points=[("none", 1)], tp=2,
                             sequence_parallel=False, dtype="fp32", optimizer="adamw")
    assert (row["param_bytes"], row["peak_bytes"]) == (want.param_bytes, want.peak_bytes)


def test_simulate_tp_refusals_exit_2_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / "plans.py").write_text(PLAN_FILE)
    base = ["simulate", "--seq", "16", "--batch", "1", "--tp", "2", "--strategies", "none"]
    # Falcon's one key/value head cannot be split: refused, and the fix (a plan leaving
    # the attention whole) runs
    mqa = runner.invoke(app, [*base, "--module", f"{tmp_path}/plans.py:falcon_mqa"])
    assert mqa.exit_code == 2, mqa.output
    assert "cannot give each of 2 ranks whole heads" in mqa.output
    assert "--tp-plan" in mqa.output
    fixed = runner.invoke(app, [*base, "--module", f"{tmp_path}/plans.py:falcon_mqa",
                                "--tp-plan", f"{tmp_path}/plans.py:FALCON_MLP"])
    assert fixed.exit_code == 0, fixed.output
    missing = runner.invoke(app, [*base, "--model", "llama-tiny",
                                  "--tp-plan", f"{tmp_path}/plans.py:missing"])
    assert missing.exit_code == 2 and "'mlp.fc_in' names no module" in missing.output
    no_tp = runner.invoke(app, ["simulate", "--model", "llama-tiny",
                                "--tp-plan", f"{tmp_path}/plans.py:MLP_ONLY"])
    assert no_tp.exit_code == 2 and "--tp-plan needs --tp > 1" in no_tp.output
