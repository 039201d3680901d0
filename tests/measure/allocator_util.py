"""Ground truth for the tracker: the CPU allocator's own events over one training step.

A thin test-side wrapper over :func:`remat.measure.allocator.allocator_peak` (NOTE [ What
the allocator peak includes ] there): the same step ``remat.profile`` tracks, after a
warm-up step and from cleared gradients, with the bytes alive before it added back by the
caller (the profiler only sees allocations made while it runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.measure.profile import allocator_step_peak as allocator_peak_of_step
from remat.measure.step import Step, clear_grads, run_step

__all__ = ["AllocatorPeak", "allocator_step_peak"]


@dataclass(frozen=True)
class AllocatorPeak:
    """The allocator's peak during the step above its start, and the caller's baseline."""

    peak_bytes: int
    baseline_bytes: int

    @property
    def absolute_peak_bytes(self) -> int:
        return self.peak_bytes + self.baseline_bytes


def allocator_step_peak(model: nn.Module, batch: Any, *, baseline_bytes: int = 0,
                        optimizer: torch.optim.Optimizer | None = None) -> AllocatorPeak:
    """The step ``remat.profile`` tracks (after a warm-up step, from cleared grads)."""
    torch.manual_seed(0)
    clear_grads(model)
    run_step(model, batch, optimizer=optimizer)  # warm-up
    # The allocator's step as the planner reads it (gc held, grads cleared around it).
    peak = allocator_peak_of_step(Step(model, batch, optimizer=optimizer), 0)
    return AllocatorPeak(peak_bytes=peak, baseline_bytes=baseline_bytes)
