"""Strategy configs are plain frozen data; their behaviour is a handler registered per config
type; ``trial`` tries a strategy and puts back what was there."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from torch import nn

import remat
from generated_models import generated_model
from remat.strategies import (
    BlockHandler,
    BlockStrategy,
    Handler,
    Strategy,
    applied,
    handler_of,
    registered,
    strategy_from_dict,
    strategy_to_dict,
    trial,
)
from remat.strategies.builtin import Full
from remat.strategies.regions import has_region

#: What a config must not carry: installation, planner offers and flags, CLI presentation.
BEHAVIOUR = ("install", "install_block", "install_method", "offers", "decisions", "parse",
             "spelling", "examples", "summary", "purposes", "argument", "spans_blocks",
             "moves_to_host", "offloads_inputs", "without_host", "on_head")


def _configs() -> list[Strategy]:
    """Every registered strategy's listed configs, and its bare one where it parses."""
    out: list[Strategy] = []
    for cls in registered():
        handler = handler_of(cls)
        for purpose in ("compare", "simulate", "frontier"):
            out += handler.examples(3, purpose)  # type: ignore[arg-type]
        try:
            out.append(handler.parse(None))
        except remat.StrategyError:
            pass
    return list(dict.fromkeys(out))


@pytest.mark.parametrize("config", registered(), ids=lambda c: c.name)
def test_every_config_is_plain_frozen_data_with_a_handler(config: type[Strategy]) -> None:
    assert dataclasses.is_dataclass(config)
    assert config.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert [name for name in BEHAVIOUR if hasattr(config, name)] == []
    handler = handler_of(config)
    assert isinstance(handler, Handler) and handler.config is config
    assert isinstance(handler, BlockHandler) == issubclass(config, BlockStrategy)
    assert handler.spelling().split(":")[0] == config.name


@pytest.fixture(scope="module")
def decoder() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    drawn = generated_model(3)
    return drawn.model, drawn.batch


def test_every_config_round_trips_and_applies_state_dict_neutral(
        decoder: tuple[nn.Module, dict[str, torch.Tensor]]) -> None:
    model, _ = decoder
    before = {k: v.clone() for k, v in model.state_dict().items()}
    configs = _configs()
    assert {type(c) for c in configs} == set(registered())
    for config in configs:
        if isinstance(config, BlockStrategy):
            stored = json.loads(json.dumps(strategy_to_dict(config)))
            assert strategy_from_dict(stored, where="x", api="test") == config
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # offload on the CPU, a sub-layer some blocks lack
            remat.apply(model, config)
        shown = applied(model)
        assert shown is not None and shown.strategy == str(config)
        assert model.state_dict().keys() == before.keys(), config
        remat.remove(model)
        assert applied(model) is None
        assert not any(has_region(m) for m in model.modules()), config
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_trial_applies_then_puts_back_what_was_applied(
        decoder: tuple[nn.Module, dict[str, torch.Tensor]]) -> None:
    model, _ = decoder
    remat.apply(model, "every:2")
    was = applied(model)
    names = [name for name, label in was.decisions if label == "none"]  # type: ignore[union-attr]
    with trial(model, {names[0]: Full()}) as tried:
        assert tried is model and dict(applied(model).decisions)[names[0]] == "full"  # type: ignore[union-attr]
    assert applied(model) == was
    with pytest.raises(remat.StrategyError), trial(model, {"no.such.block": Full()}):
        pass  # a failure while applying restores the model too
    assert applied(model) == was
    with trial(model, "sqrt", quiet=False):
        assert applied(model).strategy == "sqrt"  # type: ignore[union-attr]
    assert applied(model) == was
    remat.remove(model)
