"""Plans fit on the allocator: NOTE [ Fits on the allocator ] in remat/planning/loop.py.

Every plan's peak on the CPU allocator is at most its budget on the first step after
``remat.apply`` (a fresh copy of the model, a fresh AdamW whose state that step creates:
NOTE [ The first step ] in remat/measure/profile.py) and on the third, on ten
architectures, each at one of three budgets (rotated, so every budget is checked on three or
four architectures of different kinds); and the closed loop tightens when the allocator reads
a choice over the budget that the tracker reads under it.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

import remat
from accumulation_job import accumulation_peak
from loading import load_measure_helper
from remat.measure import profile
from remat.measure.profile import first_step_peak
from remat.measure.step import Step
from remat.planning import loop as planning_loop
from remat.planning import prepare

pytest.importorskip("transformers")

hf_tiny = load_measure_helper("hf_tiny")

#: Ten architectures: dense decoders (rotary, GQA, partial rotary, GeGLU, learned
#: positions, parallel attention), mixture-of-experts decoders, an encoder.
ARCHS = ("llama", "qwen2", "phi", "gemma", "gpt_neox", "gpt2", "mixtral", "qwen2_moe",
         "olmoe", "bert")
FRACTIONS = (0.25, 0.5, 0.75)


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def first_and_third_step(pristine: torch.nn.Module, batch: Any, plan: Any) -> tuple[int, int]:
    """Allocator peaks (bytes alive before each step added) of the first and the third
    training step of a fresh copy of ``pristine`` with ``plan`` applied, as a job runs
    them (a new AdamW, whose state the first step creates), the first being the higher of
    a new job's and a resumed one's (the plan applied anew over the state of a step)."""
    model = copy.deepcopy(pristine)
    remat.apply(model, plan)
    step = Step(model, batch, optimizer=_adamw(model))
    new = first_step_peak(step)  # the bytes alive before each step are counted anew
    remat.apply(model, plan)  # a resumed job: the optimizer state exists, the regions new
    peaks = [first_step_peak(step) for _ in range(3)]
    return max(new, peaks[0]), peaks[2]


def _none_and_full(model: torch.nn.Module, batch: Any, opt: torch.optim.Optimizer, *,
                   accumulating: bool = False) -> tuple[int, int]:
    """The tracked peaks of ``none`` and ``full`` with ``opt`` (the model is restored)."""
    none_peak = profile(model, batch, optimizer=opt, timing=False,
                        accumulating=accumulating).peak_bytes
    remat.apply(model, "full")
    full_peak = profile(model, batch, optimizer=opt, timing=False,
                        accumulating=accumulating).peak_bytes
    remat.remove(model)
    assert full_peak < none_peak, (full_peak, none_peak)
    return none_peak, full_peak


#: Each architecture at one budget, the three budgets rotated over the list: every budget
#: (tight, half-way, loose) is planned on dense decoders, mixtures of experts and the encoder
#: alike, for a third of the plans of every architecture at every budget.
ROTATED = tuple((arch, (FRACTIONS[i % len(FRACTIONS)],)) for i, arch in enumerate(ARCHS))


@pytest.mark.parametrize(("arch", "fractions"), ROTATED, ids=ARCHS)
def test_plans_fit_on_the_first_and_the_third_step(arch: str,
                                                   fractions: tuple[float, ...]) -> None:
    pristine, batch = hf_tiny.build_hf(arch, batch_size=2, seq=32)
    model = copy.deepcopy(pristine)
    opt = _adamw(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        none_peak, full_peak = _none_and_full(model, batch, opt)
        context = prepare(model, batch, optimizer=opt)
        for fraction in fractions:
            budget = int(full_peak + fraction * (none_peak - full_peak))
            plan = remat.plan(model, batch, optimizer=opt, budget=budget, context=context)
            assert plan.allocator_peak_bytes is not None
            assert plan.measured_peak_bytes is not None
            assert plan.measured_peak_bytes <= budget, (arch, fraction)
            assert plan.allocator_peak_bytes <= budget, (arch, fraction)
            first, third = first_and_third_step(pristine, batch, plan)
            assert first <= budget and third <= budget, (
                f"{arch} at {fraction:.0%}: first step {first} B, third {third} B, "
                f"budget {budget} B")
            # the closed loop read the same two steps, byte for byte
            assert max(first, third) == plan.allocator_peak_bytes, (arch, fraction, first, third)


def test_the_loop_tightens_when_the_allocator_reads_over() -> None:
    # Kernel scratch the tracker cannot see, made just large enough that the plan the
    # loop returns without it would be over on the allocator. The loop must not return
    # a choice that fits the tracker only, and must return one that fits both.
    model, batch = hf_tiny.build_hf("llama", batch_size=2, seq=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        none_peak = profile(model, batch, timing=False).peak_bytes
        remat.apply(model, "full")
        full_peak = profile(model, batch, timing=False).peak_bytes
        remat.remove(model)
        budget = (full_peak + none_peak) // 2
        context = prepare(model, batch)
        honest = remat.plan(model, batch, budget=budget, context=context)
        assert honest.measured_peak_bytes is not None
        scratch = budget - honest.measured_peak_bytes + 1024
        real = planning_loop.allocator_peak_of
        seen: list[int] = []

        def with_scratch(*args: Any) -> int:
            seen.append(real(*args) + scratch)
            return seen[-1]

        planning_loop.allocator_peak_of = with_scratch  # type: ignore[assignment]
        try:
            tight = remat.plan(model, batch, budget=budget, context=context)
        finally:
            planning_loop.allocator_peak_of = real  # type: ignore[assignment]
    assert honest.allocator_peak_bytes is not None and tight.allocator_peak_bytes is not None
    assert tight.allocator_peak_bytes <= budget
    assert tight.measured_peak_bytes is not None
    assert tight.allocator_peak_bytes == tight.measured_peak_bytes + scratch
    assert tight.measured_peak_bytes < honest.measured_peak_bytes
    assert len(seen) >= 2 and seen[0] > budget  # the first fit on the tracker was over


@pytest.mark.parametrize("seed", range(4))
def test_plans_of_generated_models_fit_on_the_first_and_the_third_step(seed: int) -> None:
    """Seeded random decoders (tests/generated_models.py), half-way between full and none."""
    from generated_models import generated_model

    drawn = generated_model(1000 + seed)
    pristine, batch = drawn.model, drawn.batch
    model = copy.deepcopy(pristine)
    opt = _adamw(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        none_peak, full_peak = _none_and_full(model, batch, opt)
        budget = (full_peak + none_peak) // 2
        plan = remat.plan(model, batch, optimizer=opt, budget=budget)
        first, third = first_and_third_step(pristine, batch, plan)
    assert first <= budget and third <= budget, (drawn.label, first, third, budget)
    assert max(first, third) == plan.allocator_peak_bytes, drawn.label


def accumulation_cycles_peak(pristine: torch.nn.Module, batch: Any, plan: Any) -> int:
    """The allocator's peak of the first two accumulation cycles of a fresh copy of
    ``pristine`` with ``plan`` applied and a new AdamW (whose state the first cycle makes)."""
    model = copy.deepcopy(pristine)
    remat.apply(model, plan)
    return accumulation_peak(model, batch, _adamw(model), cycles=2)


@pytest.mark.parametrize("seed", range(2))
def test_accumulating_plans_fit_gradient_accumulation(seed: int) -> None:
    """``remat.plan(..., accumulating=True)`` fits a job that steps its optimizer every
    second micro-batch, on seeded random decoders, half-way between full and none of that
    step; a plan made without it is over on the same job by about the gradients."""
    from generated_models import generated_model

    drawn = generated_model(1100 + seed)
    pristine, batch = drawn.model, drawn.batch
    model = copy.deepcopy(pristine)
    opt = _adamw(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        none_peak, full_peak = _none_and_full(model, batch, opt, accumulating=True)
        budget = (full_peak + none_peak) // 2
        plan = remat.plan(model, batch, optimizer=opt, budget=budget, accumulating=True)
        held = accumulation_cycles_peak(pristine, batch, plan)
        assert held <= budget, (drawn.label, held, budget)
        assert held == plan.allocator_peak_bytes, drawn.label
        if seed == 0:
            plain = remat.plan(model, batch, optimizer=opt, budget=budget)
            grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            over = accumulation_cycles_peak(pristine, batch, plain) - budget
            assert over > grad_bytes // 2, (drawn.label, over, grad_bytes)
