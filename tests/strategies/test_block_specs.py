"""Block specs that match containers, and strategies that install nothing.

``remat.apply(llama, "full", blocks=lambda n, m: n.startswith("model.layers"))`` used to
match the ModuleList itself: a region on a module that is never called, so nothing was
checkpointed, recompute was 0 and ``remat.validate(...).passed`` was True.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import nn

import remat
from remat.blocks import named_blocks
from remat.measure import profile
from remat.models import build_model, make_batch
from remat.strategies.base import BlockStrategy
from remat.strategies.regions import region_of
from remat.strategies.registry import unregister_strategy


def _regions(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if region_of(m) is not None]


def test_a_predicate_matching_the_module_list_selects_its_layers() -> None:
    model = build_model("llama-tiny")
    spec = lambda name, module: name.startswith("blocks")  # noqa: E731
    assert [n for n, _ in named_blocks(model, spec)] == ["blocks.0", "blocks.1"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "installed nothing" warning either
        remat.apply(model, "full", blocks=spec)
    assert _regions(model) == ["blocks.0", "blocks.1"]


def test_the_module_list_class_as_a_spec_selects_its_members() -> None:
    model = build_model("gpt-tiny")
    assert [n for n, _ in named_blocks(model, nn.ModuleList)] == ["blocks.0", "blocks.1"]


def test_checkpointing_through_a_container_spec_recomputes() -> None:
    model = build_model("llama-tiny")
    batch = make_batch(model, 2)
    remat.apply(model, "full", blocks=lambda name, module: name.startswith("blocks"))
    assert profile(model, batch, timing=False).recompute_flops > 0
    assert remat.validate(model, batch, "full",
                          blocks=lambda name, module: name.startswith("blocks")).passed


class _SeqModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stack = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.tower = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tower(self.stack(x)).sum()


def test_a_sequential_is_one_block_unless_the_spec_also_matches_its_members() -> None:
    model = _SeqModel()
    assert [n for n, _ in named_blocks(model, lambda n, m: n == "stack")] == ["stack"]
    names = [n for n, _ in named_blocks(model, lambda n, m: n.startswith("tower"))]
    assert names == ["tower.0", "tower.1", "tower.2"]


def test_a_spec_matching_only_empty_containers_fails_with_the_fix() -> None:
    model = build_model("gpt-tiny")
    model.extra = nn.ModuleList()
    with pytest.raises(remat.BlocksNotFound,
                       match="(?s)matched only empty containers.*fix: pass blocks="):
        named_blocks(model, lambda name, module: name == "extra", api="remat.apply")


@dataclass(frozen=True)
class _InstallsNothing(BlockStrategy):
    name: ClassVar[str] = "installsnothing"


class _InstallsNothingHandler(remat.BlockHandler[_InstallsNothing]):
    summary: ClassVar[str] = "a buggy strategy that installs no region"

    def install_block(self, config: _InstallsNothing, block: nn.Module) -> list[nn.Module]:
        return []


@pytest.fixture
def installs_nothing() -> Iterator[type[_InstallsNothing]]:
    remat.register_strategy(_InstallsNothing, _InstallsNothingHandler)
    try:
        yield _InstallsNothing
    finally:
        unregister_strategy("installsnothing")


class _WholeModelNoop(remat.Strategy):
    name: ClassVar[str] = "wholenoop"


class _WholeModelNoopHandler(remat.Handler[_WholeModelNoop]):
    def install(self, config: _WholeModelNoop, blocks: Sequence[tuple[str, nn.Module]]
                ) -> list[nn.Module]:
        return []


@pytest.mark.usefixtures("installs_nothing")
def test_a_strategy_that_installs_no_region_warns() -> None:
    model = build_model("gpt-tiny")
    with pytest.warns(remat.RematWarning,
                      match="(?s)^remat.apply: .*installed no checkpointed region"
                            ".*fix: check blocks="):
        remat.apply(model, "installsnothing")
    remat.register_strategy(_WholeModelNoop, _WholeModelNoopHandler)
    try:
        with pytest.warns(remat.RematWarning, match="installed no checkpointed region"):
            remat.apply(model, _WholeModelNoop())
    finally:
        unregister_strategy("wholenoop")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remat.apply(model, "none")  # "none" installs nothing on purpose


class _WithSpare(nn.Module):
    """Blocks it runs, and a spare stack it never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.spare = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum()


def test_validate_warns_when_no_checkpointed_region_ran() -> None:
    model, x = _WithSpare(), torch.randn(4, 8)
    spare = lambda name, module: name.startswith("spare")  # noqa: E731
    with pytest.warns(remat.RematWarning, match=r"^remat.validate: .*installed 2 checkpointed "
                                                r"region\(s\), but none ran in the step\n"
                                                r"  regions: spare.0, spare.1\n"):
        report = remat.validate(model, x, "full", blocks=spare)
    assert report.passed  # gradients do match: the warning is what tells the truth
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert remat.validate(model, x, "full",
                              blocks=lambda name, module: name.startswith("layers")).passed
