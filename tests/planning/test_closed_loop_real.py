"""NOTE [ Closed loop on the real model ]: one warm-up serves the measurement and the
allocator's step, and a tracked real step measures the same bytes as the fake copy."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

import remat
import remat.planning.loop as planning_loop
from remat.measure.profile import first_step_peak
from remat.measure.step import Step, run_step
from remat.models import build_model, make_batch
from remat.planning import prepare
from remat.planning.loop import close_loop, measure_on_copy


def test_real_measurement_equals_the_fake_copy_and_warms_up_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_model("gpt-tiny", n_layer=4)
    batch = make_batch(model, 2)
    calls: list[bool] = []
    real = planning_loop.allocator_peak_of

    def counted(*args: Any) -> int:
        calls.append(bool(args[3]) if len(args) > 3 else False)
        return real(*args)

    monkeypatch.setattr(planning_loop, "allocator_peak_of", counted)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ctx = prepare(model, batch)
        assert ctx.setup is not None and ctx.setup.step_ops > 0
        budget = int(0.85 * ctx.no_checkpoint_peak_bytes)
        step = Step(model, batch)
        plan = close_loop(step, ctx, budget, simulate=False)
        assert planning_loop._real_is_cheaper(ctx)  # a tiny model: by its work
        assert calls and all(calls)  # every allocator step reused the first step
        key = tuple(sorted(plan.decisions.items()))
        measured = ctx.copy_profiles.pop(key)  # real or fake: measure again on the copy
        assert measured is not None
        fake = measure_on_copy(step, ctx, plan.decisions)
    assert fake is not None and fake.simulated
    assert plan.measured_peak_bytes == measured.peak_bytes == fake.peak_bytes
    assert measured.recompute_flops == fake.recompute_flops
    assert plan.allocator_peak_bytes is not None and plan.measured_peak_bytes <= budget


def test_gradients_left_by_the_users_step_change_no_peak_and_no_plan() -> None:
    """A model planned after a training step of its own still holds that step's gradients
    (``zero_grad`` comes at the next step's start). The measured step clears them first, so
    the bytes alive at its start leave them out too: the first step's allocator peak, and
    so the plan, are those of the same model without gradients (they read 474,112 B higher,
    the gradients' bytes, and an 80% plan of gpt-tiny found no fitting choice)."""
    model = build_model("gpt-tiny")
    batch = make_batch(model, 4)
    step = Step(model, batch)
    clean = first_step_peak(step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = remat.plan(model, batch, budget="80%")
        run_step(model, batch)
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None for g in grads)
        again = remat.plan(model, batch, budget="80%")
    assert again.decisions == plan.decisions
    assert again.measured_peak_bytes == plan.measured_peak_bytes <= plan.budget_bytes
    assert again.allocator_peak_bytes == plan.allocator_peak_bytes
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
    assert first_step_peak(step) == clean  # it clears the gradients, as a step's start does


def test_a_plan_made_under_autocast_fits_its_step_under_autocast() -> None:
    """``remat.plan`` called inside ``torch.autocast`` measures the step as it runs there
    (forward and backward under autocast); its op-level regions recompute every op there
    (item 4 of NOTE [ Dead ops in recompute ]: the closed loop's real step of an ``ops``
    choice failed on a view of a placeholder before)."""
    model = build_model("llama-tiny")
    batch = make_batch(model, 4)
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("ignore")
        plan = remat.plan(model, batch, budget="85%")
        fresh = copy.deepcopy(model)
        remat.apply(fresh, plan)
        first = first_step_peak(Step(fresh, batch))
    assert first == plan.allocator_peak_bytes <= plan.budget_bytes
