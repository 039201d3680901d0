"""Plans fit their budget by XLA's analysis and cost no more than the best manual policy."""

from __future__ import annotations

import json
from functools import cache, partial
from typing import Any

import pytest

import remat.jax as rj
from remat.core.cost import Category
from remat.errors import BudgetTooSmall
from remat.jax.analysis import analyze_steps

from .conftest import PLANNER, PLANNER_BATCH

FRACTIONS = (0.25, 0.5, 0.75)
#: The manual menu a JAX user picks from (one policy for every block, or a pattern).
MANUAL = ("full", "dots_saveable", "dots_with_no_batch_dims_saveable",
          "save_only_these_names:qkv,mlp_up", "every:2", "sqrt")


@cache
def setup() -> tuple[Any, Any, dict[str, rj.StepAnalysis]]:
    model = rj.build_model(PLANNER)
    batch = rj.make_batch(PLANNER, PLANNER_BATCH)
    names = ("none", *MANUAL)
    # compiled side by side; each is XLA's analysis of the step with that strategy applied
    steps = analyze_steps(model, batch, [partial(rj.apply, model, s) for s in names])
    rj.remove(model)
    return model, batch, dict(zip(names, steps, strict=True))


def budget_at(fraction: float) -> int:
    """``fraction`` of the way from the full-remat peak to the no-remat peak (as tests/plan)."""
    _, _, manual = setup()
    full, none = manual["full"].peak_bytes, manual["none"].peak_bytes
    return int(full + fraction * (none - full))


@cache
def planned(fraction: float) -> rj.Plan:
    """``rj.plan`` at ``budget_at(fraction)``: planned once per fraction for every test here
    (plan leaves the model as it was: test_plan_fits_and_beats_manual checks it)."""
    model, batch, _ = setup()
    return rj.plan(model, batch, budget=budget_at(fraction))


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_plan_fits_and_beats_manual(fraction: float) -> None:
    model, batch, manual = setup()
    budget = budget_at(fraction)
    plan = planned(fraction)
    assert rj.decisions_of(model) == {}, "plan must leave the model as it was"
    assert plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes <= budget, (
        f"{fraction:.0%}: XLA peak {plan.measured_peak_bytes} B > budget {budget} B")
    measured = rj.analyze_step(rj.apply(model, plan), batch)
    rj.remove(model)
    assert measured.peak_bytes == plan.measured_peak_bytes
    fitting = {s: a.flops for s, a in manual.items() if a.peak_bytes <= budget}
    best = min(fitting.values())
    assert measured.flops <= best, (
        f"{fraction:.0%}: plan {plan.label()} costs {measured.flops} FLOPs > best manual "
        f"{min(fitting, key=lambda s: fitting[s])} {best}")
    assert plan.recompute_flops == measured.flops - manual["none"].flops


def test_more_budget_never_costs_more() -> None:
    costs = [planned(f).recompute_flops for f in FRACTIONS]
    assert costs == sorted(costs, reverse=True), costs


def test_percent_budget_and_auto() -> None:
    model, batch, manual = setup()
    plan = rj.auto(model, batch, budget="150%")
    assert plan.is_empty and plan.budget_bytes == int(1.5 * manual["none"].peak_bytes)
    plan = rj.auto(model, batch, budget="60%")
    try:
        assert rj.decisions_of(model) == {n: p.label() for n, p in plan.decisions.items()}
        assert plan.measured_peak_bytes is not None
        assert plan.measured_peak_bytes <= int(0.6 * manual["none"].peak_bytes)
        assert rj.validate(model, batch, plan).passed
    finally:
        rj.remove(model)


def test_budget_too_small() -> None:
    """The error, and with it the profile, break bytes down by remat's categories (the
    same :class:`~remat.core.cost.Category` the PyTorch side uses)."""
    model, batch, manual = setup()
    with pytest.raises(BudgetTooSmall, match="fix: raise the budget") as info:
        rj.plan(model, batch, budget=1000)
    err = info.value
    assert err.budget_bytes == 1000
    assert 1000 < err.min_peak_bytes <= manual["full"].peak_bytes
    assert rj.decisions_of(model) == {}
    prof = rj.profile(model, batch)
    assert set(prof.peak_breakdown) <= set(Category)
    assert sum(prof.peak_breakdown.values()) == prof.peak_bytes
    assert prof.peak_breakdown[Category.PARAMETERS] == prof.param_bytes
    assert prof.peak_breakdown[Category.GRADIENTS] == prof.grad_bytes
    assert prof.peak_breakdown[Category.BATCH] == prof.batch_bytes
    assert set(err.breakdown) <= set(Category)
    assert sum(err.breakdown.values()) == err.min_peak_bytes
    assert err.breakdown[Category.PARAMETERS] == prof.param_bytes
    assert err.cost is not None and err.cost.peak_bytes == err.min_peak_bytes


def test_bad_budget() -> None:
    model, batch, _ = setup()
    with pytest.raises(ValueError, match="budget"):
        rj.plan(model, batch, budget="lots")


def test_plan_json_roundtrip_and_framework() -> None:
    plan = planned(0.5)
    data = json.loads(plan.to_json())
    assert data["format"] == "remat.plan" and data["framework"] == "jax"
    assert data["version"] == 1
    assert rj.Plan.from_json(plan.to_json()) == plan
    assert "budget" in plan.summary()


def test_torch_plan_is_refused() -> None:
    from remat.core.cost import StepCost
    from remat.planning import Plan as TorchPlan

    torch_plan = TorchPlan(decisions={}, block_names=("blocks.0",), budget_bytes=1,
                           cost=StepCost(peak_bytes=1))
    with pytest.raises(ValueError, match="remat.Plan.from_json"):
        rj.Plan.from_json(torch_plan.to_json())
    with pytest.raises(ValueError, match="not a remat plan"):
        rj.Plan.from_json('{"format": "other"}')
    with pytest.raises(ValueError, match="version"):
        rj.Plan.from_json('{"format": "remat.plan", "framework": "jax", "version": 99}')
