"""Plan: validation, JSON round trip (versioned), display."""

from __future__ import annotations

import copy
import json
import pickle

import pytest
from rich.console import Console

from remat.core.cost import StepCost
from remat.planning import PLAN_FORMAT_VERSION, NamedBlocks, Plan, ThroughputRow
from remat.report.plan import decision_runs, plan_renderable, plan_text
from remat.strategies.builtin import Full, NoCheckpoint, SelectiveOps

NAMES = ("blocks.0", "blocks.1", "blocks.2", "blocks.3")


def make_plan(**overrides: object) -> Plan:
    fields: dict[str, object] = dict(
        decisions={
            "blocks.0": Full(),
            "blocks.1": NoCheckpoint(),
            "blocks.2.mlp": SelectiveOps(frozenset({"aten.mm"})),
            "blocks.2.attn": Full(),
            "blocks.3": SelectiveOps(frozenset({"aten.addmm", "aten.bmm"})),
        },
        block_names=NAMES,
        budget_bytes=1000,
        predicted_peak_bytes=900,
        measured_peak_bytes=900,
        recompute_flops=123,
        recompute_ms=0.5,
        predicted_step_ms=3.0,
        no_checkpoint_peak_bytes=2000,
        blocks=NamedBlocks(("blocks.0", "blocks.2.attn", "blocks.2.mlp", "blocks.3")),
        batch_size=8,
        throughput=(ThroughputRow(8, True, "2 ops[aten.mm]", 900, 0.5, 3.0, 8 / 3.0 * 1e3),
                    ThroughputRow(16, False, "", 1500, 0.0, 0.0, 0.0)),
    )
    fields.update(overrides)
    cost = {"peak_bytes": fields.pop("predicted_peak_bytes"),
            "recompute_flops": fields.pop("recompute_flops"),
            "recompute_ms": fields.pop("recompute_ms"),
            "step_ms": fields.pop("predicted_step_ms")}
    return Plan(**fields, cost=StepCost(**cost))  # type: ignore[arg-type]


def test_none_decisions_are_dropped_and_order_follows_the_blocks() -> None:
    plan = make_plan()
    assert list(plan.decisions) == ["blocks.0", "blocks.2.attn", "blocks.2.mlp", "blocks.3"]
    assert plan.decision("blocks.1") == NoCheckpoint()
    assert plan.decision("blocks.2.mlp").name == "ops"
    assert plan.label_of("blocks.2") == "attn=full; mlp=ops[aten.mm]"
    assert plan.label_of("blocks.3") == "ops[aten.addmm,aten.bmm]"
    assert plan.label() == "1 full, 1 none, 1 attn=full; mlp=ops[aten.mm], " \
                           "1 ops[aten.addmm,aten.bmm]"
    assert not plan.is_empty and plan.measured_or_predicted_peak_bytes == 900
    with pytest.raises(KeyError, match="no block 'encoder.0'"):
        plan.decision("encoder.0")


def test_empty_plan() -> None:
    plan = make_plan(decisions={"blocks.1": NoCheckpoint()}, blocks=None)
    assert plan.is_empty and dict(plan.decisions) == {}
    assert plan_text(plan).startswith("Empty plan")


def test_json_round_trip_is_exact() -> None:
    plan = make_plan()
    text = plan.to_json()
    data = json.loads(text)
    assert data["format"] == "remat.plan" and data["version"] == PLAN_FORMAT_VERSION
    assert data["decisions"]["blocks.3"] == {"name": "ops",
                                             "fields": {"save_ops": ["aten.addmm", "aten.bmm"]}}
    assert data["decisions"]["blocks.0"] == {"name": "full", "fields": {}}
    back = Plan.from_json(text)
    assert back == plan
    assert back.blocks == plan.blocks  # the names that select the decided modules
    assert back.throughput == plan.throughput
    unmeasured = make_plan(measured_peak_bytes=None, predicted_step_ms=None, blocks=None)
    assert Plan.from_json(unmeasured.to_json()) == unmeasured


def test_plans_pickle_and_copy() -> None:
    plan = make_plan()
    back = pickle.loads(pickle.dumps(plan))
    assert back == plan and back.blocks == plan.blocks
    assert copy.deepcopy(plan) == plan
    with pytest.raises(TypeError):
        plan.decisions["blocks.1"] = Full()  # type: ignore[index]


def test_custom_blocks_spec_is_stored_as_names() -> None:
    plan = make_plan(decisions={"blocks.0": Full()},
                     blocks=lambda name, module: name.startswith("blocks."))
    back = Plan.from_json(plan.to_json())
    assert back.blocks == NamedBlocks(NAMES)
    assert back.blocks("blocks.2", None) and not back.blocks("head", None)


def test_from_json_rejects_unknown_versions_and_non_plans() -> None:
    data = make_plan().to_dict()
    data["version"] = PLAN_FORMAT_VERSION + 1
    with pytest.raises(ValueError, match=rf"version {PLAN_FORMAT_VERSION + 1} is not "
                                         rf"supported\n  this remat reads versions: 1, "
                                         rf"{PLAN_FORMAT_VERSION}"):
        Plan.from_json(json.dumps(data))
    with pytest.raises(ValueError, match="not a remat plan"):
        Plan.from_json(json.dumps({"version": 1}))
    with pytest.raises(ValueError, match="not valid JSON"):
        Plan.from_json("{")
    del data["budget_bytes"]
    data["version"] = PLAN_FORMAT_VERSION
    with pytest.raises(ValueError, match="malformed plan"):
        Plan.from_json(json.dumps(data))


@pytest.mark.parametrize(("field", "value", "match"), [
    ("budget_bytes", -1, "budget_bytes must be an int >= 0"),
    ("measured_peak_bytes", 1.5, "measured_peak_bytes must be an int >= 0"),
    ("recompute_ms", float("nan"), "recompute_ms must be a finite number"),
    ("decisions", {"head": Full()}, "neither a block nor inside one"),
    ("decisions", {"blocks.0": "full"}, "must be a block-level strategy"),
    ("block_names", ("a", "a"), "duplicates"),
])
def test_invalid_plans_are_rejected(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_plan(**{field: value})


def test_summary_and_rich_rendering_show_budget_peaks_and_decisions() -> None:
    plan = make_plan()
    text = plan_text(plan)
    assert "Budget" in text and "1000 B" in text and "Measured peak" in text
    assert "blocks.2  attn=full; mlp=ops[aten.mm]" in text
    assert "Throughput search" in text
    console = Console(width=140, record=True)
    console.print(plan_renderable(plan))
    rendered = console.export_text()
    assert "Decision per block" in rendered and "ops[aten.addmm,aten.bmm]" in rendered
    assert "2 ops[aten.mm]" in rendered  # cells are text, not rich markup
    assert decision_runs(make_plan(decisions={}, blocks=None)) == [
        ("blocks.0 .. blocks.3", "none")]


def test_throughput_row_validation() -> None:
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        ThroughputRow(0, True, "", 1, 0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="step_ms must be a finite number"):
        ThroughputRow(1, True, "", 1, 0.0, -1.0, 1.0)


def test_a_jax_plan_is_refused_with_the_loader_to_use() -> None:
    import json

    data = json.loads(Plan({}, ("blocks.0",), 1, StepCost(peak_bytes=1)).to_json())
    assert data["framework"] == "torch"
    data["framework"] = "jax"
    with pytest.raises(ValueError,
                       match=r"(?s)'jax' plan.*fix: load it with remat\.jax\.Plan\.from_json"):
        Plan.from_json(json.dumps(data))
    del data["framework"]  # files written before the field existed read as torch plans
    assert Plan.from_json(json.dumps(data)) == Plan({}, ("blocks.0",), 1, StepCost(peak_bytes=1))
