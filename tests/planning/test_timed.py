"""Measured recompute cost (cost="measured"): timing candidates on the real model."""

from __future__ import annotations

import warnings
from functools import cache
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat.core.cost import StepCost
from remat.devices import get_device
from remat.models import build_model, make_batch
from remat.planning import Plan
from remat.planning.candidates import measure_groups
from remat.planning.context import fake_setup, resolve_cost
from remat.planning.timed import time_groups
from remat.report.plan import plan_text
from remat.strategies import applied

H100 = get_device("h100-80gb")


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that compute (SAC's cached ones never reach it; views are free)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if not getattr(func, "is_view", False):
            self.ops += 1
        return func(*args, **(kwargs or {}))


class OpClock:
    """A deterministic clock: "time" is the number of ops run so far."""

    def __init__(self, counter: OpCounter) -> None:
        self.counter = counter

    def mark(self) -> int:
        return self.counter.ops

    def sync(self) -> None:
        pass

    def elapsed_ms(self, start: int, end: int) -> float:
        return float(end - start)


@cache
def _groups(preset: str) -> tuple[torch.nn.Module, Any, list[Any]]:
    """A preset, its batch and its measured candidate groups (measured once per preset:
    tests may change the model, never the groups; only one test per preset runs on the
    model)."""
    torch.manual_seed(0)
    model = build_model(preset)
    batch = make_batch(model, 2)
    setup = fake_setup(model, batch, optimizer=None, blocks=None)
    return model, batch, measure_groups(setup, H100, prune=False)


def test_costs_are_the_extra_work_each_candidate_runs() -> None:
    model, batch, groups = _groups("llama-tiny")
    counter = OpCounter()
    with counter:
        timed = time_groups(model, batch, groups, clock=OpClock(counter), prune=False,
                            repeats=2, warmup=0)
    (group,) = timed
    costs = {c.label(): c.recompute_ms for c in group.candidates}
    assert costs["none"] == 0.0
    assert all(cost >= 0 for cost in costs.values())
    # Checkpointing the whole block replays its whole forward: nothing costs more.
    assert costs["full"] == max(costs.values()) > 0
    # The sub-layers offered as modules of their own (the attn / mlp strategies' offers).
    assert 0 < costs["attn=full"] < costs["full"] and 0 < costs["mlp=full"] < costs["full"]
    # A save set holding more runs a subset of the ops again, never more.
    block_ops = [c for c in group.candidates if len(c.parts) == 1 and c.parts[0][0] == ""
                 and c.parts[0][1].name == "ops"]
    for small in block_ops:
        for large in block_ops:
            small_set, large_set = small.parts[0][1].save_ops, large.parts[0][1].save_ops
            if small_set is not None and large_set is not None and small_set < large_set \
                    and all("#" not in e for e in small_set | large_set):
                assert large.recompute_ms <= small.recompute_ms, (small.label(), large.label())
    # Bytes are the fake measurement's, untouched.
    for before, after in zip(groups[0].candidates, group.candidates, strict=True):
        assert (before.saved_bytes, before.backward_peak_bytes) == \
            (after.saved_bytes, after.backward_peak_bytes)


def test_timing_leaves_the_model_as_it_was() -> None:
    model, batch, groups = _groups("gpt-tiny")
    remat.apply(model, "attn")
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    params = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    time_groups(model, batch, groups, repeats=1, warmup=0)
    assert torch.equal(torch.get_rng_state(), rng)
    for p, before in zip(model.parameters(), params, strict=True):
        assert torch.equal(p, before)
        assert p.grad is not None and bool((p.grad == 3.0).all())
    installed = applied(model)
    assert installed is not None and installed.strategy == "attn"


def test_measured_plan_on_cpu_fits_and_says_where_its_times_come_from() -> None:
    torch.manual_seed(0)
    model = build_model("gpt-tiny")
    batch = make_batch(model, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = remat.plan(model, batch, budget="85%", cost="measured")
    assert plan.cost_source == "measured" and plan.timed_on == "cpu"
    assert plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes <= plan.budget_bytes
    assert plan.predicted_step_ms is not None and plan.predicted_step_ms > 0
    assert plan.recompute_ms >= 0
    again = Plan.from_json(plan.to_json())
    assert (again.cost_source, again.timed_on) == ("measured", "cpu")
    assert "measured, cpu" in plan_text(plan)


def test_cost_choice_is_resolved_and_checked() -> None:
    model = build_model("gpt-tiny")
    assert resolve_cost("auto", model) == "roofline"  # CPU: wall time too noisy
    assert resolve_cost("measured", model) == "measured"
    with pytest.raises(ValueError, match="simulate=True"):
        resolve_cost("measured", model, simulate=True)
    with pytest.raises(ValueError,
                       match=r"(?s)^remat.plan: unknown cost\n  found: .fastest.*fix: pass one of"):
        resolve_cost("fastest", model)
    with pytest.raises(ValueError, match="timed_on"):
        Plan({}, ("blocks.0",), 1, StepCost(peak_bytes=1), cost_source="measured")
    with pytest.raises(ValueError, match="cost_source"):
        Plan({}, ("blocks.0",), 1, StepCost(peak_bytes=1), cost_source="guessed", timed_on="cpu")


def test_offload_cost_hides_copies_out_behind_the_forward_only() -> None:
    """NOTE [ Offload copies in the step time ]: out overlaps the forward, back is exposed."""
    from remat.core.op_record import OpRecord
    from remat.planning.block_run import BlockRun as _Run
    from remat.planning.candidates import _offload_exposed_ms

    mm = OpRecord("aten.mm", "forward", 2 * 4096**3, 3 * 2 * 4096**2, 2 * 4096**2,
                  dtype_bytes=2)
    mm_back = OpRecord("aten.mm", "backward", 2 * 2 * 4096**3, 3 * 2 * 4096**2,
                       2 * 4096**2, dtype_bytes=2)
    base = _Run(saved_bytes=8 * 2**30, forward_peak_bytes=0, backward_peak_bytes=0,
                ops=(mm, mm_back))
    offloaded = _Run(saved_bytes=2**30, forward_peak_bytes=0, backward_peak_bytes=0, ops=())
    transfer_ms = 7 * 2**30 / H100.host_link_bytes_per_s * 1e3  # each way
    forward_ms = 2 * 4096**3 / H100.flops_per_s(2) * 1e3
    expected = (transfer_ms - forward_ms) + transfer_ms
    assert _offload_exposed_ms(offloaded, base, H100) == pytest.approx(expected, rel=1e-9)
    # Little to move: the copy out hides behind the forward, the copy back does not.
    small = _Run(saved_bytes=8 * 2**30 - 2**20, forward_peak_bytes=0, backward_peak_bytes=0,
                 ops=())
    back_ms = 2**20 / H100.host_link_bytes_per_s * 1e3
    assert _offload_exposed_ms(small, base, H100) == pytest.approx(back_ms, rel=1e-9)
    assert _offload_exposed_ms(base, base, H100) == 0.0


def test_no_offload_candidate_on_cpu() -> None:
    _, _, groups = _groups("gpt-tiny")
    assert not any(c.offloads for g in groups for c in g.candidates)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_plan_minimizes_measured_time_and_may_offload() -> None:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model("gpt-tiny")
    batch = make_batch(model, 4, device=torch.device("cuda"))
    plan = remat.plan(model, batch, budget="85%")
    assert plan.cost_source == "measured" and plan.timed_on is not None
    assert plan.timed_on.startswith("cuda")
    assert plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes <= plan.budget_bytes
    setup = fake_setup(model, batch, optimizer=None, blocks=None)
    kinds = {c.label() for g in measure_groups(setup, H100, prune=False) for c in g.candidates}
    assert "offload" in kinds
