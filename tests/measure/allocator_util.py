"""Ground truth for the tracker: the CPU allocator's own events over one training step.

Test-side stand-in for ``remat.measure.allocator`` (being written separately); the lead
will unify the two.

NOTE [ Allocator ground truth ]
    ``torch.profiler.profile(profile_memory=True)`` records every allocation and free
    the c10 CPU allocator serves while it is active (``_EventType.Allocation`` nodes of
    the event tree, with the signed ``alloc_size``), whatever created the tensor: an
    aten op, a scalar wrapped by ``TensorIterator``, autograd's own buffers. Summing
    them in time order gives the bytes the step allocated on top of what was alive
    before it; the maximum of that running sum is the step's peak above its baseline.
    Sizes are the requested ``nbytes``, exactly what the tracker counts (the CPU
    allocator aligns to 64 B but reports the request).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

from remat.measure.step import clear_grads, run_step

__all__ = ["AllocatorPeak", "allocator_peak", "allocator_step_peak"]


@dataclass(frozen=True)
class AllocatorPeak:
    """The allocator's view of one step.

    Attributes:
        peak_bytes: highest bytes allocated during the step above ``baseline_bytes``.
        baseline_bytes: bytes alive before the step, as the caller counts them (the
            profiler only sees the step).
    """

    peak_bytes: int
    baseline_bytes: int

    @property
    def absolute_peak_bytes(self) -> int:
        return self.peak_bytes + self.baseline_bytes


def _allocations(prof: Any) -> list[tuple[int, int]]:
    found: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                found.append((node.start_time_ns, fields.alloc_size))
        stack.extend(node.children)
    found.sort()
    return found


def allocator_peak(step: Any, *, baseline_bytes: int = 0) -> AllocatorPeak:
    """Run ``step()`` under the profiler; return the allocator's peak above the start.

    See NOTE [ Allocator ground truth ].
    """
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                           record_shapes=False) as prof:
            step()
    finally:
        if gc_was_enabled:
            gc.enable()
    running = peak = 0
    for _, size in _allocations(prof):
        running += size
        peak = max(peak, running)
    return AllocatorPeak(peak_bytes=peak, baseline_bytes=baseline_bytes)


def allocator_step_peak(model: nn.Module, batch: Any, *, baseline_bytes: int = 0,
                        optimizer: torch.optim.Optimizer | None = None) -> AllocatorPeak:
    """The step ``remat.profile`` tracks (after a warm-up step, from cleared grads)."""
    torch.manual_seed(0)
    clear_grads(model)
    run_step(model, batch, optimizer=optimizer)
    clear_grads(model)
    result = allocator_peak(lambda: run_step(model, batch, optimizer=optimizer),
                            baseline_bytes=baseline_bytes)
    clear_grads(model)
    return result
