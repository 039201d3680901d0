"""`remat plan` end to end through typer's CliRunner (tiny presets, CPU)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from remat.cli import app
from remat.models import build_model

runner = CliRunner()


def test_plan_accumulating_plans_the_step_with_gradients_held() -> None:
    """``remat plan --accumulating`` is ``remat.plan(..., accumulating=True)``: the
    un-checkpointed peak it plans from holds every gradient from the step's start."""
    args = ["plan", "--model", "gpt-tiny", "--batch", "4", "--budget", "80%",
            "--no-frontier", "--json", "-"]
    plain = runner.invoke(app, args)
    held = runner.invoke(app, [*args, "--accumulating"])
    assert plain.exit_code == 0 and held.exit_code == 0, held.output
    plain_out, held_out = json.loads(plain.stdout), json.loads(held.stdout)
    assert held_out["meta"]["accumulating"] is True
    assert plain_out["meta"]["accumulating"] is False
    model = build_model("gpt-tiny")
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held_out["plan"]["no_checkpoint_peak_bytes"] \
        == plain_out["plan"]["no_checkpoint_peak_bytes"] + grad_bytes
    plan = held_out["plan"]
    assert plan["allocator_peak_bytes"] <= plan["budget_bytes"]
