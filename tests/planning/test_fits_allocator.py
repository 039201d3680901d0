"""Plans fit on the allocator: NOTE [ Fits on the allocator ] in remat/planning/loop.py.

Every plan's peak on the CPU allocator (the profiler's allocator events, the same step
with the plan applied) is at most its budget, on ten architectures at three budgets each;
and the closed loop tightens when the allocator reads a choice over the budget that the
tracker reads under it.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import remat
from loading import load_measure_helper
from remat.measure import profile
from remat.planning import loop as planning_loop
from remat.planning import prepare

pytest.importorskip("transformers")




hf_tiny = load_measure_helper("hf_tiny")
allocator_util = load_measure_helper("allocator_util")

#: Ten architectures: dense decoders (rotary, GQA, partial rotary, GeGLU, learned
#: positions, parallel attention), mixture-of-experts decoders, an encoder.
ARCHS = ("llama", "qwen2", "phi", "gemma", "gpt_neox", "gpt2", "mixtral", "qwen2_moe",
         "olmoe", "bert")
FRACTIONS = (0.25, 0.5, 0.75)


def _allocator_peak(model: torch.nn.Module, batch: Any) -> int:
    """The step's peak on the CPU allocator, with the bytes alive before it added back."""
    prof = profile(model, batch, timing=False)
    start = prof.param_bytes + prof.buffer_bytes + prof.batch_bytes
    return int(allocator_util.allocator_step_peak(model, batch,
                                                  baseline_bytes=start).absolute_peak_bytes)


@pytest.mark.parametrize("arch", ARCHS)
def test_plans_fit_on_the_allocator(arch: str) -> None:
    model, batch = hf_tiny.build_hf(arch, batch_size=2, seq=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        none_peak = _allocator_peak(model, batch)
        remat.apply(model, "full")
        full_peak = _allocator_peak(model, batch)
        remat.remove(model)
        assert full_peak < none_peak, (arch, full_peak, none_peak)
        context = prepare(model, batch)
        for fraction in FRACTIONS:
            budget = int(full_peak + fraction * (none_peak - full_peak))
            plan = remat.plan(model, batch, budget=budget, context=context)
            assert plan.allocator_peak_bytes is not None
            assert plan.measured_peak_bytes is not None
            assert plan.measured_peak_bytes <= budget, (arch, fraction)
            assert plan.allocator_peak_bytes <= budget, (arch, fraction)
            remat.apply(model, plan)
            measured = _allocator_peak(model, batch)
            remat.remove(model)
            assert measured <= budget, (
                f"{arch} at {fraction:.0%}: allocator {measured} B > budget {budget} B")
            assert measured == plan.allocator_peak_bytes, (arch, fraction)


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
