"""StepCost validates one step's cost; every breakdown, whoever made it, uses Category."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from remat.core.cost import STATIC, Category, StepCost, static_bytes
from remat.errors import BudgetTooSmall

CATEGORIES = set(Category)


# ---- StepCost ------------------------------------------------------------------------------

def test_flops_are_derived_from_their_parts_and_checked_when_given() -> None:
    cost = StepCost(peak_bytes=10, forward_flops=3, backward_flops=5, recompute_flops=2)
    assert cost.flops == 10
    assert StepCost(peak_bytes=10, flops=7).flops == 7  # a row: no split kept
    assert StepCost(peak_bytes=10).flops is None  # a plan: no total known
    with pytest.raises(ValueError, match=r"^StepCost: flops \(11\) must equal"):
        StepCost(peak_bytes=10, forward_flops=3, backward_flops=5, recompute_flops=2, flops=11)
    with pytest.raises(ValueError, match=r"recompute_flops \(8\) exceeds flops \(7\)"):
        StepCost(peak_bytes=10, flops=7, recompute_flops=8)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("peak_bytes", -1, "StepCost: peak_bytes must be an int >= 0\n  found: -1"),
    ("param_bytes", 1.5, "StepCost: param_bytes must be an int >= 0\n  found: 1.5"),
    ("activation_bytes", True, "StepCost: activation_bytes must be an int >= 0\n  found: True"),
    ("forward_flops", -3, "StepCost: forward_flops must be an int >= 0 or None\n  found: -3"),
    ("step_ms", float("nan"), "StepCost: step_ms must be a finite number of ms >= 0"),
    ("recompute_ms", -1.0, "StepCost: recompute_ms must be a finite number of ms >= 0"),
])
def test_bad_figures_are_refused_with_the_value(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        StepCost(**{"peak_bytes": 0, field: value})  # type: ignore[arg-type]


def test_breakdown_keys_are_categories_and_sum_to_the_peak() -> None:
    cost = StepCost(peak_bytes=30, breakdown={"parameters": 10, Category.ACTIVATIONS: 20})
    assert set(cost.breakdown) == {Category.PARAMETERS, Category.ACTIVATIONS}
    assert all(type(k) is Category for k in cost.breakdown)
    assert cost.breakdown["parameters"] == 10  # a str enum: plain strings read it
    with pytest.raises(ValueError, match="^StepCost: breakdown key 'params' is not a Category"):
        StepCost(peak_bytes=10, breakdown={"params": 10})
    with pytest.raises(ValueError, match=r"^StepCost: breakdown sums to 9 B, not peak_bytes"):
        StepCost(peak_bytes=10, breakdown={"parameters": 9})
    with pytest.raises(ValueError, match=r"breakdown\['batch'\] must be an int >= 0"):
        StepCost(peak_bytes=0, breakdown={"batch": -1, "other": 1})


def test_step_cost_is_a_frozen_value() -> None:
    cost = StepCost(peak_bytes=5, breakdown={"other": 5}, step_ms=1.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cost.peak_bytes = 6  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(cost)) == cost
    assert dataclasses.replace(cost, step_ms=2.0).step_ms == 2.0
    assert dataclasses.asdict(cost)["breakdown"] == {"other": 5}
    assert f"{Category.OPTIMIZER_STATE}" == str(Category.OPTIMIZER_STATE) == "optimizer_state"


def test_budget_too_small_takes_a_breakdown_or_a_cost() -> None:
    cost = StepCost(peak_bytes=8, breakdown={"parameters": 3, "activations": 5})
    err = BudgetTooSmall("x", budget_bytes=1, min_peak_bytes=8, cost=cost)
    assert err.breakdown == {Category.PARAMETERS: 3, Category.ACTIVATIONS: 5}
    assert err.cost is cost
    assert BudgetTooSmall("x", budget_bytes=1, min_peak_bytes=8).breakdown == {}


# ---- every source uses the same categories -----------------------------------------------

def test_eager_profile_breakdowns_are_categories_summing_to_their_peaks() -> None:
    import torch

    import remat
    from remat.models import build_model, make_batch

    torch.manual_seed(0)
    model = build_model("gpt-tiny")
    optimizer = torch.optim.AdamW(model.parameters())
    for simulate in (False, True):
        prof = remat.profile(model, make_batch(model, 2), optimizer=optimizer, timing=False,
                             simulate=simulate)
        assert set(prof.peak_breakdown) <= CATEGORIES
        assert sum(prof.peak_breakdown.values()) == prof.peak_bytes
        assert prof.peak_breakdown[Category.PARAMETERS] == prof.param_bytes
        assert prof.peak_breakdown[Category.OPTIMIZER_STATE] == prof.optimizer_bytes
        for phase in prof.phase_peaks.values():
            assert set(phase.breakdown) <= CATEGORIES
            assert sum(phase.breakdown.values()) == phase.peak_bytes


# The eager planner's BudgetTooSmall uses the same categories, its breakdown the cost at
# min_peak_bytes: checked in
# tests/planning/test_planner.py::test_budget_too_small_reports_optimizer_state, on the
# simulated plan that test makes anyway (the same error, from the same planner path).

# remat.jax's profile and planner error use the same categories: checked in
# tests/jax/test_planner.py::test_budget_too_small, on the error that module's planner
# test builds anyway (a JAX plan that runs its whole loop before BudgetTooSmall).


# ---- static bytes: one definition (NOTE [ Static bytes ]) --------------------------------

def test_static_bytes_are_the_static_categories_batch_included() -> None:
    assert set(STATIC) == {Category.PARAMETERS, Category.BUFFERS, Category.GRADIENTS,
                           Category.OPTIMIZER_STATE, Category.BATCH}
    breakdown = {Category.PARAMETERS: 100, Category.BUFFERS: 1, Category.GRADIENTS: 10,
                 Category.OPTIMIZER_STATE: 20, Category.BATCH: 8, Category.ACTIVATIONS: 50,
                 Category.OTHER: 3}
    assert static_bytes(breakdown) == 139
    cost = StepCost(peak_bytes=0, param_bytes=100, buffer_bytes=1, grad_bytes=10,
                    optimizer_bytes=20, batch_bytes=8, activation_bytes=50)
    assert cost.held == {c: v for c, v in breakdown.items() if c != Category.OTHER}
    assert cost.static_bytes == static_bytes(cost.held) == 139
    assert StepCost(peak_bytes=0).held == {}


@pytest.fixture(scope="module")
def tiny() -> Any:
    """A two-block net's step (no optimizer): its profile and its planner context."""
    import torch

    import remat
    from remat.planning.context import prepare
    from tiny_nets import net

    model = net()
    torch.manual_seed(1)
    batch = torch.randn(32, 64)

    def loss(out: Any, _batch: Any) -> Any:
        return out

    prof = remat.profile(model, batch, loss_fn=loss, timing=False)
    ctx = prepare(model, batch, loss_fn=loss)
    return SimpleNamespace(model=model, batch=batch, loss=loss, prof=prof, ctx=ctx)


def test_a_steps_figures_and_its_peaks_are_different_moments(tiny: Any) -> None:
    # NOTE [ A step's bytes and its peak's ]: a peak inside backward holds part of the
    # gradients and of the activations; parameters and batch are whole all step.
    prof = tiny.prof
    peak = prof.peak_breakdown
    assert prof.peak_phase == "backward"
    assert peak[Category.PARAMETERS] == prof.param_bytes > 0
    assert peak[Category.BATCH] == prof.batch_bytes == 32 * 64 * 4
    assert 0 < peak[Category.GRADIENTS] < prof.grad_bytes == prof.param_bytes
    assert 0 < peak[Category.ACTIVATIONS] < prof.activation_bytes


def test_every_static_figure_is_static_bytes_of_one_breakdown(tiny: Any) -> None:
    from remat.distributed.pipeline_rank import measure_chunk
    from remat.planning.planner import plan
    from remat.simulate.point import static_parts
    from remat.simulate.result import SimulationRow

    prof, ctx = tiny.prof, tiny.ctx
    # the planner's: at the un-checkpointed peak (a fake step's bytes are a real one's on CPU)
    assert ctx.static_bytes == static_bytes(prof.peak_breakdown)
    # the step's own: every gradient, the batch included
    step_static = 2 * prof.param_bytes + prof.batch_bytes
    assert prof.static_bytes == static_bytes(prof.cost.held) == step_static
    # a pipeline chunk's: the step's, its gradients a named part of it
    empty = plan(tiny.model, tiny.batch, budget=2 * ctx.no_checkpoint_peak_bytes,
                 loss_fn=tiny.loss, context=ctx)
    chunk = measure_chunk(ctx.setup, empty, tiny.loss)
    assert chunk.static_bytes == step_static
    assert chunk.grad_bytes == prof.grad_bytes
    assert chunk.before_backward_bytes == step_static - prof.cost.held[Category.GRADIENTS]
    # remat simulate's per-rank budgets: the static categories they translate, by category
    timed = dataclasses.replace(prof.cost, step_ms=1.0, recompute_ms=0.0)
    row = SimulationRow(strategy="none", batch_size=32, seq_len=1, cost=timed, fits=True,
                        samples_per_s=0.0, tokens_per_s=0.0,
                        single_device_peak_bytes=prof.peak_bytes)
    parts = static_parts(SimpleNamespace(sharding="none"), [row], 32, 1)  # type: ignore[arg-type]
    assert parts == {Category.PARAMETERS: prof.param_bytes,
                     Category.GRADIENTS: prof.grad_bytes, Category.OPTIMIZER_STATE: 0}
    assert static_bytes(parts) == step_static - prof.batch_bytes


# ---- StepCost in files ---------------------------------------------------------------------

def test_step_cost_round_trips_through_row_files(tiny: Any) -> None:
    from remat.core.rows import StrategyRow
    from remat.simulate.result import SimulationRow

    cost = dataclasses.replace(tiny.prof.cost, breakdown={}, forward_flops=None,
                               backward_flops=None, forward_ms=None, backward_ms=None,
                               batch_bytes=0, buffer_bytes=0, step_ms=1.0, recompute_ms=0.0)
    sim = SimulationRow(strategy="none", batch_size=32, seq_len=1, cost=cost, fits=True,
                        samples_per_s=1.0, tokens_per_s=1.0, single_device_peak_bytes=7)
    assert SimulationRow.from_dict(sim.to_dict()) == sim
    row = StrategyRow(strategy="none", cost=dataclasses.replace(
        cost, optimizer_bytes=0, recompute_ms=None), peak_change_pct=0.0,
        activation_change_pct=0.0, recompute_overhead_pct=0.0, step_time_ratio=None)
    back = StrategyRow.from_dict(row.to_dict())
    assert back.cost == row.cost and back.cost.static_bytes == row.cost.static_bytes


def test_a_plan_file_written_before_reads_its_peaks_by_name() -> None:
    from remat.planning.plans import Plan

    text = (Path(__file__).parent / "plan_v2_main.json").read_text()
    plan = Plan.from_json(text)
    assert plan.predicted_peak_bytes == plan.cost.peak_bytes == 3249160
    assert plan.measured_peak_bytes == plan.allocator_peak_bytes == 3249160
    assert plan.measured_or_predicted_peak_bytes == plan.measured_peak_bytes
    assert not hasattr(plan, "peak_bytes")  # a plan's peak says which it is
    assert Plan.from_json(plan.to_json()) == plan
    unmeasured = dataclasses.replace(plan, measured_peak_bytes=None)
    assert unmeasured.measured_or_predicted_peak_bytes == plan.predicted_peak_bytes
