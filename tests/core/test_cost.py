"""StepCost validates one step's cost; every breakdown, whoever made it, uses Category."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from remat.core.cost import Category, StepCost
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


def test_eager_planner_budget_too_small_breakdown_is_the_min_peak() -> None:
    import torch

    import remat
    from remat.models import build_model, make_batch

    torch.manual_seed(0)
    model = build_model("gpt-tiny")
    with pytest.raises(BudgetTooSmall) as info:
        remat.plan(model, make_batch(model, 2), budget=1000, simulate=True)
    err = info.value
    assert set(err.breakdown) <= CATEGORIES
    assert all(type(k) is Category for k in err.breakdown)
    assert sum(err.breakdown.values()) == err.min_peak_bytes
    assert err.cost is not None and err.cost.peak_bytes == err.min_peak_bytes
    assert err.breakdown[Category.PARAMETERS] == err.cost.param_bytes > 0


def test_jax_profile_and_planner_use_the_same_categories() -> None:
    pytest.importorskip("jax")
    pytest.importorskip("flax")
    import remat.jax as rj
    from remat.jax.models import GPTConfig

    tiny = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_seq_len=32)
    model = rj.build_model(tiny)
    batch = rj.make_batch(tiny, 2)
    prof = rj.profile(model, batch)
    assert set(prof.peak_breakdown) <= CATEGORIES
    assert sum(prof.peak_breakdown.values()) == prof.peak_bytes
    assert prof.peak_breakdown[Category.PARAMETERS] == prof.param_bytes
    assert prof.peak_breakdown[Category.GRADIENTS] == prof.grad_bytes
    assert prof.peak_breakdown[Category.BATCH] == prof.batch_bytes
    with pytest.raises(BudgetTooSmall) as info:
        rj.plan(model, batch, budget=1000)
    err = info.value
    assert set(err.breakdown) <= CATEGORIES
    assert sum(err.breakdown.values()) == err.min_peak_bytes
    assert err.breakdown[Category.PARAMETERS] == prof.param_bytes
    assert err.cost is not None and err.cost.peak_bytes == err.min_peak_bytes
