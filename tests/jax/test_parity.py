"""Every strategy keeps the loss and every gradient within 1e-5 (relative) of no remat."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import remat.jax as rj
from remat.jax.models import TAGGED_NAMES

from .conftest import TINY, TINY_BATCH


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    """The model and its batch, built when a test here runs (not at collection: each
    xdist worker collects every module)."""
    return rj.build_model(TINY), rj.make_batch(TINY, TINY_BATCH)


_policies = st.one_of(
    st.sampled_from(["none", "nothing_saveable", "dots_saveable",
                     "dots_with_no_batch_dims_saveable"]),
    st.sets(st.sampled_from(TAGGED_NAMES), min_size=1, max_size=3).map(
        lambda names: "save_only_these_names:" + ",".join(sorted(names))),
)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(per_block=st.lists(_policies, min_size=2, max_size=2))
def test_any_per_block_policies_keep_gradients(tiny: tuple[Any, Any],
                                               per_block: list[str]) -> None:
    model, batch = tiny
    report = rj.validate(model, batch, dict(zip(["blocks.0", "blocks.1"], per_block,
                                                strict=True)))
    assert report.passed, (per_block, report.max_rel_error, report.worst_param)
    assert rj.decisions_of(model) == {}  # validate leaves the model as it was


def test_named_strategies_keep_gradients(tiny: tuple[Any, Any]) -> None:
    model, batch = tiny
    for strategy in ["full", "every:2", "sqrt", "offload:qkv,mlp_up"]:
        report = rj.validate(model, batch, strategy)
        assert report.max_rel_error <= 1e-5, (strategy, report.max_rel_error)
        assert len(report.per_param_rel_error) > 10
