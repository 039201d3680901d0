"""apply/remove, the decision in the NNX graph, strategies and their errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import remat.jax as rj
from remat.errors import BlocksNotFound, StrategyError
from remat.jax.measure import default_loss
from remat.jax.strategies import Policy, strategy_policies

from .conftest import TINY, TINY_BATCH


@pytest.fixture
def model() -> nnx.Module:
    return rj.build_model(TINY)


def test_find_blocks(model: nnx.Module) -> None:
    assert rj.find_blocks(model) == ["blocks.0", "blocks.1"]
    assert rj.find_blocks(model, type(model.blocks[0])) == ["blocks.0", "blocks.1"]
    assert rj.find_blocks(model, ["blocks.1"]) == ["blocks.1"]


def test_no_blocks_error_says_what_to_do() -> None:
    class Flat(nnx.Module):
        def __init__(self) -> None:
            self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    with pytest.raises(BlocksNotFound, match="blocks="):
        rj.find_blocks(Flat())


@pytest.mark.parametrize("strategy, expected", [
    ("none", ["none"] * 4),
    ("full", ["nothing_saveable"] * 4),
    ("every:2", ["nothing_saveable", "none", "nothing_saveable", "none"]),
    ("sqrt", ["nothing_saveable", "none", "nothing_saveable", "none"]),
    ("dots_saveable", ["dots_saveable"] * 4),
    ("names:qkv", ["save_only_these_names:qkv"] * 4),
])
def test_strategy_policies(strategy: str, expected: list[str]) -> None:
    assert [p.label() for p in strategy_policies(strategy, 4)] == expected


@pytest.mark.parametrize("bad", ["fulll", "everything", "every:0", "every:x",
                                 "save_only_these_names", "offload", "dots_saveable:qkv"])
def test_unknown_strategy_is_a_clear_error(model: nnx.Module, bad: str) -> None:
    with pytest.raises(StrategyError, match="remat.jax"):
        rj.apply(model, bad)


def test_unknown_block_in_mapping(model: nnx.Module) -> None:
    with pytest.raises(StrategyError, match="not blocks"):
        rj.apply(model, {"blocks.7": "full"})


def test_apply_remove_roundtrip(model: nnx.Module) -> None:
    params = nnx.state(model, nnx.Param)
    rj.apply(model, "every:2")
    assert rj.decisions_of(model) == {"blocks.0": "nothing_saveable"}
    # Parameter paths do not change: a state checkpoint loads either way.
    assert jax.tree.structure(nnx.state(model, nnx.Param)) == jax.tree.structure(params)
    rj.apply(model, {"blocks.1": Policy("dots_saveable")})
    assert rj.decisions_of(model) == {"blocks.1": "dots_saveable"}
    rj.remove(model)
    assert rj.decisions_of(model) == {}
    assert type(model.blocks[0]).__call__ is type(rj.build_model(TINY).blocks[0]).__call__


def test_decision_survives_split_merge_and_state(model: nnx.Module) -> None:
    rj.apply(model, "save_only_these_names:qkv,mlp_up")
    graphdef, state = nnx.split(model)
    merged = nnx.merge(graphdef, state)
    assert rj.decisions_of(merged) == rj.decisions_of(model)
    # a state checkpoint restored into the applied model keeps the decision
    fresh = rj.apply(rj.build_model(TINY, seed=1), "save_only_these_names:qkv,mlp_up")
    nnx.update(fresh, nnx.state(model))
    assert rj.decisions_of(fresh) == rj.decisions_of(model)
    np.testing.assert_array_equal(fresh.blocks[0].mlp.up.kernel[...],
                                  model.blocks[0].mlp.up.kernel[...])


def test_decision_survives_nnx_jit(model: nnx.Module) -> None:
    rj.apply(model, "full")
    batch = rj.make_batch(TINY, TINY_BATCH)
    seen: list[dict[str, str]] = []
    jaxprs: list[str] = []

    @nnx.jit
    def step(m: nnx.Module, b: dict[str, jax.Array]) -> tuple[jax.Array, nnx.State]:
        seen.append(rj.decisions_of(m))
        return nnx.value_and_grad(default_loss)(m, b)

    loss, grads = step(model, batch)
    assert seen == [{"blocks.0": "nothing_saveable", "blocks.1": "nothing_saveable"}]
    graphdef, state = nnx.split(model)
    jaxprs.append(str(jax.make_jaxpr(
        lambda s: nnx.value_and_grad(default_loss)(nnx.merge(graphdef, s), batch))(state)))
    assert "checkpoint" in jaxprs[0] or "remat" in jaxprs[0]
    assert jnp.isfinite(loss)
    assert jax.tree.structure(grads) == jax.tree.structure(nnx.state(model, nnx.Param))


def test_checkpoint_layer_plain_function() -> None:
    def layer(w: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ w)

    wrapped = rj.checkpoint_layer(layer, "dots_saveable")
    w, x = jnp.ones((4, 4)) * 0.1, jnp.ones((2, 4))
    g = jax.grad(lambda w: wrapped(w, x).sum())(w)
    g_ref = jax.grad(lambda w: layer(w, x).sum())(w)
    np.testing.assert_allclose(g, g_ref, rtol=1e-6)
    assert "checkpoint" in str(jax.make_jaxpr(lambda w: wrapped(w, x))(w)) or \
        "remat" in str(jax.make_jaxpr(lambda w: wrapped(w, x))(w))
