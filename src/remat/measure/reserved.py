"""The reserved bytes of a tracked step: its allocation log replayed through the model of
PyTorch's CUDA caching allocator (NOTE [ Reserved bytes of a step ] in
remat/core/allocator_replay.py)."""

from __future__ import annotations

from remat.core.allocator_replay import (
    AllocationLog,
    SettingsLike,
    StepReserved,
    predict_step_reserved,
)
from remat.errors import message
from remat.measure.tracker import MemoryTracker


def reserved_of_step(source: MemoryTracker | AllocationLog, settings: SettingsLike = None, *,
                     capacity_bytes: int | None = None) -> StepReserved:
    """What a tracked step reserves under the CUDA caching allocator, first and steady step.

    The tracker's peak counts live tensor bytes; a job runs out of memory on the segments
    the allocator reserves around them (512 B rounding, 2 and 20 MiB segments, cached free
    blocks). This replays the step's allocations, as the tracker logged them, through
    :class:`~remat.core.caching_allocator.CachingAllocatorModel`: the step's storages on
    one device, so track with ``MemoryTracker(device="cuda")`` (``tracked_step`` does) when
    the step also touches host memory. Works on a fake step as on a real one.

    Args:
        source: a tracker that ran the step (its :attr:`~MemoryTracker.allocations`), or
            the log itself.
        settings: the allocator's options, a ``PYTORCH_CUDA_ALLOC_CONF`` string, or ``None``
            for torch's defaults (``AllocatorSettings.from_env()`` reads the job's).
        capacity_bytes: the memory the allocator may reserve; ``None`` for no limit.
            Default: ``None``.

    Returns:
        A :class:`~remat.core.allocator_replay.StepReserved`: reserved and allocated peaks
        of the first and the steady step, segments, and out-of-memory details.

    Example:
        >>> model = torch.nn.Linear(256, 256)
        >>> tracker = MemoryTracker()
        >>> tracker.register_model(model)
        263168
        >>> with tracker:
        ...     model(torch.randn(8, 256)).sum().backward()
        >>> prediction = reserved_of_step(tracker, "expandable_segments:True")
        >>> prediction.first_step_reserved_bytes >> 20  # one 2 MiB page of the small pool
        2
        >>> prediction.peak_allocated_bytes >= tracker.peak_bytes
        True
    """
    if isinstance(source, MemoryTracker):
        log = source.allocations
    elif isinstance(source, AllocationLog):
        log = source
    else:
        raise TypeError(message("reserved_of_step", "source must be a MemoryTracker or an "
                                "AllocationLog", {"found": type(source).__name__},
                                fix="pass the tracker that ran the step"))
    return predict_step_reserved(log, settings, capacity_bytes)
