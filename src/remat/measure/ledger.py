"""Per-kind byte accounting of live tensor storages: the bookkeeping behind MemoryTracker.

NOTE [ Storage identity and frees ]
    ``Tensor.untyped_storage()`` returns the *same* Python object for as long as
    the storage lives (PyTorch preserves a storage's PyObject while the C++
    ``StorageImpl`` is alive), so ``id(storage)`` identifies it and a
    ``weakref`` on it dies exactly when the memory is released, whichever thread
    releases it (the autograd engine runs CUDA backward on its own thread; modes
    propagate there). ``torch.distributed._tools.mem_tracker`` relies on the
    same behaviour. We never hold a strong reference to a tracked storage.

NOTE [ Allocation log ]
    Besides bytes per kind, the ledger keeps the order storages come and go, for the
    model of the CUDA caching allocator (NOTE [ Reserved bytes of a step ] in
    remat/core/allocator_replay.py): one append per storage event, ``(serial, signed
    bytes, kind, stream)``, with a serial per storage (``id()`` is reused once a storage
    dies; a serial never is). Rules:
    1. Storages registered before the tracker is first entered are what the step starts
       with (:meth:`StorageLedger.start_step`); storages found later to predate the step
       (NOTE [ What the tracker cannot see ], 2. in tracker.py) join them, as the tracker
       counts them from the start. The step ends when the tracker is last left
       (:meth:`StorageLedger.end_step`): what is freed after (the model, once the caller
       drops it) is not the step's.
    2. A resize is a free, then an allocation of the new size (how the tracker counts
       it; the allocator holds both for the copy); a kernel's modelled scratch is an
       allocation freed at once.
    3. When the engine sums gradients in place (NOTE [ Gradient accumulation in place ]
       in tracker.py), the sum is logged after the free of the buffer it reuses
       (:meth:`StorageLedger.log_after_frees`), as the real engine writes into it.
    4. The stream is CUDA's current stream when the tracker counts CUDA storages and CUDA
       is initialised when it is made; 0 elsewhere (fake tensors included).
    The replay of the log therefore reaches the tracker's peak exactly, unrounded.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from remat.core.allocator_replay import AllocationLog
from remat.core.cost import Category
from remat.core.op_record import PHASES
from remat.core.results import PhasePeak
from remat.core.timeline import MemoryTimeline
from remat.distributed.sharded import local_tensor

REGISTERED_KINDS: tuple[str, ...] = (
    "params", "buffers", "grads", "optimizer_state", "batch", "other",
)
CREATED_KINDS: tuple[str, ...] = PHASES
KINDS = frozenset(REGISTERED_KINDS + CREATED_KINDS)
#: Each kind's public :class:`~remat.core.cost.Category` (one to one; NOTE [ Categories of
#: each backend ] in remat/core/cost.py). The kinds stay inside the tracker; every record
#: it fills (Profile.peak_breakdown, PhasePeak.breakdown) is keyed by category.
KIND_CATEGORIES: Mapping[str, Category] = {
    "params": Category.PARAMETERS, "buffers": Category.BUFFERS, "grads": Category.GRADIENTS,
    "optimizer_state": Category.OPTIMIZER_STATE, "batch": Category.BATCH,
    "other": Category.OTHER, "forward": Category.ACTIVATIONS,
    "backward": Category.BACKWARD_TEMPORARIES, "recompute": Category.RECOMPUTED,
    "optimizer": Category.OPTIMIZER_TEMPORARIES,
}


def categorized(by_kind: Mapping[str, int]) -> dict[Category, int]:
    """Bytes per tracker kind as bytes per :class:`~remat.core.cost.Category` (non-zero only).

    Args:
        by_kind: bytes per kind (``"params"``, ``"forward"``, ...), bytes.
    """
    return {KIND_CATEGORIES[k]: v for k, v in by_kind.items() if v}


class StorageRecord(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a tracked storage that carries its accounting."""

    __slots__ = ("block", "key", "kind", "nbytes", "origin", "serial")

    key: int
    serial: int  # NOTE [ Allocation log ]
    nbytes: int
    kind: str
    block: str | None
    #: what created the storage, when the tracker records it (NOTE [ Saved storages ] in
    #: tracker.py): (op name, shape, dtype name) of the tensor it was created for
    origin: tuple[str, tuple[int, ...], str] | None


def storage_of(t: Tensor) -> torch.UntypedStorage | None:
    """``t``'s untyped storage, or None for layouts without one (sparse, nested).

    A ``DTensor``'s is its local shard's (NOTE [ Sharded models in the tracker ] in
    sharded.py).
    """
    try:
        return local_tensor(t).untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def tensors_in(args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> list[Tensor]:
    """Tensors among aten arguments (aten schemas nest at most one list deep)."""
    found: list[Tensor] = []
    values: Iterable[Any] = args if not kwargs else (*args, *kwargs.values())
    for a in values:
        if isinstance(a, Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(x for x in a if isinstance(x, Tensor))
    return found


def first_tensor(value: Any) -> Tensor | None:
    """The first tensor in a (nested) tuple / list / dict, depth first."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for v in value:
            t = first_tensor(v)
            if t is not None:
                return t
    if isinstance(value, Mapping):
        for v in value.values():
            t = first_tensor(v)
            if t is not None:
                return t
    return None


class StorageLedger:
    """Live storages, bytes per kind now and at the peak (the step's and each phase's).
    See NOTE [ Storage identity and frees ]."""

    def __init__(self, *, cuda_streams: bool = False) -> None:
        self.live: dict[int, StorageRecord] = {}
        self.by_kind: dict[str, int] = dict.fromkeys(sorted(KINDS), 0)
        self.current = 0
        # phase -> [peak bytes, bytes per kind then, order]; see PhasePeak. The step's
        # peak is derived from them (the largest, the earliest on ties).
        self.phase_peaks: dict[str, list[Any]] = {}
        self._now: list[str] = []  # phases whose peak is this very moment
        self._updates = 0
        # NOTE [ Memory timeline ] in remat/core/timeline.py: samples and events.
        self.samples: list[int] = []
        self.sample_phases: list[str] = []
        self.sample_blocks: list[str | None] = []
        #: the block running now (set by the tracker: NOTE [ Block attribution ])
        self.block_now: Callable[[], str | None] = lambda: None
        self.events: list[tuple[int, str, str | None, int]] = []
        self.found_later: list[tuple[int, int]] = []  # (sample, bytes) counted from the start
        # NOTE [ Allocation log ]: (serial, signed bytes, kind, stream) per storage event.
        self.allocations: list[tuple[int, int, str, int]] = []
        self.allocations_found: list[tuple[int, int, str, int]] = []
        self.step_start: int | None = None
        self.step_end: int | None = None
        self.optimizer_start: int | None = None
        self._serials = itertools.count().__next__
        self.stream_now: Callable[[], int] | None = None
        if cuda_streams and torch.cuda.is_initialized():
            self.stream_now = lambda: torch.cuda.current_stream().stream_id

    def add(self, st: torch.UntypedStorage, kind: str, block: str | None,
            origin: tuple[str, tuple[int, ...], str] | None = None) -> int:
        """Count ``st`` (not tracked yet) as ``kind``; return its bytes. ``origin``: what
        created it (:attr:`StorageRecord.origin`)."""
        nbytes = st.nbytes()
        rec = StorageRecord(st, self._on_free)
        rec.key = id(st)
        rec.nbytes = nbytes
        rec.kind = kind
        rec.block = block
        rec.origin = origin
        rec.serial = serial = self._serials()
        self.live[rec.key] = rec
        if nbytes:
            self.current += nbytes
            self.by_kind[kind] += nbytes
            self._now.clear()
            self.events.append((len(self.samples), kind, block, nbytes))
            self.allocations.append((serial, nbytes, kind, 0 if self.stream_now is None
                                     else self.stream_now()))
        return nbytes

    def add_preexisting(self, st: torch.UntypedStorage) -> None:
        """Count ``st`` as ``"other"`` from the start: now *and* at the peak."""
        nbytes = self.add(st, "other", None)
        if nbytes:  # counted from the start (NOTE [ Memory timeline ])
            self.events[-1] = (0, "other", None, nbytes)
            self.found_later.append((len(self.samples), nbytes))
            self.allocations_found.append(self.allocations.pop())  # NOTE [ Allocation log ]
        for entry in self.phase_peaks.values():  # alive at every phase's peak
            entry[0] += nbytes
            entry[1]["other"] += nbytes

    def _on_free(self, rec: StorageRecord) -> None:  # weakref callback
        if self.live.get(rec.key) is rec:
            del self.live[rec.key]
            if rec.nbytes:
                self.current -= rec.nbytes
                self.by_kind[rec.kind] -= rec.nbytes
                self._now.clear()
                self.events.append((len(self.samples), rec.kind, rec.block, -rec.nbytes))
                self.allocations.append((rec.serial, -rec.nbytes, rec.kind, 0))

    def resized(self, rec: StorageRecord, nbytes: int) -> None:
        """An op resized a tracked storage to ``nbytes``."""
        if rec.nbytes:  # NOTE [ Allocation log ], 2.
            self.allocations.append((rec.serial, -rec.nbytes, rec.kind, 0))
        rec.serial = self._serials()
        if nbytes:
            self.allocations.append((rec.serial, nbytes, rec.kind, 0 if self.stream_now is None
                                     else self.stream_now()))
        delta = nbytes - rec.nbytes
        rec.nbytes = nbytes
        self.current += delta
        self.by_kind[rec.kind] += delta
        self._now.clear()
        self.events.append((len(self.samples), rec.kind, rec.block, delta))

    def retag(self, rec: StorageRecord, kind: str) -> None:
        """Count ``rec`` as ``kind`` from now on (keeps the peak's breakdown right)."""
        self.by_kind[rec.kind] -= rec.nbytes
        self.by_kind[kind] += rec.nbytes
        for phase in self._now:  # a peak that is this very moment
            self.phase_peaks[phase][1] = dict(self.by_kind)
        if rec.nbytes:  # at the latest sample when it is a peak, as above, else the next
            at = len(self.samples) - 1 if self._now and self.samples else len(self.samples)
            self.events.append((at, rec.kind, rec.block, -rec.nbytes))
            self.events.append((at, kind, rec.block, rec.nbytes))
        rec.kind = kind

    def update_peak(self, phase: str) -> None:
        """After an op of ``phase``: a new high for the phase is recorded."""
        self._updates += 1
        self.samples.append(self.current)
        self.sample_phases.append(phase)
        self.sample_blocks.append(self.block_now())
        entry = self.phase_peaks.get(phase)
        if entry is None or self.current > entry[0]:
            self.phase_peaks[phase] = [self.current, dict(self.by_kind), self._updates]
            if phase not in self._now:
                self._now.append(phase)

    def transient(self, phase: str, nbytes: int) -> None:
        """A moment inside an op of ``phase``: ``nbytes`` of the kernel's own temporaries
        alive on top of what is live now, as that phase's kind, for one sample (NOTE
        [ Kernel scratch the tracker models ] in scratch.py)."""
        self.current += nbytes
        self.by_kind[phase] += nbytes
        self._now.clear()
        self.events.append((len(self.samples), phase, None, nbytes))
        serial = self._serials()  # NOTE [ Allocation log ], 2.
        self.allocations.append((serial, nbytes, phase, 0 if self.stream_now is None
                                 else self.stream_now()))
        self.update_peak(phase)
        self.current -= nbytes
        self.by_kind[phase] -= nbytes
        self._now.clear()
        self.events.append((len(self.samples), phase, None, -nbytes))
        self.allocations.append((serial, -nbytes, phase, 0))

    def update_peak_at(self, phase: str, current: int, by_kind: dict[str, int],
                       events_then: int) -> None:
        """:meth:`update_peak` for a moment already past: ``current`` bytes then,
        ``by_kind`` their split, ``events_then`` events logged by then (the later ones
        belong to the next sample)."""
        self._updates += 1
        for i in range(events_then, len(self.events)):
            at, kind, block, delta = self.events[i]
            self.events[i] = (at + 1, kind, block, delta)
        self.samples.append(current)
        self.sample_phases.append(phase)
        self.sample_blocks.append(self.block_now())
        entry = self.phase_peaks.get(phase)
        if entry is None or current > entry[0]:
            self.phase_peaks[phase] = [current, dict(by_kind), self._updates]

    # ---- the allocation log (NOTE [ Allocation log ]) ---------------------------------------

    def start_step(self) -> None:
        """The step starts now (the tracker is entered): what was registered before is
        what it starts with. Only the first call counts."""
        if self.step_start is None:
            self.step_start = len(self.allocations)

    def end_step(self) -> None:
        """The step ends now (the tracker is left); a later exit moves the end."""
        self.step_end = len(self.allocations)

    def phase_started(self, phase: str) -> None:
        """Note where the first optimizer phase starts in the log."""
        if phase == "optimizer" and self.optimizer_start is None:
            self.optimizer_start = len(self.allocations)

    def log_after_frees(self, start: int, stop: int) -> None:
        """Move log entries ``start:stop`` (an op's outputs) to the end, after the frees
        logged since (NOTE [ Allocation log ], 3.)."""
        moved = self.allocations[start:stop]
        del self.allocations[start:stop]
        self.allocations.extend(moved)

    def allocation_log(self) -> AllocationLog:
        """The log as an :class:`~remat.core.allocator_replay.AllocationLog`: pre-existing
        storages (registered before the step and alive when it started, then those found
        later), the step's events with each free on its allocation's stream, and where the
        optimizer phase starts."""
        entries = self.allocations
        start = len(entries) if self.step_start is None else self.step_start
        alive: dict[int, tuple[int, int, str, int]] = {}
        for entry in entries[:start]:
            if entry[1] > 0:
                alive[entry[0]] = entry
            else:
                alive.pop(entry[0], None)
        pre = [*alive.values(), *self.allocations_found]
        streams = {entry[0]: entry[3] for entry in pre}
        events = []
        for serial, signed, kind, stream in entries[start:self.step_end]:
            if signed > 0:
                streams[serial] = stream
            else:
                stream = streams.get(serial, 0)
            events.append((serial, signed, kind, stream))
        optimizer = None if self.optimizer_start is None else max(self.optimizer_start - start, 0)
        return AllocationLog(tuple(pre), tuple(events), optimizer)

    def _step_peak(self) -> list[Any] | None:
        """The step's peak entry: the largest phase peak, the earliest on ties."""
        if not self.phase_peaks:
            return None
        return min(self.phase_peaks.values(), key=lambda e: (-e[0], e[2]))

    @property
    def peak(self) -> int:
        """The step's peak bytes (0 before any op)."""
        top = self._step_peak()
        return top[0] if top is not None else 0

    @property
    def peak_by_kind(self) -> dict[str, int]:
        """Bytes per kind at the step's peak."""
        top = self._step_peak()
        return dict(top[1]) if top is not None else dict.fromkeys(self.by_kind, 0)

    @property
    def peak_phase(self) -> str | None:
        """The phase in which the step's peak was reached (None before any op)."""
        top = self._step_peak()
        if top is None:
            return None
        return next(p for p, e in self.phase_peaks.items() if e is top)

    def peaks_by_phase(self) -> dict[str, PhasePeak]:
        """Each phase's peak so far, by phase (phases no op ran in are absent)."""
        return {phase: PhasePeak(peak, categorized(kinds), order)
                for phase, (peak, kinds, order) in self.phase_peaks.items()}

    def timeline(self) -> MemoryTimeline:
        """The samples and events so far as a :class:`~remat.core.timeline.MemoryTimeline`
        (kinds as categories; NOTE [ Memory timeline ])."""
        live = list(self.samples)
        for sample, nbytes in self.found_later:
            for i in range(min(sample, len(live))):
                live[i] += nbytes
        events = tuple((i, KIND_CATEGORIES[kind].value, block if kind == "forward" else None, d)
                       for i, kind, block, d in self.events)
        return MemoryTimeline(tuple(live), tuple(self.sample_phases), events,
                              tuple(self.sample_blocks))

    def records_of_kind(self, kind: str) -> list[StorageRecord]:
        """The live records of ``kind`` with bytes, in the order they were added."""
        return [rec for rec in self.live.values() if rec.kind == kind and rec.nbytes]

    def bytes_of_kind(self, kind: str) -> tuple[int, dict[str, int]]:
        """Bytes of live storages of ``kind``, in total and per block."""
        total = 0
        per_block: dict[str, int] = {}
        for rec in self.live.values():
            if rec.kind == kind and rec.nbytes:
                total += rec.nbytes
                if rec.block is not None:
                    per_block[rec.block] = per_block.get(rec.block, 0) + rec.nbytes
        return total, per_block

    def see_inputs(self, inputs: list[Tensor], counts: Callable[[Tensor], bool], *,
                   fresh: bool, adopt: tuple[str, str | None] | None = None) -> set[int]:
        """Keys of the inputs' storages; untracked ones that ``counts`` are added as
        preexisting, unless the op makes a fresh tensor from Python data (``fresh``), or
        as created now with ``adopt``'s ``(kind, block)`` (a collective's own buffers:
        NOTE [ Sharded models in the tracker ] in distributed/sharded.py)."""
        keys: set[int] = set()
        for t in inputs:
            st = storage_of(t)
            if st is None:
                continue
            key = id(st)
            keys.add(key)
            if key not in self.live and not fresh and counts(t):
                if adopt is not None:
                    self.add(st, *adopt)
                else:
                    self.add_preexisting(st)
        return keys

    def see_outputs(self, outputs: list[Tensor], input_keys: set[int],
                    counts: Callable[[Tensor], bool], kind: str,
                    block: str | None, op: str | None = None) -> tuple[int, bool]:
        """Add the outputs' new storages as ``kind``; follow resizes of tracked ones.

        With ``op`` (the op's name), each new storage's origin is recorded
        (:attr:`StorageRecord.origin`). Returns the bytes added and whether every output
        aliases an input.
        """
        alloc = 0
        aliases_only = True
        for t in outputs:
            st = storage_of(t)
            if st is None:
                continue
            key = id(st)
            if key not in input_keys:
                aliases_only = False
            rec = self.live.get(key)
            if rec is None:
                if counts(t):
                    origin = (op, tuple(t.shape), str(t.dtype).removeprefix("torch.")) \
                        if op is not None else None
                    alloc += self.add(st, kind, block, origin)
            elif rec.nbytes != st.nbytes():  # resized by an op (out=, resize_)
                self.resized(rec, st.nbytes())
        return alloc, aliases_only
