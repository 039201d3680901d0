"""The planner on blocks whose attention and MLP are methods (NOTE [ Method sub-layers ] in
remat/blocks.py): ops attributed to the method, sub-layer candidates, plans that use them."""

from __future__ import annotations

import warnings

import pytest
import torch

import remat
from remat.blocks import BlockMethod
from remat.measure.tracker import MemoryTracker
from remat.planning import Plan, prepare
from remat.strategies import apply, remove, save_cuts
from remat.strategies.builtin import ops as builtin_ops
from tiny_nets import MethodLayer, MethodLM

METHODS = ("_attention_forward", "_ffn_forward")


def test_a_method_gets_its_own_ops_forward_and_backward() -> None:
    torch.manual_seed(0)
    layer = MethodLayer()
    x = torch.randn(2, 16, 32, requires_grad=True)
    tracker = MemoryTracker(blocks=[("l", layer),
                                    ("l._ffn_forward", BlockMethod(layer, "_ffn_forward"))])
    with tracker:
        loss = layer(x, torch.zeros(16, 16)).sum()
        tracker.set_phase("backward")
        loss.backward()
    assert "_ffn_forward" not in layer.__dict__  # the wrapper is gone
    mine = [op.name for op in tracker.ops if op.block == "l._ffn_forward"
            and op.phase == "forward" and op.flops]
    assert mine == ["aten.mm", "aten.mm", "aten.mm"]  # w1, w3, w2
    assert [op.name for op in tracker.ops if op.block == "l._ffn_forward"
            and op.phase == "forward" and op.name in ("aten.silu", "aten.mul")] == \
        ["aten.silu", "aten.mul"]
    backward = [op.name for op in tracker.ops if op.block == "l._ffn_forward"
                and op.phase == "backward"]
    assert backward.count("aten.mm") == 6 and "aten.silu_backward" in backward
    assert not any(op.name == "aten.bmm" for op in tracker.ops if op.block == "l._ffn_forward")


def test_plan_offers_method_candidates_and_picks_one_that_fits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The sparse hull: with every vertex (NOTE [ Dense hull for shallow models ]) a block
    # save set beats the method candidates this test is about.
    monkeypatch.setattr(builtin_ops, "_SHALLOW_BLOCKS", 0)
    # ... and without the hull's cheap end (item 4 of NOTE [ Save sets as minimum cuts ]),
    # whose block-wide sets keep all but the cheapest drops and undercut them too.
    monkeypatch.setattr(save_cuts, "_CHEAP_END", 0)
    torch.manual_seed(0)
    model = MethodLM()
    x = torch.randn(4, 16, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        context = prepare(model, x)
    labels = {c.label() for table in context.peak_model.tables for c in table}
    for method in METHODS:
        assert f"{method}=full" in labels, sorted(labels)
        assert any(label.startswith(f"{method}=ops[") for label in labels), sorted(labels)
    # 90% of the un-checkpointed peak: recomputing one block's MLP method is the cheapest fit.
    plan = remat.plan(model, x, budget="90%", context=context)
    assert plan.decisions and all(k.rsplit(".", 1)[-1] in METHODS for k in plan.decisions)
    assert plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes <= plan.budget_bytes
    loaded = Plan.from_json(plan.to_json())
    assert loaded == plan and dict(loaded.decisions) == dict(plan.decisions)
    report = remat.validate(model, x, loaded)
    assert report.passed, report
    apply(model, loaded)
    try:
        measured = remat.profile(model, x, timing=False).peak_bytes
    finally:
        remove(model)
    assert measured <= plan.budget_bytes, (measured, plan.budget_bytes)
    assert measured < context.no_checkpoint_peak_bytes
