"""The strategy registry: every list of strategies comes from it, and a strategy defined in
this file alone shows up in `remat compare`, the planner's candidates and plans."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
from torch import nn
from typer.testing import CliRunner

import remat
from remat.blocks import named_blocks
from remat.core.cost import StepCost
from remat.errors import StrategyError
from remat.models import build_model, make_batch
from remat.strategies import (
    BlockContext,
    BlockHandler,
    BlockStrategy,
    Offer,
    default_strategies,
    parse_strategy,
    registered,
    unregister_strategy,
)
from remat.strategies.regions import install_checkpoint


@dataclass(frozen=True)
class CheckpointFirstHalf(BlockStrategy):
    """Toy strategy: checkpoint the first half of each block's direct children (one region
    each), keep the rest."""

    name: ClassVar[str] = "halves"


class HalvesHandler(BlockHandler[CheckpointFirstHalf]):
    summary: ClassVar[str] = "checkpoint the first half of each block's children"

    def install_block(self, config: CheckpointFirstHalf, block: nn.Module) -> list[nn.Module]:
        children = [c for c in block.children() if any(p.requires_grad for p in c.parameters())]
        first = children[: max(1, len(children) // 2)]
        for child in first:
            install_checkpoint(child, label=config.label())
        return first

    def offers(self, config: CheckpointFirstHalf, context: BlockContext) -> list[Offer]:
        return [Offer((("", config),))]


@pytest.fixture
def halves() -> Iterator[type[CheckpointFirstHalf]]:
    remat.register_strategy(CheckpointFirstHalf, HalvesHandler)
    try:
        yield CheckpointFirstHalf
    finally:
        unregister_strategy("halves")


def test_builtin_lists_come_from_the_registry() -> None:
    names = [cls.name for cls in registered()]
    assert names[:10] == ["none", "full", "every", "sqrt", "attn", "mlp", "ops", "offload",
                         "full_offload", "chunked_head"]
    assert list(remat.STRATEGIES) == ["none", "full", "every:N", "sqrt", "attn", "mlp", "ops",
                                      "offload", "full_offload", "chunked_head:N"]
    assert default_strategies("compare") == ["none", "full", "every:2", "sqrt", "attn", "mlp",
                                             "ops", "offload", "full_offload"]
    assert default_strategies("simulate") == ["none", "full", "every:2", "sqrt", "attn", "mlp",
                                              "ops"]
    assert default_strategies("frontier", num_blocks=4) == [
        "none", "full", "every:2", "every:3", "every:4", "sqrt", "attn", "mlp", "ops"]


def test_strings_parse_to_typed_configs() -> None:
    every = parse_strategy(" Every:3 ")
    assert str(every) == "every:3" and every == parse_strategy("every:3")
    assert parse_strategy(every) is every
    with pytest.raises(StrategyError, match=r"fix: write every:N with an integer N >= 1"):
        parse_strategy("every:0")
    with pytest.raises(StrategyError, match=r"^remat.strategies.parse_strategy: strategy "
                                            r"'full' takes no argument"):
        parse_strategy("full:2")
    with pytest.raises(StrategyError, match=r"(?s)^remat.apply: unknown strategy 'fulll'\n"
                                            r".*every:N.*fix: pass one of"):
        parse_strategy("fulll", api="remat.apply")


def test_registration_is_checked() -> None:
    @dataclass(frozen=True)
    class Other(CheckpointFirstHalf):
        name: ClassVar[str] = "full"

    with pytest.raises(StrategyError, match="taken by"):
        @remat.register_strategy(Other)
        class OtherHandler(HalvesHandler):
            pass

    @dataclass(frozen=True)
    class Bad(CheckpointFirstHalf):
        name: ClassVar[str] = "Bad Name"

    with pytest.raises(StrategyError, match="lower-case word"):
        remat.register_strategy(Bad, HalvesHandler)
    with pytest.raises(StrategyError, match="do not match"):  # a block config, whole handler
        remat.register_strategy(CheckpointFirstHalf, remat.Handler)
    @dataclass(frozen=True)
    class OldStyle(CheckpointFirstHalf):  # behaviour on the config, as before handlers
        name: ClassVar[str] = "oldstyle"

        def install_block(self, block: nn.Module) -> list[nn.Module]:
            return []

    with pytest.raises(StrategyError, match="(?s)carries behaviour.*install_block.*fix: move"):
        remat.register_strategy(OldStyle)
    with pytest.raises(StrategyError, match="must be a Handler subclass"):
        remat.register_strategy(CheckpointFirstHalf, HalvesHandler())  # type: ignore[call-overload]
    with pytest.raises(StrategyError, match="built in"):
        unregister_strategy("full")
    with pytest.raises(ValueError, match="block-level strategy"):
        remat.Plan({"blocks.0": parse_strategy("every:2")}, ("blocks.0", "blocks.1"), 1,
                   StepCost(peak_bytes=1))
    text = remat.Plan({"blocks.0": remat.strategies.parse_strategy("full")},
                      ("blocks.0", "blocks.1"), 1,
                      StepCost(peak_bytes=1)).to_json().replace('"full"', '"halves"')
    with pytest.raises(ValueError, match="'halves', which is not a registered"):
        remat.Plan.from_json(text)


def test_a_strategy_registered_here_applies_and_keeps_gradients(halves: type) -> None:
    assert "halves" in remat.STRATEGIES
    assert "halves" in default_strategies("compare")
    model = build_model("gpt-tiny")
    batch = make_batch(model, 2)
    base = remat.profile(model, batch, timing=False)
    remat.apply(model, "halves")
    prof = remat.profile(model, batch, timing=False)
    assert prof.recompute_flops > 0 and prof.activation_bytes < base.activation_bytes
    report = remat.validate(model, batch, "halves")
    assert report.passed, report


def test_a_strategy_registered_here_shows_up_in_remat_compare(halves: type) -> None:
    from remat.cli import app

    result = CliRunner().invoke(app, ["compare", "--model", "gpt-tiny", "--batch", "2",
                                      "--repeats", "0", "--plan-budget", "off", "--json", "-"])
    assert result.exit_code == 0, result.output
    rows = {row["strategy"]: row for row in json.loads(result.stdout)["rows"]}
    assert "halves" in rows and rows["halves"]["grad_passed"] is True
    assert rows["halves"]["recompute_flops"] > 0


def test_a_strategy_registered_here_is_a_planner_candidate(halves: type) -> None:
    from remat.devices import get_device
    from remat.planning.candidates import measure_groups
    from remat.planning.context import fake_setup

    model = build_model("gpt-tiny")
    setup = fake_setup(model, make_batch(model, 2), optimizer=None, blocks=None)
    groups = measure_groups(setup, get_device("h100-80gb"), prune=False)
    labels = {c.label() for g in groups for c in g.candidates}
    assert "halves" in labels and "full" in labels
    toy = next(c for g in groups for c in g.candidates if c.label() == "halves")
    full = next(c for g in groups for c in g.candidates if c.label() == "full")
    assert 0 < toy.recompute_flops < full.recompute_flops


def test_a_plan_holding_a_registered_kind_round_trips_and_applies(halves: type) -> None:
    model = build_model("gpt-tiny")
    names = tuple(name for name, _ in named_blocks(model))
    plan = remat.Plan({names[0]: CheckpointFirstHalf()}, names, 10**9, StepCost(peak_bytes=10**8))
    again = remat.Plan.from_json(plan.to_json())
    assert again == plan
    remat.apply(model, again)
    assert remat.strategies.applied(model) is not None
    assert dict(remat.strategies.applied(model).decisions)[names[0]] == "halves"
    batch = make_batch(model, 2)
    assert remat.validate(model, batch, again).passed


def test_installed_packages_register_strategies_through_entry_points(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import importlib.metadata

    from remat.strategies import registry

    # A plug-in module registers its config with its handler on import.
    (tmp_path / "remat_plugin_halves.py").write_text(
        f"import remat\nfrom {__name__} import CheckpointFirstHalf, HalvesHandler\n"
        "remat.register_strategy(CheckpointFirstHalf, HalvesHandler)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    good = importlib.metadata.EntryPoint(
        "halves", "remat_plugin_halves:CheckpointFirstHalf", registry.ENTRY_POINT_GROUP)
    broken = importlib.metadata.EntryPoint(
        "broken", "no_such_module_for_remat:Nothing", registry.ENTRY_POINT_GROUP)
    unregistered = importlib.metadata.EntryPoint(  # names a config nobody registered
        "firstk", f"{__name__}:FirstChildren", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: [good, broken, unregistered]
                        if group == registry.ENTRY_POINT_GROUP else [])
    try:
        with pytest.warns(remat.RematWarning, match="could not register strategy plug-in"):
            assert registry.load_entry_points() == ["halves"]
        assert "halves" in remat.STRATEGIES
    finally:
        unregister_strategy("halves")


# ---- a registered strategy with a field: the instance travels whole ----------------------

#: Every ``count`` a FirstChildren instance was installed with, in order.
INSTALLED_COUNTS: list[int] = []


@dataclass(frozen=True)
class FirstChildren(BlockStrategy):
    """Checkpoint the first ``count`` trainable children of each block, one region each:
    the field changes how many bytes a block keeps."""

    name: ClassVar[str] = "firstk"

    count: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"FirstChildren: count must be an int >= 1, got {self.count!r}")


class FirstChildrenHandler(BlockHandler[FirstChildren]):
    summary: ClassVar[str] = "checkpoint each block's first count children"

    def install_block(self, config: FirstChildren, block: nn.Module) -> list[nn.Module]:
        INSTALLED_COUNTS.append(config.count)
        children = [c for c in block.children() if any(p.requires_grad for p in c.parameters())]
        for child in children[: config.count]:
            install_checkpoint(child, label=config.label())
        return children[: config.count]

    def offers(self, config: FirstChildren, context: BlockContext) -> list[Offer]:
        return [Offer((("", FirstChildren(count)),)) for count in (1, 3)]


@pytest.fixture
def firstk() -> Iterator[type[FirstChildren]]:
    remat.register_strategy(FirstChildren, FirstChildrenHandler)
    INSTALLED_COUNTS.clear()
    try:
        yield FirstChildren
    finally:
        unregister_strategy("firstk")


def _activation_bytes(model: nn.Module, batch: object, strategy: object) -> int:
    remat.apply(model, strategy)
    try:
        return remat.profile(model, batch, timing=False).activation_bytes
    finally:
        remat.remove(model)


def test_a_field_survives_apply(firstk: type) -> None:
    model = build_model("gpt-tiny")
    batch = make_batch(model, 2)
    one = _activation_bytes(model, batch, FirstChildren(count=1))
    three = _activation_bytes(model, batch, FirstChildren(count=3))
    assert three < one  # more children checkpointed: fewer bytes kept
    INSTALLED_COUNTS.clear()
    remat.apply(model, FirstChildren(count=3))
    blocks = len(named_blocks(model))
    assert INSTALLED_COUNTS == [3] * blocks
    applied = remat.strategies.applied(model)
    assert applied is not None and applied.strategy == "firstk(count=3)"
    assert {label for _, label in applied.decisions} == {"firstk(count=3)"}


def test_a_field_survives_plan_json_and_validate(firstk: type) -> None:
    model = build_model("gpt-tiny")
    batch = make_batch(model, 2)
    names = tuple(name for name, _ in named_blocks(model))
    plan = remat.Plan({n: FirstChildren(count=3) for n in names}, names, 10**9,
                      StepCost(peak_bytes=10**8))
    data = json.loads(plan.to_json())
    assert data["version"] == 2
    assert data["decisions"][names[0]] == {"name": "firstk", "fields": {"count": 3}}
    again = remat.Plan.from_json(plan.to_json())
    assert again == plan and again.decisions[names[0]] == FirstChildren(count=3)
    direct = _activation_bytes(model, batch, FirstChildren(count=3))
    assert _activation_bytes(model, batch, again) == direct  # same bytes, to the byte
    INSTALLED_COUNTS.clear()
    report = remat.validate(model, batch, FirstChildren(count=3))
    assert report.passed and report.strategy == "firstk(count=3)"
    assert set(INSTALLED_COUNTS) == {3}
    INSTALLED_COUNTS.clear()
    assert remat.validate(model, batch, again).passed
    assert set(INSTALLED_COUNTS) == {3}


def test_a_field_survives_the_planner(firstk: type) -> None:
    from remat.devices import get_device
    from remat.planning.candidates import measure_groups
    from remat.planning.context import fake_setup

    model = build_model("gpt-tiny")
    setup = fake_setup(model, make_batch(model, 2), optimizer=None, blocks=None)
    groups = measure_groups(setup, get_device("h100-80gb"), prune=False)
    found = {c.label(): c for g in groups for c in g.candidates}
    one, three = found["firstk"], found["firstk(count=3)"]
    assert three.parts == (("", FirstChildren(count=3)),)
    assert three.saved_bytes < one.saved_bytes


def test_plans_written_by_remat_0_1_still_load() -> None:
    old = {
        "format": "remat.plan", "version": 1, "block_names": ["blocks.0", "blocks.1"],
        "decisions": {"blocks.0": {"kind": "ops", "save_ops": ["aten.addmm"]},
                      "blocks.1.attn": {"kind": "full", "save_ops": None},
                      "blocks.1.mlp": "full"},
        "budget_bytes": 10, "predicted_peak_bytes": 9,
        "blocks": {"names": ["blocks.0", "blocks.1.attn", "blocks.1.mlp"]},
    }
    plan = remat.Plan.from_dict(old)
    from remat.strategies.builtin import Full, SelectiveOps

    assert dict(plan.decisions) == {"blocks.0": SelectiveOps(frozenset({"aten.addmm"})),
                                    "blocks.1.attn": Full(), "blocks.1.mlp": Full()}
    assert json.loads(plan.to_json())["decisions"]["blocks.0"] == {
        "name": "ops", "fields": {"save_ops": ["aten.addmm"]}}
    model = build_model("gpt-tiny")
    batch = make_batch(model, 2)
    assert remat.validate(model, batch, plan).passed


def test_a_label_parses_back_to_the_instance(firstk: type) -> None:
    three = FirstChildren(count=3)
    assert str(three) == "firstk(count=3)" and parse_strategy(str(three)) == three
    assert parse_strategy("firstk") == FirstChildren()
    with pytest.raises(StrategyError) as info:
        parse_strategy("firstk(depth=2)", api="remat.apply")
    lines = str(info.value).splitlines()
    assert lines[0] == "remat.apply: cannot read 'firstk(depth=2)'"
    assert "fix: write firstk(field=value, ...)" in lines[-1]
    with pytest.raises(StrategyError, match="count must be an int >= 1"):
        parse_strategy("firstk(count=0)")
    model = build_model("gpt-tiny")
    remat.apply(model, "firstk(count=3)")
    applied = remat.strategies.applied(model)
    assert applied is not None and {label for _, label in applied.decisions} == {str(three)}
