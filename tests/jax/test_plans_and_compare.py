"""Plan values and JSON (property-based), and compare's rows for the shared table/plot."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

import remat.jax as rj
from remat.core.rows import ComparisonResult, StrategyRow
from remat.errors import StrategyError
from remat.jax.analysis import compile_in_pool, default_loss, step_executable, step_fn
from remat.jax.models import TAGGED_NAMES
from remat.jax.strategies import strategy_policies

from .conftest import TINY, TINY_BATCH

_policy = st.one_of(
    st.sampled_from(["none", "nothing_saveable", "dots_saveable",
                     "dots_with_no_batch_dims_saveable"]),
    st.sets(st.sampled_from(TAGGED_NAMES), min_size=1).map(
        lambda n: "save_only_these_names:" + ",".join(sorted(n))),
    st.sets(st.sampled_from(TAGGED_NAMES), min_size=1).map(
        lambda n: "offload:" + ",".join(sorted(n))),
)


@given(policies=st.lists(_policy, min_size=1, max_size=12),
       budget=st.integers(0, 2**40), peak=st.integers(0, 2**40),
       flops=st.integers(0, 2**50))
def test_plan_json_roundtrip(policies: list[str], budget: int, peak: int, flops: int) -> None:
    names = tuple(f"blocks.{i}" for i in range(len(policies)))
    plan = rj.Plan(decisions=dict(zip(names, policies, strict=True)), block_names=names,
                   budget_bytes=budget, predicted_peak_bytes=peak, measured_peak_bytes=peak,
                   recompute_flops=flops, no_checkpoint_peak_bytes=peak, batch_size=2)
    again = rj.Plan.from_json(plan.to_json())
    assert again == plan
    assert all(not p.is_none for p in plan.decisions.values())
    assert [again.decision(n).label() for n in names] == [
        rj.Policy(*_split(p)).label() for p in policies]


def _split(text: str) -> tuple[str, tuple[str, ...]]:
    kind, _, rest = text.partition(":")
    return kind, tuple(rest.split(",")) if rest else ()


@given(n=st.integers(1, 64), every=st.integers(1, 70))
def test_every_and_sqrt_shapes(n: int, every: int) -> None:
    every_n = strategy_policies(f"every:{every}", n)
    assert [not p.is_none for p in every_n] == [i % every == 0 for i in range(n)]
    sqrt = strategy_policies("sqrt", n)
    assert len(sqrt) == n and sqrt[-1].is_none == (n > 1)


def test_plan_validation_errors() -> None:
    with pytest.raises(ValueError, match="which is not a block"):
        rj.Plan(decisions={"blocks.9": "nothing_saveable"}, block_names=("blocks.0",),
                budget_bytes=1, predicted_peak_bytes=1)
    with pytest.raises(ValueError, match="budget_bytes"):
        rj.Plan(decisions={}, block_names=("blocks.0",), budget_bytes=-1,
                predicted_peak_bytes=1)
    with pytest.raises(StrategyError, match="policies"):
        rj.Plan(decisions={"blocks.0": "sometimes"}, block_names=("blocks.0",),
                budget_bytes=1, predicted_peak_bytes=1)


@pytest.fixture(scope="module")
def compared() -> tuple[Any, Any, ComparisonResult]:
    """``rj.compare`` of none and full on the tiny model, with the model and batch it ran
    on: compared once for the two tests that read it."""
    model = rj.build_model(TINY)
    batch = rj.make_batch(TINY, TINY_BATCH)
    return model, batch, rj.compare(model, batch, ["full"])


def test_compare_rows_are_the_shared_row_type(
        compared: tuple[Any, Any, ComparisonResult]) -> None:
    model, _, result = compared
    assert isinstance(result, ComparisonResult)
    assert result.strategies == ("none", "full")
    full = result.row("full")
    assert isinstance(full, StrategyRow)
    assert full.peak_bytes < result.row("none").peak_bytes
    assert full.recompute_flops > 0 and full.grad_passed
    assert result.meta["framework"] == "jax"
    assert rj.decisions_of(model) == {}
    ComparisonResult.from_json(result.to_json())
    from remat.report.tables import comparison_markdown

    table = comparison_markdown(result)  # the same table `remat compare` prints
    assert "| full |" in table and "PASS" in table


def test_validate_runs_the_step_compiled_for_its_analysis(
        compared: tuple[Any, Any, ComparisonResult]) -> None:
    """NOTE [ Compilation cache ]: compare's gradient check ran the executable its profile
    compiled; it computes, bit for bit, what the same step compiled afresh does."""
    model, batch, _ = compared
    rj.apply(model, "full")
    try:
        kept = step_executable(model, batch, loss_fn=default_loss)
        assert kept is not None
        graphdef, state = nnx.split(model)
        fresh = compile_in_pool(step_fn(graphdef, default_loss), state, batch).result()
        ours, theirs = kept(state, batch), fresh(state, batch)
    finally:
        rj.remove(model)
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_compare_unknown_strategy_fails_fast() -> None:
    with pytest.raises(StrategyError, match="unknown strategy"):
        rj.compare("gpt-tiny", strategies=["none", "everything"])
