"""A plan for several shapes: planned at the largest, proven at the others on the allocator
(NOTE [ Planning for several shapes ]); the shape envelope in the plan and its file."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import remat
from generated_models import generated_model
from measure.hf_tiny import build_hf
from remat.measure.profile import first_step_peak
from remat.measure.shapes import batch_envelope
from remat.measure.step import Step
from tiny_nets import Block

#: Three families of tests/measure/hf_tiny.py (mixtral: a mixture of experts, routing each
#: batch its own way) and two generated decoders (tests/generated_models.py: seed 9 an OPT,
#: learned positions and a ReLU MLP; seed 1 a Qwen2, grouped-query attention).
ARCHITECTURES = ("llama", "gpt2", "mixtral", "generated-9", "generated-1")


def _model(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name.startswith("generated-"):
            drawn = generated_model(int(name.split("-")[1]), batch_size=2, seq=32)
            return drawn.model, drawn.batch
        return build_hf(name, batch_size=2, seq=32)


def _cut(batch: dict[str, torch.Tensor], rows: int, seq: int) -> dict[str, torch.Tensor]:
    return {k: v[:rows, :seq] for k, v in batch.items()}


def _allocator_peak(model: nn.Module, plan: remat.Plan, batch: Any, *,
                    adamw: bool = True) -> int:
    """The highest allocator peak of a job's first steps with ``plan`` applied as a user
    applies it (guard included): a job starting (AdamW state created in the step), a job
    resumed (state loaded, regions new), then a steady step. ``adamw=False``: a step with
    no optimizer, as a plan made without one."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if adamw else None
    step = Step(model, batch, optimizer=optimizer)
    remat.apply(model, plan)
    peaks = [first_step_peak(step)]
    remat.apply(model, plan)
    peaks += [first_step_peak(step), first_step_peak(step)]
    remat.remove(model)
    return max(peaks)


def _none_and_full(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer
                   ) -> tuple[int, int]:
    """The tracked peaks of ``none`` and ``full`` at ``batch`` (the model is restored)."""
    none_peak = remat.profile(model, batch, optimizer=optimizer, timing=False).peak_bytes
    remat.apply(model, "full")
    full_peak = remat.profile(model, batch, optimizer=optimizer, timing=False).peak_bytes
    remat.remove(model)
    assert full_peak < none_peak, (full_peak, none_peak)
    return none_peak, full_peak


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_a_plan_made_at_the_largest_shape_fits_every_smaller_one(name: str) -> None:
    model, largest = _model(name)
    smaller = [_cut(largest, 2, 16), _cut(largest, 1, 24)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # half-way between full and none at the largest shape: a plan has to checkpoint
        # (a fraction of none's peak can fall below full's where the optimizer dominates)
        none_peak, full_peak = _none_and_full(model, largest, optimizer)
        budget = (none_peak + full_peak) // 2
        plan = remat.plan(model, smaller[0], budget=budget, optimizer=optimizer,
                          shapes=[largest, smaller[1]])
        # the largest batch was planned (its peak without checkpointing), the others proven
        assert plan.budget_bytes == budget and not plan.is_empty
        assert plan.no_checkpoint_peak_bytes == none_peak
        assert plan.shape_envelope == batch_envelope(model, largest)
        for batch in (largest, *smaller):
            assert _allocator_peak(model, plan, batch) <= budget, batch_envelope(
                model, batch).label()


class Widening(nn.Module):
    """Two MLP blocks; an optional ``wide`` input repeats the sequence ``wide.shape[1]``
    times, so a batch with fewer elements holds more activations (as an input the
    largest batch lacks, or another expert routing, can make a smaller batch peak
    higher)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor, wide: torch.Tensor | None = None) -> torch.Tensor:
        if wide is not None:
            x = x.repeat(1, wide.shape[1], 1)
        for block in self.blocks:
            x = block(x)
        return self.out(x).square().mean()


def test_a_smaller_batch_that_peaks_higher_is_planned_for() -> None:
    model = Widening()
    largest = {"x": torch.randn(4, 32, 64)}
    higher = {"x": torch.randn(4, 8, 64), "wide": torch.zeros(1, 5)}  # (4, 40, 64) inside
    none_largest = remat.profile(model, largest, timing=False).peak_bytes
    budget = int(1.05 * none_largest)  # the largest alone needs no checkpointing
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert remat.plan(model, largest, budget=budget).is_empty
        plan = remat.plan(model, largest, budget=budget, shapes=[higher])
    assert not plan.is_empty and plan.budget_bytes == budget
    assert plan.shape_envelope == batch_envelope(model, largest, higher)
    assert len(plan.shape_envelope.shapes) == 2  # two boxes: neither holds the other
    for batch in (largest, higher):
        assert _allocator_peak(model, plan, batch, adamw=False) <= budget
    # (4, 64, 64) inside: over the budget even with every block checkpointed
    with pytest.raises(remat.BudgetTooSmall, match="^remat.plan: no plan fits every shape"):
        remat.plan(model, largest, budget=budget,
                   shapes=[{"x": torch.randn(4, 8, 64), "wide": torch.zeros(1, 8)}])
    with pytest.raises(ValueError, match="context= and shapes= do not go together"):
        remat.plan(model, largest, budget=budget, shapes=[higher],
                   context=remat.planning.prepare(model, largest))


def test_the_plan_file_keeps_the_envelope_and_old_files_still_load() -> None:
    model = Widening()
    batch = {"x": torch.randn(4, 32, 64)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = remat.auto(model, batch, budget="95%", on_new_shape="warn", simulate=True)
    remat.remove(model)
    data = plan.to_dict()
    assert data["shape_envelope"] == {"shapes": [{"x": [4, 32, 64]}]}
    assert data["on_new_shape"] == "warn"
    assert remat.Plan.from_json(plan.to_json()) == plan
    old = {k: v for k, v in data.items() if k not in ("shape_envelope", "on_new_shape")}
    read = remat.Plan.from_dict(old)
    assert read.shape_envelope is None and read.on_new_shape == "error"
    with pytest.raises(ValueError, match="unknown on_new_shape"):
        remat.Plan.from_dict({**data, "on_new_shape": "explode"})


def test_a_padded_batch_runs_another_path_and_shapes_covers_it() -> None:
    """NOTE [ A batch without padding ]: an all-ones attention mask runs another attention
    path than a padded one of the same shape, which the guard lets through; a plan made on
    the unpadded batch alone runs over on the padded one (69 KB on this model), and passing
    the padded batch in ``shapes=`` makes one plan that fits both."""
    import copy

    model, batch = build_hf("llama", batch_size=4, seq=64)
    unpadded = {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}
    padded = {**unpadded, "attention_mask": unpadded["attention_mask"].clone()}
    padded["attention_mask"][2, 30:] = 0  # a short row, padded on the right

    def first_steps(plan: remat.Plan) -> list[int]:
        work = copy.deepcopy(model)
        remat.apply(work, plan)
        return [first_step_peak(Step(work, b)) for b in (unpadded, padded)]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = remat.plan(model, unpadded, budget="60%")
        peaks = first_steps(alone)
        assert peaks[0] <= alone.budget_bytes < peaks[1], (peaks, alone.budget_bytes)
        both = remat.plan(model, unpadded, budget=alone.budget_bytes, shapes=[padded])
        assert max(first_steps(both)) <= both.budget_bytes == alone.budget_bytes
