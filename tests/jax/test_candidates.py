"""The block-chain shortcut measures candidates as the whole step does (NOTE [ Block chain ])."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

import remat.jax as rj
from remat.jax.candidates import JaxCandidate, candidate_tables

from .conftest import PLANNER, PLANNER_BATCH


@cache
def tables() -> tuple[Any, Any, dict[str, tuple[JaxCandidate, ...]],
                      dict[str, tuple[JaxCandidate, ...]]]:
    model = rj.build_model(PLANNER)
    batch = rj.make_batch(PLANNER, PLANNER_BATCH)
    # the policies plan() keeps on this model (NOTE [ Pruning before compiling ]), so the
    # plans of test_exact_plan_agrees_with_fast_plan reuse these compiles
    few = dict(policies=["nothing_saveable", "dots_saveable",
                         "dots_with_no_batch_dims_saveable", "save_only_these_names:qkv",
                         "save_only_these_names:attn_out", "save_only_these_names:mlp_up"],
               default_policies=False, prune=False)
    block = candidate_tables(model, batch, measure="block", **few)  # type: ignore[arg-type]
    step = candidate_tables(model, batch, measure="step", **few)  # type: ignore[arg-type]
    return model, batch, block, step


def test_block_chain_matches_whole_step() -> None:
    _, _, block, step = tables()
    fast, exact = block["blocks.0"], step["blocks.0"]
    assert [c.label() for c in fast] == [c.label() for c in exact]
    none_saved = exact[0].saved_bytes
    most = max(c.recompute_flops for c in exact)
    for f, e in zip(fast, exact, strict=True):
        # measured: the two differ by 8 KiB and 40 kFLOP per candidate on this model
        assert abs(f.saved_bytes - e.saved_bytes) <= 0.02 * none_saved, (
            f"{f.label()}: chain saves {f.saved_bytes} B, whole step {e.saved_bytes} B "
            f"(none: {none_saved} B)")
        assert abs(f.recompute_flops - e.recompute_flops) <= 0.02 * most, (
            f"{f.label()}: chain recomputes {f.recompute_flops}, step {e.recompute_flops}")
    # the order the solver sees is the same: by saved bytes, by recompute
    assert [c.label() for c in sorted(fast, key=lambda c: (c.saved_bytes, c.label()))] == \
        [c.label() for c in sorted(exact, key=lambda c: (c.saved_bytes, c.label()))]


def test_exact_plan_agrees_with_fast_plan() -> None:
    model, batch, _, _ = tables()
    none = rj.analyze_step(model, batch).peak_bytes
    fast = rj.plan(model, batch, budget=int(0.6 * none))
    exact = rj.plan(model, batch, budget=int(0.6 * none), measure="step")
    assert fast.measured_peak_bytes is not None and exact.measured_peak_bytes is not None
    assert fast.measured_peak_bytes <= fast.budget_bytes
    assert exact.measured_peak_bytes <= exact.budget_bytes
    assert fast.recompute_flops <= exact.recompute_flops * 1.02, (fast.label(), exact.label())


def test_bad_measure() -> None:
    model, batch, _, _ = tables()
    with pytest.raises(ValueError, match="measure"):
        rj.plan(model, batch, budget="50%", measure="guess")  # type: ignore[arg-type]


def test_difference_options_keep_the_differences() -> None:
    """NOTE [ Difference compiles ]: chains compiled faster give the same tables."""
    from remat.jax.analysis import StepAnalysis, _analysis_options, default_loss, difference_options
    from remat.jax.block_measure import block_inputs
    from remat.jax.chains import lower_chains
    from remat.jax.policies import NONE, Policy

    model, batch, _, _ = tables()
    inputs = block_inputs(model, batch, ["blocks.0"], default_loss)["blocks.0"]
    policies = [NONE, Policy("nothing_saveable"), Policy("dots_saveable")]
    # 2-block chains: not compiled (hence not cached) anywhere else
    lowered = [lower()[1] for _, lower in lower_chains(model.blocks[0], inputs, policies,
                                                          blocks=2)]
    assert all(lo is not None for lo in lowered)
    default = [StepAnalysis.of(lo.compile(compiler_options=_analysis_options()))
               for lo in lowered]
    fast = [StepAnalysis.of(lo.compile(compiler_options=difference_options()))
            for lo in lowered]
    assert [a.peak_bytes - default[0].peak_bytes for a in default] == \
        [a.peak_bytes - fast[0].peak_bytes for a in fast]
    assert [a.flops - default[0].flops for a in default] == \
        [a.flops - fast[0].flops for a in fast]
    assert default[1].peak_bytes < default[0].peak_bytes  # the chain does see the policy
