"""Micro-batches in flight (NOTE [ Micro-batches in flight ]): a pipeline stage's step with
k forwards before its backwards holds k - 1 more micro-batches, counted exactly."""

from __future__ import annotations

import pytest
import torch

import remat
from remat.distributed.stage import LlamaStage
from remat.distributed.stage_loss import StageLoss
from remat.measure.step import Step
from remat.models import build_model, make_batch
from remat.planning.context import PlanContext, prepare
from remat.planning.loop import measure_decisions
from remat.strategies.builtin import Full


def _stage() -> tuple[LlamaStage, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model("llama-tiny", n_layer=4)
    stage = LlamaStage(model, stage_index=0, stages=2).train()
    return stage, make_batch(model, 16, 32)["input_ids"]


@pytest.fixture(scope="module")
def prepared() -> tuple[LlamaStage, torch.Tensor, dict[int, PlanContext]]:
    """The stage, its batch and its contexts with 1 and 3 micro-batches in flight
    (measured once: the first two tests read the same measurements)."""
    stage, ids = _stage()
    loss = StageLoss()
    return stage, ids, {k: prepare(stage, ids, loss_fn=loss, microbatches_in_flight=k)
                        for k in (1, 3)}


def test_k_in_flight_adds_exactly_k_minus_one_micro_batches(
        prepared: tuple[LlamaStage, torch.Tensor, dict[int, PlanContext]]) -> None:
    stage, ids, contexts = prepared
    loss = StageLoss()
    pm = contexts[3].peak_model
    assert pm.held_copies == 2 and contexts[1].peak_model.held_copies == 0
    # Without checkpointing: one micro-batch keeps both blocks' saved tensors, plus the
    # stage's output and the embedding's (held_bytes, > 0: the output (16, 32, 64) fp32).
    one = sum(t[0].saved_bytes for t in pm.tables) + pm.held_bytes
    assert pm.held_bytes >= 16 * 32 * 64 * 4
    assert contexts[3].no_checkpoint_peak_bytes - contexts[1].no_checkpoint_peak_bytes == 2 * one
    # The measured steps (tracked, real tensors) differ by the same bytes, every block
    # fully checkpointed or not at all.
    names = contexts[1].block_names
    for decisions in ({}, dict.fromkeys(names, Full())):
        peaks = [measure_decisions(Step(stage, ids, loss_fn=loss, microbatches_in_flight=k),
                                   decisions).peak_bytes for k in (1, 2, 3)]
        full = [next(c for c in t if c.parts == (("", Full()),)) for t in pm.tables]
        saved = sum(c.saved_bytes for c in full) if decisions else \
            sum(t[0].saved_bytes for t in pm.tables)
        assert peaks[1] - peaks[0] == peaks[2] - peaks[1] == saved + pm.held_bytes, peaks
        choice = [t.index(c) for t, c in zip(pm.tables, full, strict=True)] if decisions \
            else [0] * len(names)
        assert pm.predict(choice) == peaks[2]


def test_plan_with_k_in_flight_fits_and_is_predicted(
        prepared: tuple[LlamaStage, torch.Tensor, dict[int, PlanContext]]) -> None:
    stage, ids, contexts = prepared
    plan = remat.plan(stage, ids, budget="75%", loss_fn=StageLoss(), microbatches_in_flight=3,
                      context=contexts[3])
    assert plan.decisions  # the budget binds
    assert plan.allocator_peak_bytes is not None
    assert plan.measured_peak_bytes <= plan.budget_bytes
    assert plan.allocator_peak_bytes <= plan.budget_bytes
    assert plan.cost.peak_bytes == plan.measured_peak_bytes


def test_microbatches_in_flight_is_validated() -> None:
    stage, ids = _stage()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="microbatches_in_flight"):
            Step(stage, ids, microbatches_in_flight=bad)  # type: ignore[arg-type]


def test_plan_stage_counts_the_schedule() -> None:
    from remat.distributed.stage import plan_stage, stage_in_flight

    counts = {s: [stage_in_flight(s, stage_index=i, stages=2, microbatches=4) for i in (0, 1)]
              for s in ("gpipe", "1f1b")}
    assert counts == {"gpipe": [4, 4], "1f1b": [2, 1]}  # m; min(m, p - s)
    stage, ids = _stage()
    plan = plan_stage(stage, ids, budget="100%", schedule="1f1b", stage_index=0, stages=2,
                      microbatches=4)
    k2 = prepare(stage, ids, loss_fn=StageLoss(accumulating=True), microbatches_in_flight=2)
    assert plan.no_checkpoint_peak_bytes == k2.no_checkpoint_peak_bytes
    assert plan.measured_peak_bytes == plan.no_checkpoint_peak_bytes
