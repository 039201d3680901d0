"""Plans never recompute more than a built-in strategy that fits: NOTE [ Never worse than
manual ] in remat/planning/manual.py.

On seeded random decoders (tests/generated_models.py) at 25/50/75% of the way from ``full``
to ``none``, each built-in strategy is measured as a user would run it (``remat.apply``,
a tracked step for its recompute, the allocator's first and steady step for its fit), and
the plan's executed recompute is at most the cheapest that fits.
"""

from __future__ import annotations

import copy
import warnings
from functools import cache
from typing import Any

import pytest
import torch

import remat
from remat.devices import get_device
from remat.errors import BlocksNotFound, StrategyError
from remat.measure import profile
from remat.measure.profile import first_step_peak
from remat.measure.step import Step
from remat.planning import PlanContext, prepare
from remat.planning.manual import manual_options
from remat.planning.recompute_cost import recompute_ms
from remat.strategies.builtin import Full

pytest.importorskip("transformers")

#: Three two-layer draws (tests/generated_models.py): parallel attention + MLP, a mixture
#: of experts with a tied head, GQA with dropout.
SEEDS = (2001, 1002, 1)
FRACTIONS = (0.25, 0.5, 0.75)
MANUAL = ("full", "every:2", "every:3", "every:4", "sqrt", "attn", "mlp", "ops")


def _measured(pristine: torch.nn.Module, batch: Any, strategy: str) -> tuple[int, float]:
    """A built-in strategy's tracked peak and executed recompute (roofline, H100 ms)."""
    model = copy.deepcopy(pristine)
    remat.apply(model, strategy)
    prof = profile(model, batch, timing=False)
    return prof.peak_bytes, recompute_ms(prof.ops, get_device("h100-80gb"))


def _allocator_fit(pristine: torch.nn.Module, batch: Any, strategy: str) -> int:
    """The allocator's peak of the first and a steady step of a fresh copy."""
    model = copy.deepcopy(pristine)
    remat.apply(model, strategy)
    step = Step(model, batch)
    return max(first_step_peak(step), first_step_peak(step))  # the first, then a steady one


@cache
def _prepared(seed: int) -> tuple[Any, PlanContext]:
    from generated_models import generated_model

    drawn = generated_model(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return drawn, prepare(drawn.model, drawn.batch)


@pytest.mark.parametrize("seed", SEEDS)
def test_plans_are_never_dearer_than_a_fitting_builtin_strategy(seed: int) -> None:
    drawn, context = _prepared(seed)
    pristine, batch = drawn.model, drawn.batch
    model = copy.deepcopy(pristine)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manual: dict[str, tuple[int, float]] = {}
        for name in MANUAL:
            try:
                manual[name] = _measured(pristine, batch, name)
            except (BlocksNotFound, StrategyError):
                continue  # no such sub-layer
        none_peak = profile(model, batch, timing=False).peak_bytes
        full_peak = manual["full"][0]
        for fraction in FRACTIONS:
            budget = int(full_peak + fraction * (none_peak - full_peak))
            plan = remat.plan(model, batch, budget=budget, context=context)
            assert plan.allocator_peak_bytes is not None
            assert plan.allocator_peak_bytes <= budget
            # only the strategies that could beat the plan need their allocator steps
            rivals = [n for n, (peak, ms) in manual.items()
                      if peak <= budget and ms < plan.recompute_ms * (1 - 1e-9)]
            fitting = [n for n in rivals if _allocator_fit(pristine, batch, n) <= budget]
            assert not fitting, (
                f"{drawn.label} at {fraction:.0%}: the plan recomputes "
                f"{plan.recompute_ms * 1e3:.3f} us ({plan.source}), but "
                + ", ".join(f"{n} fits and recomputes {manual[n][1] * 1e3:.3f} us"
                            for n in fitting))
            if plan.source != "planner":
                assert plan.source_note and plan.source in plan.source_note


def test_builtin_strategies_map_to_candidates() -> None:
    drawn, context = _prepared(1)  # qwen2, two layers
    blocks = Step(drawn.model, drawn.batch).blocks_found()
    options = {o.name: o for o in manual_options(context, blocks)}
    assert "sqrt" not in options and "none" not in options  # regions across blocks; nothing
    full = options["full"]
    assert full.choice is not None
    assert all(d == Full() for d in full.decisions.values())
    assert len(full.decisions) == len(blocks)
    every = options["every:2"]
    assert every.choice is not None
    assert [context.peak_model.tables[i][c].label() for i, c in enumerate(every.choice)] \
        == ["full", "none"]
    assert set(options["attn"].decisions) == {f"{name}.self_attn" for name, _ in blocks}


def test_a_cheaper_fitting_builtin_strategy_is_returned_with_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A solver that returns full everywhere (fits, recomputes the most): "ops" fits a budget
    # set at its own allocator peak and recomputes less, so a built-in strategy at most
    # as dear as "ops" wins, and the plan says which and why.
    from remat.planning import loop

    drawn, context = _prepared(1)
    model, batch = drawn.model, drawn.batch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        budget = _allocator_fit(model, batch, "ops")
        full = [next(i for i, c in enumerate(t) if c.label() == "full")
                for t in context.peak_model.tables]
        monkeypatch.setattr(loop, "close_loop_core", lambda *a, **k: full)
        plan = remat.plan(model, batch, budget=budget, context=context)
        full_ms, ops_ms = _measured(model, batch, "full")[1], _measured(model, batch, "ops")[1]
    assert plan.source in MANUAL, (plan.source, plan.label())
    assert plan.source_note is not None and plan.source in plan.source_note
    assert plan.recompute_ms <= ops_ms * (1 + 1e-9) < full_ms
    assert plan.allocator_peak_bytes is not None and plan.allocator_peak_bytes <= budget
    again = remat.Plan.from_json(plan.to_json())
    assert (again.source, again.source_note) == (plan.source, plan.source_note)
