"""The strategy registry: every list of strategies comes from it, and a strategy defined in
this file alone shows up in `remat compare`, the planner's candidates and plans."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import pytest
from torch import nn
from typer.testing import CliRunner

import remat
from remat.blocks import named_blocks
from remat.errors import StrategyError
from remat.models import build_model, make_batch
from remat.strategies import (
    BlockContext,
    BlockDecision,
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
    each), keep the rest. Exactly what docs/extending.md shows."""

    name: ClassVar[str] = "halves"
    summary: ClassVar[str] = "checkpoint the first half of each block's children"

    def install_block(self, block: nn.Module, decision: BlockDecision) -> list[nn.Module]:
        children = [c for c in block.children() if any(p.requires_grad for p in c.parameters())]
        first = children[: max(1, len(children) // 2)]
        for child in first:
            install_checkpoint(child, label=decision.label())
        return first

    def offers(self, context: BlockContext) -> list[Offer]:
        return [Offer((("", BlockDecision(self.name)),))]


@pytest.fixture
def halves() -> Iterator[type[CheckpointFirstHalf]]:
    remat.register_strategy(CheckpointFirstHalf)
    try:
        yield CheckpointFirstHalf
    finally:
        unregister_strategy("halves")


def test_builtin_lists_come_from_the_registry() -> None:
    names = [cls.name for cls in registered()]
    assert names[:8] == ["none", "full", "every", "sqrt", "attn", "mlp", "ops", "offload"]
    assert list(remat.STRATEGIES) == ["none", "full", "every:N", "sqrt", "attn", "mlp", "ops",
                                      "offload"]
    assert default_strategies("compare") == ["none", "full", "every:2", "sqrt", "attn", "mlp",
                                             "ops", "offload"]
    assert default_strategies("simulate") == ["none", "full", "every:2", "sqrt", "attn", "mlp",
                                              "ops"]
    assert default_strategies("frontier", num_blocks=4) == [
        "none", "full", "every:2", "every:3", "every:4", "sqrt", "attn", "mlp", "ops"]


def test_strings_parse_to_typed_configs() -> None:
    every = parse_strategy(" Every:3 ")
    assert str(every) == "every:3" and every == parse_strategy("every:3")
    assert parse_strategy(every) is every
    with pytest.raises(StrategyError, match="every:N with an integer N >= 1"):
        parse_strategy("every:0")
    with pytest.raises(StrategyError, match="takes no argument"):
        parse_strategy("full:2")
    with pytest.raises(StrategyError, match=r"unknown strategy 'fulll'.*every:N"):
        parse_strategy("fulll")


def test_registration_is_checked() -> None:
    with pytest.raises(StrategyError, match="taken by"):
        @remat.register_strategy
        @dataclass(frozen=True)
        class Other(CheckpointFirstHalf):
            name: ClassVar[str] = "full"
    with pytest.raises(StrategyError, match="lower-case word"):
        @remat.register_strategy
        @dataclass(frozen=True)
        class Bad(CheckpointFirstHalf):
            name: ClassVar[str] = "Bad Name"
    with pytest.raises(StrategyError, match="built in"):
        unregister_strategy("full")
    with pytest.raises(StrategyError, match="not a per-block decision kind"):
        remat.apply(build_model("gpt-tiny"), remat.Plan(
            {"blocks.0": BlockDecision("halves")}, ("blocks.0", "blocks.1"), 1, 1))


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
                                      "--repeats", "0", "--json", "-"])
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
    plan = remat.Plan({names[0]: BlockDecision("halves")}, names, 10**9, 10**8)
    again = remat.Plan.from_json(plan.to_json())
    assert again == plan
    remat.apply(model, again)
    assert remat.strategies.applied(model) is not None
    assert dict(remat.strategies.applied(model).decisions)[names[0]] == "halves"
    batch = make_batch(model, 2)
    assert remat.validate(model, batch, again).passed


def test_installed_packages_register_strategies_through_entry_points(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    from remat.strategies import registry

    good = importlib.metadata.EntryPoint(
        "halves", f"{__name__}:CheckpointFirstHalf", registry.ENTRY_POINT_GROUP)
    broken = importlib.metadata.EntryPoint(
        "broken", "no_such_module_for_remat:Nothing", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: [good, broken] if group == registry.ENTRY_POINT_GROUP
                        else [])
    try:
        with pytest.warns(remat.RematWarning, match="could not register strategy plug-in"):
            assert registry.load_entry_points() == ["halves"]
        assert "halves" in remat.STRATEGIES
    finally:
        unregister_strategy("halves")
