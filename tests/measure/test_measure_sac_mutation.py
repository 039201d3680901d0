"""A saved op output that the forward later mutates in place is recomputed.

See NOTE [ Saved outputs mutated in place ] in remat/strategies/sac.py.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import remat
from remat.blocks import named_blocks
from remat.strategies.apply import apply_decisions
from remat.strategies.builtin import SelectiveOps
from remat.strategies.sac import sac_context_fn


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def _region(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = torch.mm(x, w)  # saved by the policy below
    y.add_(1.0)  # ... and then mutated in place, as DeBERTa's ``score += p2c / scale``
    return (y.sin() * y).sum()


@pytest.mark.parametrize("save_ops", [{"aten.mm"}, {"aten.mm#0"}])
def test_mutated_saved_output_is_recomputed(save_ops: set[str]) -> None:
    # Raised "Tensor cached during selective activation checkpoint has been mutated"
    # before the fix.
    _assert_checkpointed_grads_equal(_region, sac_context_fn(save_ops))


def _assert_checkpointed_grads_equal(fn: Any, context_fn: Any) -> None:
    """``fn(x, w)``'s gradients, checkpointed with ``context_fn``, equal the plain ones."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    fn(x, w).backward()
    expected = (x.grad.clone(), w.grad.clone())  # type: ignore[union-attr]
    x.grad = w.grad = None
    checkpoint(fn, x, w, use_reentrant=False, context_fn=context_fn).backward()
    assert torch.equal(x.grad, expected[0]) and torch.equal(w.grad, expected[1])  # type: ignore[arg-type]


def _three_mms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a = torch.mm(x, w)
    b = torch.mm(a, w)
    b.mul_(0.5)  # only the middle call's output is mutated
    c = torch.mm(b, w)
    return (a.sin() * b.cos() * c.tanh()).sum()


@pytest.mark.parametrize("save_ops", [{"aten.mm"}, {"aten.mm#1", "aten.mm#2"},
                                      {"aten.mm#0", "aten.mm#1"}])
def test_a_mutated_call_between_saved_calls_of_the_same_op(save_ops: set[str]) -> None:
    # Before torch.utils.checkpoint._RECOMPUTE, SAC keeps one list per op, popped in order
    # in recompute: the mutated entry must leave the list and its call be recomputed, or the
    # calls after it get the wrong cached outputs.
    context_fn = sac_context_fn(save_ops)
    _assert_checkpointed_grads_equal(_three_mms, context_fn)
    assert context_fn.last_policy.seen["aten.mm"] == 3  # type: ignore[attr-defined]


def test_deberta_v2_saved_adds_keep_gradients() -> None:
    pytest.importorskip("transformers")
    hf_tiny = _load("hf_tiny")
    model, batch = hf_tiny.build_hf("deberta-v2")
    for p in model.modules():
        if isinstance(p, torch.nn.Dropout):
            p.p = 0.0
    model(**batch).loss.backward()
    expected = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    names = [n for n, _ in named_blocks(model)]
    apply_decisions(model, {n: SelectiveOps(frozenset({"aten.add", "aten.bmm"}))
                            for n in names})
    model(**batch).loss.backward()
    got = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_deberta_v2_plan_measures_its_candidates() -> None:
    # The planner's candidates include save sets naming the attention's in-place-updated
    # adds; measuring them crashed (about 10 s: the planner measures every candidate).
    pytest.importorskip("transformers")
    model, batch = _load("hf_tiny").build_hf("deberta-v2")
    plan = remat.plan(model, batch, budget="80%")
    assert plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes <= plan.budget_bytes
