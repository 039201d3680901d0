"""Reserved bytes of a program or a training step: allocations replayed through the model of
PyTorch's CUDA caching allocator (:mod:`remat.core.caching_allocator`).

:func:`replay` runs any sequence of ``(key, signed bytes, stream)`` events;
:func:`predict_step_reserved` runs a training step's :class:`AllocationLog` twice, as a
job's first and steady steps, and reports what each reserves: the number a job's
``torch.cuda.max_memory_reserved()`` shows and runs out of memory on.

NOTE [ Reserved bytes of a step ]
    Rule 1. What exists before the step (the log's ``preexisting``: parameters, buffers,
    gradients, optimizer state, batch, in the order they were registered) is allocated
    first, on an empty allocator, as a job allocates its model before training.

    Rule 2. The first step has no optimizer state: torch's optimizers create it lazily in
    ``step()``. Pre-existing ``"optimizer_state"`` entries are therefore allocated when the
    optimizer phase starts (``optimizer_start``), after the backward's frees, in the
    first step only. A log recorded on a first step already creates the state in its
    events; a log without an optimizer phase allocates it with the rest (Rule 1).

    Rule 3. The steady step replays the same events on the allocator the first step left
    (its cached segments included). What the first step created and never freed (optimizer
    state made lazily, gradients kept across steps, the returned loss) exists already: it
    is not created again. A pre-existing storage the first step freed is not freed again.

    Rule 4. ``first_step_reserved_bytes`` is the peak reserved from the start through the
    first step (what ``torch.cuda.max_memory_reserved()`` reads after it);
    ``steady_reserved_bytes`` the peak reserved during the second step, peaks reset before
    it. Reserved bytes drop only when a capacity forces a release, so without one the
    steady figure is never below the first; they are equal when the first step's segments
    serve the second.

    Rule 5. The log holds what the tracker sees (NOTE [ What the tracker cannot see ] in
    remat/measure/tracker.py): storages, not cuBLAS/cuDNN workspaces or a kernel's own
    temporaries, and with one size per storage (a resize is a free, then an allocation).
    The unrounded live bytes of the log replayed once as recorded
    (:attr:`AllocationLog.live_peak_bytes`, ``replay(log.as_events())``) are therefore the
    tracker's peak; allocated bytes add the 512 B rounding and unsplit blocks, reserved
    bytes the segments around them. (The steady step of a log recorded on a first step
    holds the optimizer state from its start, so its live bytes may be higher.)
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from remat.core.allocator_settings import AllocatorSettings
from remat.core.caching_allocator import AllocatorOutOfMemory, CachingAllocatorModel, OutOfMemory
from remat.errors import message

#: One allocation-log entry: ``(key, signed bytes, kind, stream)``; positive bytes
#: allocate a new storage, negative free it.
LogEntry = tuple[Hashable, int, str, int]
#: The kind of pre-existing optimizer state (NOTE [ Reserved bytes of a step ], Rule 2).
OPTIMIZER_STATE = "optimizer_state"

SettingsLike = AllocatorSettings | str | None


def as_settings(settings: SettingsLike) -> AllocatorSettings:
    """``settings`` as :class:`AllocatorSettings`: a ``PYTORCH_CUDA_ALLOC_CONF`` string is
    parsed, ``None`` is torch's defaults."""
    if settings is None:
        return AllocatorSettings()
    if isinstance(settings, str):
        return AllocatorSettings.parse(settings)
    return settings


@dataclass(frozen=True)
class AllocationLog:
    """The storages one training step allocates and frees, in order, with what it starts
    with: what :func:`predict_step_reserved` replays. ``MemoryTracker.allocations``
    records one.

    Args:
        preexisting: ``(key, bytes, kind, stream)`` of every storage alive when the step
            starts, in the order it was registered (``kind``: ``"params"``,
            ``"buffers"``, ``"grads"``, ``"optimizer_state"``, ``"batch"``, ``"other"``).
        events: ``(key, signed bytes, kind, stream)`` in the order they happened:
            positive bytes allocate a storage, negative free one (``kind``: the phase
            that created it, or its registered kind).
        optimizer_start: the index in ``events`` where the optimizer phase starts;
            ``None`` without one.

    Example:
        >>> log = AllocationLog(preexisting=((0, 4096, "params", 0),),
        ...                     events=((1, 1024, "forward", 0), (1, -1024, "forward", 0)))
        >>> log.live_peak_bytes
        5120
    """

    preexisting: tuple[LogEntry, ...] = ()
    events: tuple[LogEntry, ...] = ()
    optimizer_start: int | None = None

    def __post_init__(self) -> None:
        if self.optimizer_start is not None and not 0 <= self.optimizer_start <= len(
                self.events):
            raise ValueError(message("AllocationLog", "optimizer_start is outside the events",
                                     {"optimizer_start": self.optimizer_start,
                                      "events": len(self.events)},
                                     fix="pass an index into events, or None"))
        bad = [e for e in self.preexisting if e[1] <= 0]
        if bad:
            raise ValueError(message("AllocationLog", "pre-existing storages need bytes > 0",
                                     {"found": bad[:3]}, fix="leave zero-byte storages out"))

    @property
    def preexisting_bytes(self) -> int:
        """Bytes alive when the step starts."""
        return sum(e[1] for e in self.preexisting)

    @property
    def live_peak_bytes(self) -> int:
        """The most bytes alive at once, unrounded: the pre-existing ones plus the events'
        running sum (the tracker's peak for a log it recorded, NOTE [ Reserved bytes of a
        step ], Rule 5)."""
        live = peak = self.preexisting_bytes
        for entry in self.events:
            live += entry[1]
            if live > peak:
                peak = live
        return peak

    def as_events(self) -> list[tuple[Hashable, int, int]]:
        """The log as one sequence for :func:`replay`: the pre-existing storages allocated,
        then the events (one step, the optimizer state existing from the start)."""
        out: list[tuple[Hashable, int, int]] = [
            (("pre", key), nbytes, stream) for key, nbytes, _, stream in self.preexisting]
        pre = {key for key, *_ in self.preexisting}
        live: set[Hashable] = set()
        for key, signed, _, stream in self.events:
            if signed > 0:
                live.add(key)
                out.append((key, signed, stream))
            elif signed < 0:
                if key in live:
                    live.discard(key)
                    out.append((key, signed, stream))
                elif key in pre:
                    pre.discard(key)
                    out.append((("pre", key), signed, stream))
        return out


@dataclass(frozen=True)
class ReplayResult:
    """What a sequence of allocations reserved (:func:`replay`).

    Args:
        peak_allocated_bytes: the most bytes in allocated blocks at once (requests
            rounded to 512 B, unsplit blocks whole): ``max_memory_allocated()``.
        peak_reserved_bytes: the most bytes in segments at once: ``max_memory_reserved()``.
        peak_requested_bytes: the most bytes requested and not freed at once, unrounded.
        allocated_bytes: bytes allocated after the last event.
        reserved_bytes: bytes reserved after the last event.
        segment_count: segments held after the last event.
        largest_free_block_bytes: the largest cached free block after the last event.
        events_replayed: events run (all of them unless it ran out of memory).
        alloc_retries: times the cache was released to retry a new segment.
        capacity_bytes: the capacity replayed against (``None``: no limit).
        out_of_memory: the request that failed, or ``None``.
    """

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_requested_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    segment_count: int
    largest_free_block_bytes: int
    events_replayed: int
    alloc_retries: int = 0
    capacity_bytes: int | None = None
    out_of_memory: OutOfMemory | None = None

    @property
    def fits(self) -> bool:
        """Every event ran without running out of memory."""
        return self.out_of_memory is None

    @property
    def fragmentation_bytes(self) -> int:
        """Peak reserved beyond peak allocated: what the segments cost on top of the blocks."""
        return self.peak_reserved_bytes - self.peak_allocated_bytes

    def headroom_bytes(self, budget_bytes: int) -> int:
        """``budget_bytes`` minus the peak reserved (negative: over the budget)."""
        return budget_bytes - self.peak_reserved_bytes


def replay(events: Iterable[tuple[Hashable, int, int]], settings: SettingsLike = None,
           capacity_bytes: int | None = None) -> ReplayResult:
    """Replay allocations through the caching allocator model; report what they reserve.

    The trade-off against summing live bytes: a few microseconds per event buys the
    bytes a job actually holds (segments, rounding, fragmentation, per-stream pools), which
    is what runs out of memory; see NOTE [ CUDA caching allocator model ] in
    caching_allocator.py for what is modelled.

    Args:
        events: ``(key, signed bytes, stream)``: positive bytes allocate a new storage
            named ``key`` on ``stream``, negative bytes free it (the amount is not used);
            zero is skipped.
        settings: the allocator's options, or a ``PYTORCH_CUDA_ALLOC_CONF`` string.
            Default: torch's defaults.
        capacity_bytes: the memory the allocator may reserve; ``None`` for no limit.
            Past it, the replay stops at the request that fails (``out_of_memory``).
            Default: ``None``.

    Example:
        >>> r = replay([("a", 3 << 20, 0), ("b", 3 << 20, 0), ("a", -(3 << 20), 0)])
        >>> r.peak_reserved_bytes >> 20, r.peak_allocated_bytes >> 20
        (20, 6)
    """
    model = CachingAllocatorModel(as_settings(settings), capacity_bytes)
    malloc, free = model.malloc, model.free
    count, oom = 0, None
    try:
        for key, signed, stream in events:
            if signed > 0:
                malloc(key, signed, stream)
            elif signed < 0:
                free(key)
            count += 1
    except AllocatorOutOfMemory as error:
        oom = error.oom
    return ReplayResult(model.peak_allocated_bytes, model.peak_reserved_bytes,
                        model.peak_requested_bytes, model.allocated_bytes, model.reserved_bytes,
                        model.segment_count, model.largest_free_block_bytes, count,
                        model.alloc_retries, capacity_bytes, oom)


@dataclass(frozen=True)
class StepReserved:
    """A training step's reserved bytes on its first and its steady step
    (:func:`predict_step_reserved`; NOTE [ Reserved bytes of a step ]).

    Args:
        first_step_reserved_bytes: peak reserved from the start through the first step.
        steady_reserved_bytes: peak reserved during a later step; ``None`` when the first
            ran out of memory.
        first_step_allocated_bytes: peak allocated (rounded blocks) through the first step.
        steady_allocated_bytes: peak allocated during the steady step, or ``None``.
        peak_requested_bytes: the most bytes alive at once, unrounded, either step.
        segment_count: segments held after the last step replayed.
        largest_free_block_bytes: the largest cached free block after it.
        alloc_retries: times the cache was released to retry a new segment.
        capacity_bytes: the capacity replayed against (``None``: no limit).
        out_of_memory: the request that failed, or ``None``.
        out_of_memory_step: ``"first"`` or ``"steady"`` when one failed, else ``None``.
        settings_conf: the allocator settings, as a ``PYTORCH_CUDA_ALLOC_CONF`` value.

    Example:
        >>> log = AllocationLog(((0, 4 << 20, "params", 0),),
        ...                     ((1, 3 << 20, "forward", 0), (1, -(3 << 20), "forward", 0)))
        >>> p = predict_step_reserved(log)
        >>> p.first_step_reserved_bytes >> 20, p.steady_reserved_bytes >> 20
        (20, 20)
    """

    first_step_reserved_bytes: int
    steady_reserved_bytes: int | None
    first_step_allocated_bytes: int
    steady_allocated_bytes: int | None
    peak_requested_bytes: int
    segment_count: int
    largest_free_block_bytes: int
    alloc_retries: int = 0
    capacity_bytes: int | None = None
    out_of_memory: OutOfMemory | None = None
    out_of_memory_step: str | None = None
    settings_conf: str = ""

    @property
    def reserved_bytes(self) -> int:
        """The larger of the two steps' reserved peaks: what the job needs to hold."""
        return max(self.first_step_reserved_bytes, self.steady_reserved_bytes or 0)

    @property
    def peak_allocated_bytes(self) -> int:
        """The larger of the two steps' allocated peaks (512 B rounding and whole unsplit
        blocks included): ``torch.cuda.max_memory_allocated()``."""
        return max(self.first_step_allocated_bytes, self.steady_allocated_bytes or 0)

    @property
    def fits(self) -> bool:
        """Both steps ran within the capacity."""
        return self.out_of_memory is None

    @property
    def fragmentation_bytes(self) -> int:
        """Reserved beyond allocated at the peaks: the segments' cost on top of the blocks."""
        return self.reserved_bytes - self.peak_allocated_bytes

    def headroom_bytes(self, budget_bytes: int) -> int:
        """``budget_bytes`` minus :attr:`reserved_bytes` (negative: over the budget)."""
        return budget_bytes - self.reserved_bytes

    def fits_in(self, budget_bytes: int) -> bool:
        """Both steps ran and reserve at most ``budget_bytes``."""
        return self.fits and self.reserved_bytes <= budget_bytes


def predict_step_reserved(log: AllocationLog, settings: SettingsLike = None,
                          capacity_bytes: int | None = None) -> StepReserved:
    """A training step's reserved bytes on a job's first step and on a steady step.

    Allocates what exists before the step, replays the step (the optimizer state created
    when the optimizer phase starts), then replays it again from the state the first left
    (NOTE [ Reserved bytes of a step ]).

    Args:
        log: the step's allocations (``MemoryTracker.allocations``).
        settings: the allocator's options, or a ``PYTORCH_CUDA_ALLOC_CONF`` string.
            Default: torch's defaults.
        capacity_bytes: the memory the allocator may reserve; ``None`` for no limit.
            Default: ``None``.

    Example:
        >>> log = AllocationLog(((0, 1 << 20, "params", 0),),
        ...                     ((1, 40 << 20, "forward", 0), (1, -(40 << 20), "forward", 0)))
        >>> predict_step_reserved(log, capacity_bytes=32 << 20).out_of_memory_step
        'first'
    """
    cfg = as_settings(settings)
    model = CachingAllocatorModel(cfg, capacity_bytes)
    steps = _Steps(model, log)
    first_reserved = first_allocated = requested = 0
    steady_reserved: int | None = None
    steady_allocated: int | None = None
    oom, oom_step = None, None
    try:
        steps.start()
        steps.run(first=True)
    except AllocatorOutOfMemory as error:
        oom, oom_step = error.oom, "first"
    first_reserved, first_allocated = model.peak_reserved_bytes, model.peak_allocated_bytes
    requested = model.peak_requested_bytes
    if oom is None:
        model.reset_peak()
        try:
            steps.run(first=False)
        except AllocatorOutOfMemory as error:
            oom, oom_step = error.oom, "steady"
        else:
            steady_reserved = model.peak_reserved_bytes
            steady_allocated = model.peak_allocated_bytes
        requested = max(requested, model.peak_requested_bytes)
    return StepReserved(first_reserved, steady_reserved, first_allocated, steady_allocated,
                        requested, model.segment_count, model.largest_free_block_bytes,
                        model.alloc_retries, capacity_bytes, oom, oom_step, cfg.conf)


class _Steps:
    """The two replays of a log on one allocator (NOTE [ Reserved bytes of a step ])."""

    def __init__(self, model: CachingAllocatorModel, log: AllocationLog) -> None:
        self.model, self.log = model, log
        self.pre_live: set[Hashable] = set()
        self.survivors: set[Hashable] = set()
        self.late = (() if log.optimizer_start is None else
                     tuple(e for e in log.preexisting if e[2] == OPTIMIZER_STATE))

    def start(self) -> None:
        """Rule 1: what exists before the step, optimizer state aside when it comes late."""
        late = {e[0] for e in self.late}
        for key, nbytes, _, stream in self.log.preexisting:
            if key not in late:
                self.model.malloc(("pre", key), nbytes, stream)
                self.pre_live.add(key)

    def _create_late(self) -> None:
        for key, nbytes, _, stream in self.late:  # Rule 2
            self.model.malloc(("pre", key), nbytes, stream)
            self.pre_live.add(key)

    def run(self, *, first: bool) -> None:
        """One step: the events, with Rule 2 in the first and Rule 3 in the steady one."""
        model, pre_live = self.model, self.pre_live
        malloc, free = model.malloc, model.free
        tag = 1 if first else 2
        skip = self.survivors
        live: dict[Hashable, tuple[int, Hashable]] = {}
        at = self.log.optimizer_start if first and self.late else None
        for index, (key, signed, _, stream) in enumerate(self.log.events):
            if index == at:
                self._create_late()
            if signed > 0:
                if key in skip:
                    continue
                name = (tag, key)
                malloc(name, signed, stream)
                live[key] = name
            elif signed < 0:
                name_or_none = live.pop(key, None)
                if name_or_none is not None:
                    free(name_or_none)
                elif key in pre_live:
                    pre_live.discard(key)
                    free(("pre", key))
        if at is not None and at == len(self.log.events):
            self._create_late()
        if first:
            self.survivors = set(live)
