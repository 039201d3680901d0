"""Ground truth for the tracker: the CPU allocator's own events over one training step.

A thin test-side wrapper over :func:`remat.measure.allocator.allocator_peak` (NOTE [ What
the allocator peak includes ] there): the same step ``remat.profile`` tracks, after a
warm-up step and from cleared gradients, with the bytes alive before it added back by the
caller (the profiler only sees allocations made while it runs).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.measure.allocator import allocator_peak
from remat.measure.step import clear_grads, run_step

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
    run_step(model, batch, optimizer=optimizer)
    clear_grads(model)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # as the tracked step: frees happen when reference counts say
    try:
        peak = allocator_peak(lambda: run_step(model, batch, optimizer=optimizer)).peak_bytes
    finally:
        if gc_was_enabled:
            gc.enable()
    clear_grads(model)
    return AllocatorPeak(peak_bytes=peak, baseline_bytes=baseline_bytes)
