"""The allocator's own peak for one call: what the memory allocator saw, not what remat tracks.

:class:`~remat.measure.tracker.MemoryTracker` counts storages through a
``TorchDispatchMode``, which a compiled model cannot run under (see NOTE
[ Measuring compiled code ] in compiled/measure.py). :func:`allocator_peak` asks the
allocator instead, so it works for eager and compiled steps alike.

NOTE [ What the allocator peak includes ]
    ``peak_bytes`` is the highest value, during ``step``, of the bytes allocated
    on ``device`` minus the bytes allocated just before ``step`` started: the
    step's own high-water mark, with whatever was alive before (parameters,
    optimizer state, the batch) excluded. Add those back to compare with
    :attr:`remat.core.results.Profile.peak_bytes`.

    * CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``,
      minus ``memory_allocated`` before. The caching allocator rounds every block
      up to 512 bytes (and counts cuBLAS / attention workspaces), so this reads
      a little higher than a sum of storage sizes. ``baseline_bytes`` is
      ``memory_allocated`` before the step.
    * CPU: the CPU allocator reports every allocation and free to the PyTorch
      profiler (``profile_memory=True``); the events are walked in order and the
      running sum's maximum is the peak. The profiler only knows the size of
      blocks allocated while it runs, so a free of a block that existed before
      ``step`` is *not* seen (PyTorch warns "Memory block of unknown size"; we
      silence it): such frees cannot lower the figure. Clear gradients before
      the step (as :func:`profile_compiled` does) so a step frees nothing older
      than itself. There is no CPU counter of live bytes, so
      ``baseline_bytes`` is 0 on CPU. Sizes are the requested ``nbytes`` (the
      CPU allocator does not round). The profiler observes the ``record_function``
      ranges only (``RecordScope.USER_SCOPE``: the marks below), not each aten op:
      the allocator reports to it whichever ops run, so the events are the same, and
      neither the step nor the reading of its events pays for a record per op.
    The step's return value is dropped inside the window, so whatever it returns
    is freed before the window closes and does not linger in ``end_bytes``.

NOTE [ Phase marks ]
    ``step`` may call :func:`mark` (``mark("backward")``) to split the window into
    phases; ``mark_bytes[name]`` is then the live bytes (above the baseline) at the
    mark, and ``phase_peak_bytes[name]`` the peak from that mark to the next. On
    CPU a mark is a zero-length ``record_function`` range, an event in the same
    profiler timeline as the allocations; on CUDA it reads ``memory_allocated`` and
    ``max_memory_allocated`` and resets the peak. Neither is a dispatch mode or a
    module hook, so marks placed *between* calls of a compiled model (as
    :func:`~remat.measure.step.run_step`'s ``on_phase`` does) leave what dynamo
    compiles unchanged. Events before the first mark belong to phase ``"start"``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from remat.errors import message

_API = "remat.measure.allocator_peak"

# Lines the profiler and the CPU allocator print to stderr while profiling; see quiet_profiler.
_MARK = "remat.mark::"
_active: list[Callable[[str], None]] = []  # the running window's mark handler, if any

_NOISE = ("USDT:", "Memory block of unknown size", "SyncActivityProfilerHandler",
          "ActivityProfilerController", "CuptiActivityProfiler")


@dataclass(frozen=True)
class AllocatorPeak:
    """The allocator's high-water mark during one call (see NOTE [ What the allocator
    peak includes ]).

    Args:
        peak_bytes: highest bytes allocated during the call above ``baseline_bytes``.
        baseline_bytes: bytes allocated on the device just before the call (0 on CPU,
            which has no such counter).
        end_bytes: bytes still allocated (above the baseline) when the call returned,
            e.g. gradients.
        device: the device measured, e.g. ``"cpu"``.
        events: allocation and free events seen (CPU) or 0 (CUDA).
        mark_bytes: live bytes above the baseline at each :func:`mark`, by name (the
            last mark of a name wins); see NOTE [ Phase marks ].
        phase_peak_bytes: peak from each mark to the next, by mark name (plus
            ``"start"`` for the part before the first mark).
    """

    peak_bytes: int
    baseline_bytes: int
    end_bytes: int
    device: str
    events: int = 0
    mark_bytes: Mapping[str, int] = field(default_factory=dict, hash=False)
    phase_peak_bytes: Mapping[str, int] = field(default_factory=dict, hash=False)

    @property
    def peak_phase(self) -> str | None:
        """The phase (mark name) in which the peak was reached; None without marks."""
        if not self.phase_peak_bytes:
            return None
        return max(self.phase_peak_bytes.items(), key=lambda kv: kv[1])[0]

    def __post_init__(self) -> None:
        for key in ("peak_bytes", "baseline_bytes", "events"):
            if getattr(self, key) < 0:
                raise ValueError(message("AllocatorPeak", f"{key} must be >= 0",
                                         {"found": getattr(self, key)}, fix=f"pass {key} >= 0"))
        if self.end_bytes > self.peak_bytes:
            raise ValueError(message("AllocatorPeak", "end_bytes cannot exceed peak_bytes",
                                     {"end_bytes": self.end_bytes,
                                      "peak_bytes": self.peak_bytes},
                                     fix="pass end_bytes <= peak_bytes"))


@contextmanager
def quiet_profiler() -> Iterator[None]:
    """Hold back the profiler's C++ log lines (``USDT: ... profiler_start``, the CPU
    allocator's "unknown size" warning) while the block runs.

    File descriptor 2 is redirected to a temporary file; on exit every other line
    written there (the user's own output, real warnings) is written back to
    ``sys.stderr``, so nothing else is lost.
    """
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no real stderr (some notebook kernels): nothing to silence
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            kept = [line for line in sink.read().decode(errors="replace").splitlines(True)
                    if not any(marker in line for marker in _NOISE)]
            if kept:
                sys.stderr.write("".join(kept))


@contextmanager
def no_cycle_warning() -> Iterator[None]:
    """Drop torch.profiler's "Profiler clears events at the end of each cycle" warning.

    Torch 2.11 (and earlier) warns on the first cycle of every ``profile`` object, not
    only when a second cycle drops the first's events (2.13 warns only then); remat's
    profilers run one cycle each, so the warning tells the user nothing to act on.
    Enter it around the profiler's start only.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events",
                                category=UserWarning)
        yield


def mark(name: str) -> None:
    """Mark a phase boundary inside :func:`allocator_peak`'s window (no-op outside one).

    See NOTE [ Phase marks ].

    Example:
        >>> def step():
        ...     a = torch.empty(1 << 18)
        ...     mark("backward")
        ...     del a
        >>> allocator_peak(step).mark_bytes["backward"]
        1048576
    """
    if _active:
        _active[-1](name)


def _cpu_events(results: Any, device: torch.device) -> list[tuple[int, int, str | None]]:
    """``(time_ns, signed bytes, None)`` of every allocation (+) and free (-) on ``device``
    the step made, and ``(time_ns, 0, name)`` of every :func:`mark`, in the order they
    happened, from the profiler's ``results`` (:func:`_cpu_profile`).

    NOTE [ Events with equal timestamps ]
        The profiler's clock can give an allocation and a free the same
        ``start_time_ns``; ordering such a pair by the event tree put a free before
        the allocation that preceded it and read the peak one block low (seen once:
        4096 B on a 276 KB step). Every allocation event also carries the
        allocator's running total *after* it (``total_allocated``), so within a
        group of equal times the events are chained: the next one is the event
        whose total before it (``total - delta``) is the running total so far.
        Events that do not chain (another allocator's totals) keep tree order.

    NOTE [ Frees of older blocks ]
        The profiler knows a block's size if it was allocated while *any* profiler
        with ``profile_memory`` ran in the process, not only this one: a block left
        over from an earlier measured step (kept alive by a reference cycle, say) and
        freed during this one shows as a sized free and lowered this step's running
        sum (4-12 KB on ~270 KB test steps, depending on which tests ran before in
        the same process). A free counts only if its block was allocated inside the
        window (by address, in order), so, as NOTE [ What the allocator peak
        includes ] says, nothing older than the step can lower its figure.
    """
    from torch._C._profiler import _EventType

    raw: list[tuple[int, int, int | None, str | None, int]] = []
    allocation, torch_op, device_type = _EventType.Allocation, _EventType.TorchOp, device.type
    stack = list(results.experimental_event_tree())
    while stack:  # every allocation of a step (thousands) and its marks: read only what is used
        node = stack.pop()
        kind = node.tag
        if kind == allocation:  # a leaf
            fields = node.extra_fields
            if fields.device.type == device_type:
                raw.append((int(node.start_time_ns), int(fields.alloc_size),
                            int(fields.total_allocated), None, int(fields.ptr)))
            continue
        stack.extend(node.children)
        if kind == torch_op:
            name = node.name
            if name.startswith(_MARK):
                raw.append((int(node.start_time_ns), 0, None, name[len(_MARK):], 0))
    events: list[tuple[int, int, str | None]] = []
    live: set[int] = set()  # blocks allocated in the window and not freed yet
    for time_ns, delta, _, name, ptr in _in_order(raw):
        if delta > 0:
            live.add(ptr)
        elif delta < 0:
            if ptr not in live:
                continue  # NOTE [ Frees of older blocks ]
            live.discard(ptr)
        events.append((time_ns, delta, name))
    return events


Raw = TypeVar("Raw", bound=tuple[Any, ...])


def _in_order(raw: list[Raw]) -> list[Raw]:
    """``raw`` events ``(time_ns, delta, total after or None, mark name or None, ...)``
    sorted by time, equal times chained by the allocator's running total (NOTE [ Events
    with equal timestamps ])."""
    raw = sorted(raw, key=lambda e: e[0])  # stable: equal times keep tree order
    events: list[Raw] = []
    total: int | None = None
    i = 0
    while i < len(raw):
        j = i
        while j < len(raw) and raw[j][0] == raw[i][0]:
            j += 1
        group = raw[i:j]
        if total is None:  # first group: start from the event no other one leads to
            afters = {e[2] for e in group if e[2] is not None}
            total = next((e[2] - e[1] for e in group
                          if e[2] is not None and e[2] - e[1] not in afters), None)
        while group:
            pick = 0
            if total is not None:
                pick = next((k for k, e in enumerate(group)
                             if e[2] is not None and e[2] - e[1] == total), 0)
            event = group.pop(pick)
            if event[2] is not None:
                total = event[2]
            events.append(event)
        i = j
    return events


def _cpu_mark(name: str) -> None:
    with torch.autograd.profiler.record_function(_MARK + name):
        pass


def _cpu_profile(step: Callable[[], object]) -> Any:
    """Run ``step()`` under the profiler with memory events and the ``record_function``
    ranges only (NOTE [ What the allocator peak includes ]); its results."""
    from torch._C._autograd import _disable_profiler, _enable_profiler, _prepare_profiler
    from torch._C._profiler import (
        ProfilerActivity,
        ProfilerConfig,
        ProfilerState,
        RecordScope,
        _ExperimentalConfig,
    )
    from torch.autograd.profiler import _run_on_profiler_start, _run_on_profiler_stop

    config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False,
                            _ExperimentalConfig())
    activities = {ProfilerActivity.CPU}
    _prepare_profiler(config, activities)
    _run_on_profiler_start()
    # ``scopes`` is missing from PyTorch's stub, not from the function
    _enable_profiler(config, activities, {RecordScope.USER_SCOPE})  # type: ignore[call-arg]
    try:
        step()
    finally:
        results = _disable_profiler()
        _run_on_profiler_stop()
    return results


def _peak_cpu(step: Callable[[], object], device: torch.device) -> AllocatorPeak:
    with quiet_profiler():
        _active.append(_cpu_mark)
        try:
            results = _cpu_profile(step)
        finally:
            _active.pop()
        events = _cpu_events(results, device)
    live = peak = count = 0
    phase = "start"
    marks: dict[str, int] = {}
    phases: dict[str, int] = {phase: 0}
    for _, delta, name in events:
        if name is not None:
            phase = name
            marks[name] = live
            phases[name] = max(phases.get(name, 0), live)
            continue
        count += 1
        live += delta
        peak = max(peak, live)
        phases[phase] = max(phases[phase], live)
    if not marks:
        phases = {}
    return AllocatorPeak(peak_bytes=peak, baseline_bytes=0, end_bytes=max(live, 0),
                         device=str(device), events=count, mark_bytes=marks,
                         phase_peak_bytes=phases)


def _peak_cuda(step: Callable[[], object], device: torch.device) -> AllocatorPeak:
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    marks: dict[str, int] = {}
    phases: dict[str, int] = {}
    current = ["start"]

    def close_phase() -> None:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        phases[current[0]] = max(phases.get(current[0], 0), peak)

    def on_mark(name: str) -> None:
        close_phase()
        marks[name] = torch.cuda.memory_allocated(device) - before
        current[0] = name
        torch.cuda.reset_peak_memory_stats(device)

    torch.cuda.reset_peak_memory_stats(device)
    _active.append(on_mark)
    try:
        step()
    finally:
        _active.pop()
    close_phase()
    end = torch.cuda.memory_allocated(device) - before
    peak = max(max(phases.values()), 0)
    return AllocatorPeak(peak_bytes=peak, baseline_bytes=before,
                         end_bytes=min(end, peak), device=str(device),
                         mark_bytes=marks, phase_peak_bytes=phases if marks else {})


def allocator_peak(step: Callable[[], object], *,
                   device: torch.device | str = "cpu") -> AllocatorPeak:
    """Run ``step()`` once and return the allocator's high-water mark above where it started.

    This is the ground truth for code remat cannot trace op by op, compiled code
    above all: no ``TorchDispatchMode`` or hook is installed, so what runs is what
    would run anyway. CPU peaks come from the profiler's memory events (a few ms of
    overhead, no change to what runs), CUDA peaks from the caching allocator's
    statistics. See NOTE [ What the allocator peak includes ] for exactly what counts.

    Args:
        step: called once with no arguments; its return value is dropped.
        device: the device whose allocator is read, ``"cpu"`` or ``"cuda[:i]"``.
            Default: ``"cpu"``.

    Returns:
        An :class:`AllocatorPeak`.

    Raises:
        ValueError: a device other than CPU or CUDA.

    Example:
        >>> def step():
        ...     a = torch.empty(1 << 18)        # 1 MiB
        ...     del a
        ...     b, c = torch.empty(1 << 17), torch.empty(1 << 17)  # 2 x 512 KiB
        >>> allocator_peak(step).peak_bytes
        1048576
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        return _peak_cpu(step, dev)
    if dev.type == "cuda":
        return _peak_cuda(step, dev)
    raise ValueError(message(_API, "device must be 'cpu' or 'cuda'", {"found": repr(str(dev))},
                             fix="measure on 'cpu' or 'cuda' (other allocators expose no peak "
                                 "this function knows how to read)"))
