"""Plans are checked against the model they are applied to.

A plan made for a 2-layer model used to apply silently to a 6-layer one (two blocks
checkpointed, four left alone); ``"save_ops": "aten.mm"`` in a plan file became a set
of characters; an unknown op name made its region recompute everything.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import remat
from remat.core.cost import StepCost
from remat.models import build_model
from remat.planning import Plan
from remat.planning.fingerprint import BlockPrint, fingerprint_of
from remat.strategies.builtin import Full, SelectiveOps
from remat.strategies.regions import region_of


def _plan_for(model: torch.nn.Module) -> Plan:
    names = tuple(n for n, _ in remat.blocks.named_blocks(model))
    return Plan(decisions={n: Full() for n in names}, block_names=names,
                budget_bytes=100, cost=StepCost(peak_bytes=90),
                fingerprint=fingerprint_of(model, names))


def test_a_plan_for_a_two_layer_model_refuses_a_six_layer_one() -> None:
    plan = _plan_for(build_model("llama-tiny", n_layer=2))
    bigger = build_model("llama-tiny", n_layer=6)
    with pytest.raises(remat.StrategyError,
                       match=r"(?s)made for another model.*'blocks' holds 6 .* held 2"
                             r".*fix: make a plan .*remat\.plan"):
        remat.apply(bigger, plan)
    assert not any(region_of(m) for m in bigger.modules())  # nothing half-applied


def test_a_plan_refuses_other_shapes_classes_and_missing_blocks() -> None:
    plan = _plan_for(build_model("llama-tiny"))
    with pytest.raises(remat.StrategyError, match="'blocks.0' .* other parameters"):
        remat.apply(build_model("llama-tiny", d_ff=128), plan)
    with pytest.raises(remat.StrategyError, match="'blocks.0' is a .*Block, the plan's is a"):
        remat.apply(build_model("gpt-tiny"), plan)
    with pytest.raises(remat.StrategyError, match="has no module 'blocks.1'"):
        remat.apply(build_model("llama-tiny", n_layer=1), plan)
    remat.apply(build_model("llama-tiny"), plan)  # the model it was made for (other weights)


def test_the_fingerprint_survives_json_and_old_files_are_not_checked() -> None:
    model = build_model("llama-tiny")
    plan = _plan_for(model)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.fingerprint == plan.fingerprint
    with pytest.raises(remat.StrategyError, match="made for another model"):
        remat.apply(build_model("llama-tiny", n_layer=4), again)
    data = json.loads(plan.to_json())
    del data["fingerprint"]  # a file written before fingerprints: applied unchecked
    old = Plan.from_dict(data)
    assert old.fingerprint is None
    remat.apply(build_model("llama-tiny", n_layer=4), old)


def test_a_fingerprint_must_describe_the_plans_blocks() -> None:
    plan = _plan_for(build_model("llama-tiny"))
    with pytest.raises(ValueError, match="one BlockPrint per block"):
        replace(plan, fingerprint=(BlockPrint("blocks.0", "Block", "0" * 16),))


def test_the_planner_fills_the_fingerprint() -> None:
    model = build_model("gpt-tiny")
    batch = remat.models.make_batch(model, 2)
    plan = remat.plan(model, batch, budget="100%")
    assert plan.fingerprint == fingerprint_of(model, plan.block_names)
    with pytest.raises(remat.StrategyError, match="made for another model"):
        remat.apply(build_model("gpt-tiny", n_layer=3), plan)


def _file_with(save_ops: object) -> str:
    model = build_model("llama-tiny")
    data = json.loads(_plan_for(model).to_json())
    data["decisions"]["blocks.0"] = {"kind": "ops", "save_ops": save_ops}
    return json.dumps(data)


def test_save_ops_as_a_string_in_a_plan_file_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"save_ops .* is a string\n  found: 'aten.mm'\n"
                                         r"  fix: write a list of op names: \['aten.mm'\]"):
        Plan.from_json(_file_with("aten.mm"))


@pytest.mark.parametrize(("entry", "fragment"), [
    ("aten.matmull", "(?s)unknown aten op 'aten.matmull'.*fix: did you mean .*aten.matmul"),
    ("mm", "'mm' is not an op name"),
    ("aten.mm.default", "(?s)'aten.mm.default' is not an op name.*fix: write .*'aten.mm'"),
    ("aten.mm#x", "is not an op name"),
])
def test_unknown_or_malformed_op_names_are_refused(entry: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        SelectiveOps(frozenset({entry}))
    with pytest.raises(ValueError, match="remat.Plan.from_json: the decision for 'blocks.0'"):
        Plan.from_json(_file_with([entry]))
