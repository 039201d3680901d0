"""A gradient-accumulation job on the CPU allocator: the ground truth ``accumulating=True``
measurements and plans are checked against (NOTE [ Gradients held from the step's start ]
in remat/measure/tracker.py)."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from remat.measure.allocator import allocator_peak
from remat.measure.step import Step, clear_grads, run_step

_profile = importlib.import_module("remat.measure.profile")


def accumulation_peak(model: nn.Module, batch: Any,
                      optimizer: torch.optim.Optimizer | None = None, *, cycles: int = 1) -> int:
    """The allocator's peak of ``cycles`` accumulation cycles of ``model`` as it is: each
    two micro-steps, the second starting with the first's gradients and stepping
    ``optimizer`` (then ``zero_grad``), the bytes alive before each cycle added; gradients
    cleared first and after."""
    clear_grads(model)
    peaks = []
    for _ in range(cycles):
        start = _profile.start_bytes(Step(model, batch, optimizer=optimizer))

        def cycle() -> None:
            run_step(model, batch)  # micro-step 1: no gradients at its start
            run_step(model, batch, optimizer=optimizer)  # micro-step 2
        peaks.append(allocator_peak(cycle).peak_bytes + start)
        clear_grads(model)
    return max(peaks)
