"""remat.plan(..., compile=True): plans for the step as it runs compiled, on real tensors.

Inductor compiles are slow on CPU, so the candidates are measured once per module
(three of them: the compiler alone at budgets 1.0 and 0.5, remat's full checkpoint)
and every test plans from that context; the model is two residual MLP blocks.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

import remat
from remat.compiled.candidates import (
    CompiledCandidate,
    CompiledContext,
    measure_whole,
    prepare_compiled,
)
from remat.compiled.measure import compiled_regions, measure_compiled
from remat.compiled.plan import plan_compiled_step, predict_peak
from remat.core.cost import Category, StepCost
from remat.measure.step import Step
from remat.planning.options import PlanOptions
from remat.planning.plans import PLAN_FORMAT_VERSION, Plan
from remat.report.plan import plan_text
from remat.strategies.apply import applied
from remat.strategies.builtin import Full, NoCheckpoint
from tiny_nets import D, Net
from tiny_nets import net as _net

BATCH = torch.randn(256, D, generator=torch.Generator().manual_seed(1))
CANDIDATES = (
    CompiledCandidate(NoCheckpoint(), 1.0),
    CompiledCandidate(NoCheckpoint(), 0.5),
    CompiledCandidate(Full(), 1.0),
)


@pytest.fixture(scope="module")
def model() -> Net:
    torch._dynamo.reset()  # dynamo's entries for Module._call_impl are process-wide
    return _net()


@pytest.fixture(scope="module")
def ctx(model: Net) -> CompiledContext:
    return prepare_compiled(Step(model, BATCH), CANDIDATES, whole_budgets=())


def _plan(model: Net, ctx: CompiledContext, budget: int | str) -> Plan:
    return plan_compiled_step(Step(model, BATCH), PlanOptions(budget=budget), context=ctx)


def test_candidates_measured_compiled(model: Net, ctx: CompiledContext) -> None:
    assert all(m.new_graphs == 0 and not m.eager_regions and m.counted for m in ctx.uniform)
    assert all(m.regions == ("blocks.0", "blocks.1") for m in ctx.uniform)
    assert not compiled_regions(model)  # planning leaves the model eager
    assert applied(model) is None
    peaks = [m.peak_bytes for m in ctx.uniform]
    assert peaks[1] < peaks[0] and peaks[2] < peaks[0]  # budget 0.5 and full save memory
    assert sum(ctx.recompute_flops[2]) > 0 == sum(ctx.recompute_flops[0])
    for index in range(len(CANDIDATES)):  # the peak model is exact on uniform assignments
        assert predict_peak(ctx, (index, index)) == peaks[index]


def test_full_budget_is_the_compilers_default(model: Net, ctx: CompiledContext) -> None:
    plan = _plan(model, ctx, "100%")
    assert plan.is_empty and plan.compiled == {"blocks.0": 1.0, "blocks.1": 1.0}
    assert plan.measured_peak_bytes == ctx.no_checkpoint_peak_bytes


def test_plan_fits_the_compilers_own_peak_and_more_budget_is_never_costlier(
        model: Net, ctx: CompiledContext) -> None:
    budgets = sorted({m.peak_bytes for m in ctx.uniform} | {ctx.no_checkpoint_peak_bytes + 1})
    costs = []
    for budget in budgets:
        plan = _plan(model, ctx, budget)
        assert plan.measured_peak_bytes is not None
        assert plan.measured_peak_bytes <= plan.budget_bytes == budget, plan_text(plan)
        costs.append((plan.recompute_flops, plan.recompute_ms))
    assert costs == sorted(costs, reverse=True), costs


def test_too_small_gives_the_lowest_measured_peak(model: Net, ctx: CompiledContext) -> None:
    lowest = min(ctx.measured.values())
    with pytest.raises(remat.BudgetTooSmall, match="plan_compiled") as info:
        _plan(model, ctx, lowest - 1)
    assert info.value.min_peak_bytes == lowest
    # the same categories as the eager planner: static ones, the step's own bytes unsplit
    breakdown = info.value.breakdown
    assert set(breakdown) <= set(Category) and Category.PARAMETERS in breakdown
    assert sum(breakdown.values()) == lowest
    assert breakdown[Category.STEP_TEMPORARIES] == lowest - ctx.static_bytes


def test_apply_of_loaded_plan_compiles_and_keeps_gradients(model: Net,
                                                           ctx: CompiledContext) -> None:
    budget = ctx.uniform[1].peak_bytes  # the compiler's own peak at budget 0.5
    plan = remat.plan_compiled(model, BATCH, budget=budget, context=ctx)
    assert plan.compiled is not None and plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes <= budget
    data = json.loads(plan.to_json())
    assert data["compiled"] == dict(plan.compiled) and data["version"] == PLAN_FORMAT_VERSION
    loaded = Plan.from_json(plan.to_json())
    assert loaded.compiled == plan.compiled and loaded.decisions == plan.decisions

    reference, planned = _net(), _net()
    remat.apply(planned, loaded)
    assert [name for name, _ in compiled_regions(planned)] == ["blocks.0", "blocks.1"]
    measured = measure_compiled(planned, BATCH, timing=False)
    assert measured.new_graphs == 0 and not measured.eager_regions
    assert measured.peak_bytes <= budget
    reference(BATCH).backward()
    planned(BATCH).backward()
    for (name, p), q in zip(reference.named_parameters(), planned.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)

    remat.remove(planned)  # runs eagerly again, with its own forwards
    assert compiled_regions(planned) == []
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in planned.modules())


def test_plan_json_without_compiled_is_eager() -> None:
    plan = Plan(decisions={}, block_names=("a", "b"), budget_bytes=10, cost=StepCost(peak_bytes=5))
    data = plan.to_dict()
    assert data["compiled"] is None
    del data["compiled"]  # a file written before compiled plans existed
    assert Plan.from_dict(data).compiled is None
    with pytest.raises(ValueError,
                       match=r"(?s)^Plan: compiled names 'z', which is not a block.*fix: name"):
        Plan(decisions={}, block_names=("a",), budget_bytes=1, cost=StepCost(peak_bytes=1),
             compiled={"z": 0.5})
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Plan(decisions={}, block_names=("a",), budget_bytes=1, cost=StepCost(peak_bytes=1),
             compiled={"a": 1.5})


def test_compile_refuses_simulate() -> None:
    with pytest.raises(ValueError, match="simulate"):
        plan_compiled_step(Step(_net(), BATCH), PlanOptions(budget="50%", simulate=True))


def test_copy_of_plan_keeps_compiled(model: Net, ctx: CompiledContext) -> None:
    plan = _plan(model, ctx, "100%")
    assert copy.deepcopy(plan).compiled == plan.compiled


def test_summary_and_equality_know_the_compile(model: Net, ctx: CompiledContext) -> None:
    plan = _plan(model, ctx, "100%")
    assert "Compiled, activation memory budget" in plan_text(plan)
    assert "1 x2" in plan_text(plan)
    assert plan != Plan.from_dict({**plan.to_dict(), "compiled": None})


def test_a_candidate_the_compiler_fails_on_is_skipped_with_a_warning(
        model: Net, monkeypatch: pytest.MonkeyPatch) -> None:
    import remat.compiled.candidates as cc

    real = cc.measure_assignment

    def flaky(step, names, cands, assignment, backends):  # type: ignore[no-untyped-def]
        if cands[assignment[0]].compiler_budget == 0.5:
            raise RuntimeError("inductor: an assertion failed")
        return real(step, names, cands, assignment, backends)

    monkeypatch.setattr(cc, "measure_assignment", flaky)
    with pytest.warns(remat.RematWarning, match=r"failed on candidate none@0.5"):
        ctx = prepare_compiled(Step(model, BATCH), CANDIDATES, whole_budgets=())
    assert [c.label() for c in ctx.candidates] == ["none@1", "full@1"]
    assert len(ctx.uniform) == len(ctx.saved) == 2


@pytest.mark.parametrize("setting", [1.0, 0.5])
def test_the_compilers_own_setting_is_a_plan_when_it_recomputes_least(
        model: Net, ctx: CompiledContext, setting: float) -> None:
    per_block = dataclasses.replace(ctx, measured=dict(ctx.measured), whole={})
    whole_ctx = dataclasses.replace(per_block, whole_budgets=(1.0, 0.5))
    # Budget: the whole model compiled at `setting`, measured as the planner measures it.
    budget = measure_whole(Step(model, BATCH), ctx.names, setting).peak_bytes
    plan = plan_compiled_step(Step(model, BATCH), PlanOptions(budget=budget), context=whole_ctx)
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= budget
    assert set(whole_ctx.whole) <= {1.0, 0.5}
    try:
        blocks_only = plan_compiled_step(Step(model, BATCH), PlanOptions(budget=budget),
                                    context=per_block)
    except remat.BudgetTooSmall:
        blocks_only = None
    assert plan.compiled is not None
    if "" in plan.compiled:  # the whole model won: it recomputes no more than blocks would
        assert blocks_only is None or plan.recompute_flops <= blocks_only.recompute_flops
        loaded = Plan.from_json(plan.to_json())
        assert loaded.compiled == plan.compiled and "whole model" in plan_text(plan)
        assert plan_text(plan).startswith("Compiled plan: the compiler's own setting")
        applied = remat.apply(_net(), loaded)
        assert [name for name, _ in compiled_regions(applied)] == [""]
        assert measure_compiled(applied, BATCH, timing=False).peak_bytes <= budget
        remat.remove(applied)
        assert compiled_regions(applied) == []
    else:  # a per-block plan won: it recomputes less than the first setting that fits
        assert blocks_only is not None and plan.compiled == blocks_only.compiled
        fitting = [whole_ctx.whole[b] for b in whole_ctx.whole_budgets
                   if b in whole_ctx.whole and whole_ctx.whole[b].peak_bytes <= budget]
        assert plan.recompute_flops < fitting[0].profile.recompute_flops
    # At the compiler's default the whole model wins on the tie (nothing recomputed).
    assert setting != 1.0 or plan.compiled == {"": 1.0}


def test_compiled_names_the_whole_model_or_blocks_not_both() -> None:
    with pytest.raises(ValueError, match=r"(?s)^Plan: .*fix: name the whole model or blocks"):
        Plan(decisions={}, block_names=("a", "b"), budget_bytes=10, cost=StepCost(peak_bytes=5),
             compiled={"": 0.5, "a": 1.0})
