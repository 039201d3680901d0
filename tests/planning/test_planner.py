"""remat.plan / remat.auto: what the issue says must hold, on the tiny presets (CPU, float32)."""

from __future__ import annotations

import dataclasses
import time
import warnings
from functools import cache

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remat.core.cost import Category
from remat.core.peak import PeakModel
from remat.core.solver import choice_cost_ps, solve
from remat.errors import BudgetTooSmall
from remat.measure import profile
from remat.measure.profile import profile_step
from remat.measure.step import Step
from remat.models import build_model, make_batch
from remat.planning import Plan, ThroughputSearch, auto, plan, plan_throughput
from remat.report.plan import plan_text
from remat.strategies import applied, apply, remove
from remat.validation import validate

from .conftest import BATCH, Prepared, prepared

FRACTIONS = (0.25, 0.5, 0.75)


@cache
def planned_at(preset: str, fraction: float) -> Plan:
    """The plan of ``preset`` for ``budget_at(fraction)`` on its shared context (planned
    once: several tests below check the same plan)."""
    tiny = prepared(preset)
    result = plan(tiny.model, tiny.batch, budget=tiny.budget_at(fraction), context=tiny.context)
    assert applied(tiny.model) is None  # plan() leaves the model as it was
    return result


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_plan_fits_and_beats_every_manual_strategy(tiny: Prepared, fraction: float) -> None:
    budget = tiny.budget_at(fraction)
    result = planned_at(tiny.preset, fraction)
    assert result.budget_bytes == budget
    assert result.measured_peak_bytes is not None
    assert result.measured_peak_bytes <= budget, (
        f"{tiny.preset} at {fraction:.0%}: measured peak {result.measured_peak_bytes} B > "
        f"budget {budget} B"
    )
    # The peak model is exact on these models: prediction == measurement.
    assert result.predicted_peak_bytes == result.measured_peak_bytes
    fitting = [p for p in tiny.manual.points if p.peak_bytes <= budget]
    best = min(fitting, key=lambda p: p.recompute_ms)
    assert result.recompute_ms <= best.recompute_ms * (1 + 1e-9), (
        f"{tiny.preset} at {fraction:.0%}: plan recomputes {result.recompute_ms:.3e} ms, best "
        f"manual strategy that fits ({best.name}) {best.recompute_ms:.3e} ms"
    )


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_plan_keeps_gradients_exact(tiny: Prepared, fraction: float) -> None:
    result = planned_at(tiny.preset, fraction)  # (planned_at checks the model is left as it was)
    report = validate(tiny.model, tiny.batch, result)
    assert report.max_rel_error <= 1e-6, (report.worst_param, report.max_rel_error)
    assert applied(tiny.model) is None  # validate() leaves it as it was too


def test_dropout_gradients_match_with_a_sub_layer_plan() -> None:
    prep = prepared("gpt-tiny")  # dropout 0.1: recomputation must replay the same masks
    result = planned_at("gpt-tiny", 0.5)
    assert result.decisions  # something is recomputed
    report = validate(prep.model, prep.batch, result)
    assert report.passed, (report.worst_param, report.max_rel_error)


def test_budget_above_the_uncheckpointed_peak_gives_the_empty_plan(tiny: Prepared) -> None:
    result = plan(tiny.model, tiny.batch, budget=tiny.none_peak + 1, context=tiny.context)
    assert result.is_empty and dict(result.decisions) == {}
    assert result.recompute_flops == 0 and result.recompute_ms == 0.0
    assert result.measured_peak_bytes == tiny.none_peak
    percent = plan(tiny.model, tiny.batch, budget="150%", context=tiny.context)
    assert percent.is_empty and percent.budget_bytes == int(1.5 * tiny.none_peak)


def test_percent_budget_is_relative_to_the_uncheckpointed_peak(gpt_tiny: Prepared) -> None:
    result = plan(gpt_tiny.model, gpt_tiny.batch, budget="80%", context=gpt_tiny.context)
    assert result.no_checkpoint_peak_bytes == gpt_tiny.none_peak
    assert result.budget_bytes == int(0.8 * gpt_tiny.none_peak)
    assert result.measured_peak_bytes is not None
    assert result.measured_peak_bytes <= result.budget_bytes


def test_an_activations_budget_keeps_the_static_bytes_and_a_share_of_the_rest(
        gpt_tiny: Prepared) -> None:
    ctx = gpt_tiny.context
    peak, static = ctx.no_checkpoint_peak_bytes, ctx.static_bytes
    assert 0 < static < peak
    assert static == sum(v for k, v in prof_breakdown(gpt_tiny).items()
                         if k in ("parameters", "buffers", "gradients", "optimizer_state",
                                  "batch"))
    result = plan(gpt_tiny.model, gpt_tiny.batch, budget="activations:85%", context=ctx)
    assert result.budget_bytes == static + int(0.85 * (peak - static))
    assert result.measured_peak_bytes is not None
    assert result.measured_peak_bytes <= result.budget_bytes


def prof_breakdown(prepared: Prepared) -> dict[str, int]:
    """The un-checkpointed profile's bytes by category at its peak."""
    return dict(profile(prepared.model, prepared.batch, timing=False).peak_breakdown)


@cache
def too_small_at_10_percent(preset: str) -> BudgetTooSmall:
    """The error of planning ``preset`` for 10% of its peak (raised once per preset: the
    two tests below read the same error)."""
    tiny = prepared(preset)
    with pytest.raises(BudgetTooSmall) as info:
        plan(tiny.model, tiny.batch, budget="10%", context=tiny.context)
    return info.value


def test_budget_too_small_names_the_other_budget_form(tiny: Prepared) -> None:
    ctx = tiny.context
    lines = str(too_small_at_10_percent(tiny.preset)).splitlines()
    assert "  budget given as: 10%" in lines
    share = 100 * (int(0.1 * ctx.no_checkpoint_peak_bytes) - ctx.static_bytes) / (
        ctx.no_checkpoint_peak_bytes - ctx.static_bytes)
    expected = f"activations:{share:.3g}%" if share > 0 else "below the static bytes"
    assert any(line.startswith(f"  the same budget: {expected}") for line in lines), lines
    with pytest.raises(BudgetTooSmall) as info:
        plan(tiny.model, tiny.batch, budget="activations:1%", context=ctx)
    lines = str(info.value).splitlines()
    assert "  budget given as: activations:1%" in lines
    percent = 100 * info.value.budget_bytes / ctx.no_checkpoint_peak_bytes
    assert f"  the same budget: {percent:.3g}% of the peak" in lines


def test_budget_too_small_names_the_smallest_peak_and_what_dominates(tiny: Prepared) -> None:
    err = too_small_at_10_percent(tiny.preset)
    assert err.budget_bytes == int(0.1 * tiny.none_peak)
    # The smallest reachable peak is the allocator's (NOTE [ Fits on the allocator ]): at
    # most full's on the allocator, which is full's tracked peak plus kernel scratch.
    apply(tiny.model, "full")
    try:
        full = profile_step(Step(tiny.model, tiny.batch), timing=False, allocator=True)
    finally:
        remove(tiny.model)
    assert full.allocator_peak_bytes is not None
    assert full.allocator_peak_bytes >= err.min_peak_bytes > err.budget_bytes
    assert err.breakdown["parameters"] == profile(tiny.model, tiny.batch,
                                                  timing=False).param_bytes
    message = str(err)
    assert message.startswith("remat.plan: no checkpointing plan fits a budget of")
    assert f"({err.min_peak_bytes} B" in message and "dominated by" in message
    assert message.splitlines()[-1].startswith("  fix: raise the budget to at least")
    # The smallest reachable peak is reachable: planning for it succeeds.
    # (min_peak_bytes is the allocator's figure: NOTE [ Fits on the allocator ].)
    at_min = plan(tiny.model, tiny.batch, budget=err.min_peak_bytes, context=tiny.context)
    assert at_min.allocator_peak_bytes is not None and at_min.measured_peak_bytes is not None
    # (the lowest choices measured for the message; the loop may find one lower still)
    assert max(at_min.measured_peak_bytes, at_min.allocator_peak_bytes) <= err.min_peak_bytes


def test_budget_too_small_reports_optimizer_state() -> None:
    torch.manual_seed(0)
    model = build_model("llama-tiny")
    batch = make_batch(model, 1, 8)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(BudgetTooSmall) as info:
        plan(model, batch, budget="30%", optimizer=opt, simulate=True)
    err = info.value
    breakdown = err.breakdown
    params = breakdown["parameters"]
    assert 2 * params <= breakdown["optimizer_state"] < 2 * params + 1024  # m, v and steps
    assert "optimizer state" in str(err)
    assert not opt.state  # the planner ran on fake copies
    # Every source's breakdown uses Category (tests/core/test_cost.py): the error's is the
    # cost at its smallest peak, by category.
    assert all(type(k) is Category for k in breakdown)
    assert sum(breakdown.values()) == err.min_peak_bytes
    assert err.cost is not None and err.cost.peak_bytes == err.min_peak_bytes
    assert breakdown[Category.PARAMETERS] == err.cost.param_bytes > 0


def _optimistic(pm: PeakModel, lie: int) -> PeakModel:
    """``pm`` claiming every checkpointing candidate keeps ``lie`` bytes less than it does
    (more, for a negative ``lie``)."""
    tables = tuple(
        tuple(c if c.is_none else dataclasses.replace(
            c, saved_bytes=max(c.saved_bytes - lie, 0),
            forward_peak_bytes=max(c.forward_peak_bytes - lie, 0),
            backward_peak_bytes=max(c.backward_peak_bytes - lie, 0)) for c in table)
        for table in pm.tables
    )
    return dataclasses.replace(pm, tables=tables)


def test_closed_loop_tightens_when_the_model_under_predicts(gpt_tiny: Prepared) -> None:
    # A peak model that under-predicts: its first choice for the budget is over budget when
    # measured, and the loop must tighten and solve again until the measurement fits.
    pm = gpt_tiny.context.peak_model
    budget = gpt_tiny.budget_at(0.5)
    for lie in (8 * 1024, 32 * 1024, 128 * 1024):
        optimistic = _optimistic(pm, lie)
        first = solve(optimistic, budget)
        if first is not None and pm.predict(first) > budget:
            break
    else:
        pytest.fail("no lie made the first choice exceed the budget")
    context = dataclasses.replace(gpt_tiny.context, peak_model=optimistic)
    result = plan(gpt_tiny.model, gpt_tiny.batch, budget=budget, context=context)
    assert result.measured_peak_bytes is not None
    assert result.measured_peak_bytes <= budget


def test_a_budget_full_checkpointing_meets_is_planned_even_when_over_predicted(
    tiny: Prepared,
) -> None:
    # A peak model that over-predicts every checkpointing candidate finds no choice for a
    # budget equal to the measured full-checkpoint peak; the loop must measure the lowest
    # choices themselves and return one that fits, not raise BudgetTooSmall.
    pessimistic = _optimistic(tiny.context.peak_model, -tiny.none_peak)
    assert solve(pessimistic, tiny.full_peak) is None
    context = dataclasses.replace(tiny.context, peak_model=pessimistic)
    result = plan(tiny.model, tiny.batch, budget=tiny.full_peak, context=context)
    assert result.measured_peak_bytes is not None
    assert result.measured_peak_bytes <= tiny.full_peak


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a=st.floats(0.0, 1.2), b=st.floats(0.0, 1.2))
def test_more_budget_never_costs_more_recompute(a: float, b: float) -> None:
    prep = prepared("llama-tiny")
    low, high = sorted((prep.budget_at(a), prep.budget_at(b)))
    pm = prep.context.peak_model
    cheap, dear = solve(pm, high), solve(pm, low)
    if dear is None:
        return
    assert cheap is not None  # anything that fits the lower budget fits the higher one
    assert pm.predict(cheap) <= high and pm.predict(dear) <= low
    assert choice_cost_ps(pm, cheap) <= choice_cost_ps(pm, dear)


def test_more_budget_never_costs_more_measured_recompute(gpt_tiny: Prepared) -> None:
    costs = []
    # Five budgets from tight to above the no-checkpoint peak; the middle three are the
    # plans the tests above already made (planned_at), the same calls on the same context.
    for fraction in (0.1, *FRACTIONS, 1.2):
        result = planned_at("gpt-tiny", fraction) if fraction in FRACTIONS else plan(
            gpt_tiny.model, gpt_tiny.batch, budget=gpt_tiny.budget_at(fraction),
            context=gpt_tiny.context)
        costs.append(result.recompute_ms)
    assert costs == sorted(costs, reverse=True), costs


def test_planning_a_12_layer_model_takes_under_30_seconds() -> None:
    torch.manual_seed(0)
    model = build_model("gpt-tiny", n_layer=12)
    batch = make_batch(model, BATCH)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = plan(model, batch, budget="85%")
    elapsed = time.perf_counter() - start
    assert elapsed < 30.0, f"planning 12 layers took {elapsed:.1f} s"
    assert len(result.block_names) == 12
    assert result.measured_peak_bytes is not None
    assert result.measured_peak_bytes <= result.budget_bytes


def test_auto_applies_the_plan_and_returns_its_measured_peak() -> None:
    # The shared llama-tiny context: this model is its model's twin (same seed, same batch),
    # so auto plans what it would measure itself; what is tested is that it applies the plan.
    prep = prepared("llama-tiny")
    torch.manual_seed(0)
    model = build_model("llama-tiny")
    batch = prep.batch
    result = auto(model, batch, budget="90%", context=prep.context)
    info = applied(model)
    assert info is not None and info.strategy == "plan"
    assert profile(model, batch, timing=False).peak_bytes == result.measured_peak_bytes
    assert result.measured_peak_bytes is not None
    assert result.measured_peak_bytes <= result.budget_bytes
    remove(model)


def test_plan_from_json_applies_to_a_fresh_model(gpt_tiny: Prepared) -> None:
    result = planned_at("gpt-tiny", 0.25)
    restored = Plan.from_json(result.to_json())
    torch.manual_seed(0)
    fresh = build_model("gpt-tiny")
    report = validate(fresh, gpt_tiny.batch, restored)
    assert report.passed
    from remat.strategies import apply

    apply(fresh, restored)
    assert profile(fresh, gpt_tiny.batch, timing=False).peak_bytes == result.measured_peak_bytes


def test_simulated_closed_loop_matches_the_real_one(gpt_tiny: Prepared) -> None:
    budget = gpt_tiny.budget_at(0.5)
    real = planned_at("gpt-tiny", 0.5)
    fake = plan(gpt_tiny.model, gpt_tiny.batch, budget=budget, context=gpt_tiny.context,
                simulate=True)
    assert fake.decisions == real.decisions
    assert fake.measured_peak_bytes == real.measured_peak_bytes


def test_throughput_search_reports_a_table_and_picks_the_best() -> None:
    torch.manual_seed(0)
    model = build_model("gpt-tiny", n_layer=2, dropout=0.0)
    budget = profile(model, make_batch(model, 3, 16), simulate=True).peak_bytes

    def batch_of(n: int) -> dict[str, torch.Tensor]:
        batch: dict[str, torch.Tensor] = make_batch(model, n, 16)
        return batch

    result = plan_throughput(model, batch_of, budget=budget, simulate=True,
                             search=ThroughputSearch(max_batch_size=4))
    sizes = [row.batch_size for row in result.throughput]
    assert {1, 2, 4} <= set(sizes) and sizes == sorted(sizes) and max(sizes) == 4
    fitting = [row for row in result.throughput if row.fits]
    assert all(row.fits for row in result.throughput if row.batch_size <= 3)
    best = max(fitting, key=lambda row: row.samples_per_s)
    assert result.batch_size == best.batch_size >= 3  # more samples pay for the recompute
    assert result.measured_peak_bytes is not None and result.measured_peak_bytes <= budget
    for row in fitting:
        assert row.peak_bytes <= budget
        assert row.samples_per_s == pytest.approx(row.batch_size / row.step_ms * 1e3)
    assert "Throughput search" in plan_text(result)


def test_bad_arguments_raise_clear_errors(gpt_tiny: Prepared) -> None:
    with pytest.raises(TypeError, match="function n -> batch"):
        plan_throughput(gpt_tiny.model, gpt_tiny.batch, budget="50%")
    with pytest.raises(TypeError, match="remat.plan_throughput"):
        plan(gpt_tiny.model, lambda n: gpt_tiny.batch, budget="50%")
    with pytest.raises(ValueError, match="max_batch_size must be an int >= 1"):
        ThroughputSearch(max_batch_size=0)
    with pytest.raises(ValueError, match="cannot read budget"):
        plan(gpt_tiny.model, gpt_tiny.batch, budget="lots")
    model = build_model("gpt-tiny").eval()
    with pytest.raises(ValueError, match="eval mode"):
        plan(model, gpt_tiny.batch, budget="50%")


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_closed_loop_on_the_fake_copy_matches_the_measured_one(tiny: Prepared,
                                                               fraction: float) -> None:
    """NOTE [ Closed loop on the fake copy ]: the fast path against real measured steps."""
    from remat.measure.step import Step
    from remat.planning.loop import close_loop

    budget = tiny.budget_at(fraction)
    step = Step(tiny.model, tiny.batch)
    fast = close_loop(step, tiny.context, budget, simulate=False)
    exact = close_loop(step, tiny.context, budget, simulate=False, fake_loop=False)
    assert fast.decisions == exact.decisions
    assert fast.measured_peak_bytes == exact.measured_peak_bytes
    assert fast.recompute_flops == exact.recompute_flops
    assert fast.recompute_ms == pytest.approx(exact.recompute_ms)


def test_a_byte_budget_without_an_optimizer_warns_with_what_adamw_would_add() -> None:
    # NOTE [ A byte budget without an optimizer ]: a plan in bytes promises the job fits,
    # and the job's optimizer state is not in a step planned without it.
    from remat.errors import RematWarning

    model = build_model("gpt-tiny")
    batch = make_batch(model, 2)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters())
    roomy = 1 << 30  # above the un-checkpointed peak: the empty plan, no closed loop
    for budget in (roomy, "1GiB"):
        with pytest.warns(RematWarning, match="and no optimizer") as caught:
            plan(model, batch, budget=budget)
        text = next(str(w.message) for w in caught if "no optimizer" in str(w.message))
        assert text.startswith("remat.plan: a budget of") and f"{2 * trainable:,} B" in text
    with pytest.warns(RematWarning, match="^remat.auto: a budget of"):  # the user's call
        auto(model, batch, budget=roomy)
    remove(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no optimizer", category=Warning)
        plan(model, batch, budget=roomy,
             optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
        plan(model, batch, budget="95%")
