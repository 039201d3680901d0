"""Gradient accumulation: a micro-step after the first starts with every gradient held
(``remat.measure.step.Accumulating``; NOTE [ Gradients held from the step's start ] in
remat/measure/tracker.py).

The ground truth is a real accumulation cycle on the CPU allocator: micro-step 1 from no
gradients, micro-step 2 over the gradients it left (and, with an optimizer, its update and
``zero_grad``), the bytes alive before the cycle added.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import remat
from accumulation_job import accumulation_peak
from remat.distributed.stage_loss import StageLoss
from remat.errors import RematWarning
from remat.measure.allocator import allocator_peak
from remat.measure.step import (
    Accumulating,
    batch_tensors,
    call_model,
    default_loss,
    run_step,
    step_loss,
    warn_zeroed_gradients,
)
from remat.models import build_model, make_batch


@pytest.fixture(scope="module", params=["gpt-tiny", "llama-tiny"])
def tiny(request: pytest.FixtureRequest) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = build_model(request.param)
    return model, make_batch(model, 4)


def test_an_accumulating_profile_is_the_real_cycles_peak(tiny: tuple[nn.Module, Any]) -> None:
    model, batch = tiny
    plain = remat.profile(model, batch, timing=False)
    held = remat.profile(model, batch, timing=False, accumulating=True)
    assert held.peak_bytes == accumulation_peak(model, batch)
    assert remat.profile(model, batch, simulate=True, accumulating=True).peak_bytes \
        == held.peak_bytes
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # the held gradients are gradients, not the forward's activations
    assert held.activation_bytes == plain.activation_bytes
    assert held.cost.breakdown[remat.Category.GRADIENTS] == grad_bytes
    assert held.peak_bytes > plain.peak_bytes


def test_an_accumulating_profile_with_an_optimizer_is_the_real_cycles_peak(
        tiny: tuple[nn.Module, Any]) -> None:
    model, batch = tiny
    work = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(work.parameters(), lr=1e-3)
    run_step(work, batch, optimizer=optimizer)  # the state exists, as from the second cycle
    held = remat.profile(work, batch, optimizer=optimizer, timing=False, accumulating=True)
    assert held.peak_bytes == accumulation_peak(work, batch, optimizer)


def test_a_loop_that_zeros_gradients_in_place_runs_the_accumulating_step(
        tiny: tuple[nn.Module, Any]) -> None:
    # optimizer.zero_grad(set_to_none=False) keeps every gradient allocated, as zeros: each
    # step after the first starts with them held, as an accumulation micro-step does.
    model, batch = tiny
    work = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(work.parameters(), lr=1e-3)

    def step() -> None:  # the user's loop (run_step would start without gradients)
        default_loss(call_model(work, batch, api="test")).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    step()
    step()  # the state and the zeroed gradients exist, as in the loop's steady state
    grad_bytes = sum(p.grad.nbytes for p in work.parameters() if p.grad is not None)
    alive = grad_bytes + sum(t.nbytes for t in (*work.parameters(), *work.buffers(),
                                                *batch_tensors(batch)))
    alive += sum(t.nbytes for state in optimizer.state.values() for t in state.values()
                 if isinstance(t, torch.Tensor))
    loop_peak = allocator_peak(step).peak_bytes + alive
    held = remat.profile(work, batch, optimizer=optimizer, timing=False, accumulating=True)
    with pytest.warns(RematWarning, match="every gradient of the model is allocated and zero"):
        plain = remat.profile(work, batch, optimizer=optimizer, timing=False)
    assert held.peak_bytes == loop_peak == plain.peak_bytes + grad_bytes


def test_zeroed_gradients_warn_and_other_gradients_do_not() -> None:
    # All allocated and zero: the state zero_grad(set_to_none=False) leaves. Gradients a
    # step left set, cleared ones, or accumulating=True: no warning.
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    batch = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RematWarning)
        warn_zeroed_gradients(model, accumulating=False, api="remat.plan")  # None
        model(batch).sum().backward()
        warn_zeroed_gradients(model, accumulating=False, api="remat.plan")  # left set
        model.zero_grad(set_to_none=False)
        warn_zeroed_gradients(model, accumulating=True, api="remat.plan")
    with pytest.warns(RematWarning) as caught:
        warn_zeroed_gradients(model, accumulating=False, api="remat.plan")
    text = str(caught[0].message)
    assert text.startswith("remat.plan: every gradient") and "accumulating=True" in text
    held = sum(p.numel() * 4 for p in model.parameters())
    assert f"{held:,} B above" in text


def test_step_loss_wraps_once_and_keeps_a_stages_loss() -> None:
    def loss(output: Any, batch: Any) -> torch.Tensor:
        return output.sum()

    assert step_loss(loss, accumulating=False, api="remat.plan") is loss
    wrapped = step_loss(loss, accumulating=True, api="remat.plan")
    assert wrapped == Accumulating(loss)
    assert step_loss(wrapped, accumulating=True, api="remat.plan") is wrapped
    assert step_loss(StageLoss(loss), accumulating=True, api="remat.plan") \
        == StageLoss(loss, accumulating=True)
    assert Accumulating()(torch.ones(3), None).item() == 1.0  # the default loss, a mean


def test_accumulating_must_be_a_bool() -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(TypeError, match=r"(?s)remat.profile: accumulating must be True or "
                                        r"False.*found: 4.*fix: pass accumulating=True"):
        remat.profile(model, torch.randn(2, 4), timing=False, accumulating=4)  # type: ignore[arg-type]
