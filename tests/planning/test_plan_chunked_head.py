"""The planner's chunked-head choice (NOTE [ Head choice ]): a head-dominated step at a
budget no block-only plan reaches."""

from __future__ import annotations

import copy
import warnings
from dataclasses import replace

import pytest
import torch

import remat
from remat.errors import BudgetTooSmall
from remat.models import build_model
from remat.planning.context import PlanContext, prepare
from remat.planning.plans import Plan
from remat.strategies.builtin import ChunkedHead
from remat.strategies.head import HEAD_KEY


def _head_heavy() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Vocabulary 4096, d 32, 2 x 64 tokens: logits 2 MiB in float32, blocks ~0.1 MiB."""
    model = build_model("llama-tiny", vocab_size=4096, d_model=32, n_head=2, n_kv_head=1,
                        d_ff=64, max_seq_len=64)
    torch.manual_seed(1)
    ids = torch.randint(0, 4096, (2, 64))
    labels = ids.clone()
    labels[:, :5] = -100
    return model, {"input_ids": ids, "labels": labels}


def _grads(model: torch.nn.Module, batch: dict[str, torch.Tensor]
           ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _block_only(model: torch.nn.Module, batch: dict[str, torch.Tensor]
                ) -> PlanContext:
    """A context whose model cannot chunk its head (no fake copy to measure it on)."""
    return replace(prepare(model, batch), setup=None)


def test_plan_chunks_the_head_below_every_block_only_peak() -> None:
    model, batch = _head_heavy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        remat.apply(model, "full")
        lowest_block_only = remat.profile(model, batch, timing=False).peak_bytes
        remat.remove(model)
        none_peak = remat.profile(model, batch, timing=False).peak_bytes
    logits_bytes = 2 * 64 * 4096 * 4
    assert none_peak - lowest_block_only < logits_bytes // 4  # blocks hold little
    budget = lowest_block_only - logits_bytes // 2
    with pytest.raises(BudgetTooSmall):  # no block-only plan reaches it ...
        remat.plan(model, batch, budget=budget, context=_block_only(model, batch))
    plan = remat.plan(model, batch, budget=budget)  # ... the chunked head does
    head = plan.decisions.get(HEAD_KEY)
    assert isinstance(head, ChunkedHead) and head.chunks >= 2
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= budget
    assert plan.allocator_peak_bytes is not None and plan.allocator_peak_bytes <= budget
    assert plan.predicted_peak_bytes == plan.measured_peak_bytes  # exact on CPU
    loaded = Plan.from_json(plan.to_json())
    assert loaded.decisions == plan.decisions and loaded.decision(HEAD_KEY) == head
    reference = copy.deepcopy(model)
    expected_loss, expected = _grads(reference, batch)
    remat.apply(model, loaded)
    loss, grads = _grads(model, batch)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)

