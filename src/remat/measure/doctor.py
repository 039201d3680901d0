"""``remat.doctor``: run a job's training steps and say why its memory grows.

NOTE [ What doctor runs ]
    1. The steps. ``steps`` training steps of the job as the user's loop runs them: the
       user's own ``step_fn(model, batch)`` when given (their loss, their bookkeeping,
       their ``zero_grad`` or its absence), else remat's step (:func:`run_step`, then
       ``optimizer.step()`` and ``zero_grad(set_to_none=True)`` unless ``zero_grad=False``
       emulates a loop that never clears gradients). No warm-up step: the first step is
       the job's first (NOTE [ The first step ] in profile.py).
    2. One tracker for all of them. A :class:`~remat.measure.tracker.MemoryTracker` is
       entered for each step and keeps its ledger across them, so a storage one step
       creates and a later step still holds is the same record, with the phase that
       created it. A user's step has no ``on_phase`` calls, so the phase follows the step
       itself: the optimizer phase while an ``optimizer.step()`` runs (global step hooks,
       removed after), backward while the autograd engine runs a graph task
       (``torch._C._current_graph_task_id()``), forward otherwise.
    3. Between steps (outside the tracker), after a garbage collection, every live
       storage gets its holder (NOTE [ Holders ] in holders.py); each step's growth is the
       bytes by holder at its end less at its start. The storages a step starts with that
       are not static (parameters, buffers, the batch, the optimizer state) are watched
       (a weak reference each): those still alive at the step's peak are what it holds
       over from earlier steps (``DoctorStep.held_bytes``).
    4. After the steps: each step's peak and the bytes by category and by block at it
       (the tracker's timeline, cut at the steps' samples), and the steps' allocations
       replayed through the model of the CUDA caching allocator, cut at the same places
       (reserved and allocated peaks per step, with and without expandable segments).
    5. The findings (NOTE [ Why a job runs out of memory at step 101 ] in
       remat/core/doctor.py): gradients held into a step's peak; a holder whose bytes grow
       from the end of the first step to the end of the last (the first step is allowed
       to create the optimizer state and caches); reserved bytes that grow while allocated
       bytes do not.
    The model, its gradients and buffers, the optimizer's state and the RNG are restored
    afterwards (:func:`~remat.measure.state.preserved_state`; parameters only when
    ``optimizer=`` is given); what a ``step_fn`` keeps (its lists) stays as it left it.
"""

from __future__ import annotations

import gc
import inspect
import os
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from remat.core.allocator_replay import AllocationLog, SettingsLike, as_settings
from remat.core.caching_allocator import CachingAllocatorModel
from remat.core.cost import Category
from remat.core.doctor import ADVICE, ERROR, Cause, DoctorReport, DoctorStep, Finding
from remat.core.snapshot import FRAGMENTED_SHARE, read_snapshot
from remat.core.timeline import MemoryTimeline
from remat.errors import message, names_the_call
from remat.measure.dispatch_modes import direct_dispatch
from remat.measure.holders import STATIC_KINDS, Holder, model_holders, python_holders
from remat.measure.ledger import CREATED_KINDS, StorageRecord, storage_of
from remat.measure.state import preserved_state
from remat.measure.step import LossFn, Step, batch_tensors, check_runnable, clear_grads
from remat.measure.tracked_step import check_trainable, held_gc
from remat.measure.tracker import MemoryTracker

_API = "remat.doctor"
StepFn = Callable[..., Any]
_MIN_FREE_BYTES = 256 << 20  # with FRAGMENTED_SHARE: when expandable segments are advised
#: Holder kinds whose storages the tracker counts as a registered kind once known.
_RETAG = {"optimizer": "optimizer_state", "gradients": "grads"}


@direct_dispatch
class _StepTracker(MemoryTracker):
    """A tracker whose phase follows the running step (NOTE [ What doctor runs ], 2.)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.optimizing = 0
        self._created_at: dict[int, int] = {}  # serial -> index of its creation event
        ledger = self._ledger
        add = ledger.add

        def add_noted(st: torch.UntypedStorage, kind: str, block: str | None,
                      origin: tuple[str, tuple[int, ...], str] | None = None) -> int:
            nbytes = add(st, kind, block, origin)
            if nbytes:
                self._created_at[ledger.live[id(st)].serial] = len(ledger.events) - 1
            return nbytes

        ledger.add = add_noted  # type: ignore[method-assign]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        phase = "optimizer" if self.optimizing else \
            "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        if phase != self.phase:
            self.set_phase(phase)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def live_records(self) -> list[StorageRecord]:
        """The storages alive now that have bytes."""
        return [rec for rec in self._ledger.live.values() if rec.nbytes]

    def relabel(self, key: int, kind: str) -> None:
        """Count the live storage ``key`` as ``kind`` since its creation (its creation event
        rewritten: NOTE [ Memory timeline ])."""
        ledger = self._ledger
        rec = ledger.live.get(key)
        if rec is None or rec.kind == kind:
            return
        index = self._created_at.get(rec.serial)
        if index is None or ledger.events[index][1] != rec.kind:
            ledger.retag(rec, kind)
            return
        sample, _, block, nbytes = ledger.events[index]
        ledger.events[index] = (sample, kind, block, nbytes)
        ledger.by_kind[rec.kind] -= rec.nbytes
        ledger.by_kind[kind] += rec.nbytes
        rec.kind = kind

    @property
    def sample_count(self) -> int:
        """Samples taken so far (NOTE [ Memory timeline ])."""
        return len(self._ledger.samples)

    @property
    def logged(self) -> int:
        """Entries in the allocation log so far (NOTE [ Allocation log ])."""
        return len(self._ledger.allocations)


@dataclass
class _Boundary:
    """The live storages between two steps, by holder (NOTE [ What doctor runs ], 3.)."""

    samples: int
    logged: int
    holders: dict[int, Holder]
    nbytes: dict[int, int] = field(default_factory=dict)  # key -> bytes
    bytes_by_label: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)  # label -> holder kind
    created: dict[str, set[str]] = field(default_factory=dict)  # label -> record kinds
    grads_zeroed: bool = False

    @property
    def total(self) -> int:
        return sum(self.bytes_by_label.values())


@names_the_call("remat.doctor")
def doctor(
    model: nn.Module | None = None,
    batch: Any = None,
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    step_fn: StepFn | None = None,
    steps: int = 4,
    zero_grad: bool = True,
    blocks: Any = None,
    snapshot: str | os.PathLike[str] | bytes | Mapping[str, Any] | None = None,
    settings: SettingsLike = None,
) -> DoctorReport:
    """Run a few training steps of a job and say why its memory grows, or read a CUDA
    memory snapshot and say why it ran out.

    Each step's peak, what is alive at it by category and by block, and what grows
    between steps with what holds it (``.grad``, a module attribute, a Python list, an
    autograd graph): gradients never cleared, outputs or graphs the loop keeps, state
    growing in forward or in recomputation, reserved bytes growing on the CUDA caching
    allocator (NOTE [ What doctor runs ]). The trade-off: the steps run for real under the
    tracker (a few microseconds per op) and the holders are found by scanning the Python
    heap when the model does not explain a storage, so a doctor run costs several steps'
    time; it is a diagnosis, not something to leave in a loop.

    Args:
        model: the model, in train mode. Default: None (a snapshot alone).
        batch: its batch: a tensor, a tuple/list of arguments or a dict of keyword
            arguments (the same batch every step); with ``step_fn``, anything it takes.
        loss_fn: ``loss_fn(output, batch) -> scalar`` of remat's step. Default: as in
            :func:`remat.profile`. Not used with ``step_fn``.
        optimizer: the optimizer: stepped by remat's step, or passed to ``step_fn`` as its
            third argument when it takes one; its state is restored afterwards (with the
            parameters). Default: None.
        step_fn: your own training step, ``step_fn(model, batch)`` or ``step_fn(model,
            batch, optimizer)``: forward, loss, backward, optimizer, and whatever your loop
            keeps, called ``steps`` times. Default: remat's step.
        steps: training steps to run, >= 1 (growth needs >= 3: the first step may create
            state, the next ones must not). Default: 4.
        zero_grad: remat's step clears the gradients after each step; ``False`` runs it as
            a loop that never calls ``zero_grad``. Default: True.
        blocks: which modules are blocks, as in :func:`remat.profile`. Default: found.
        snapshot: a ``torch.cuda.memory._dump_snapshot`` file (or its bytes or dict) to
            explain too (:func:`remat.core.snapshot.read_snapshot`). Default: None.
        settings: the CUDA allocator's options for the reserved bytes (a
            ``PYTORCH_CUDA_ALLOC_CONF`` string). Default: torch's defaults.

    Returns:
        A :class:`~remat.core.doctor.DoctorReport`: ``healthy`` is False when memory
        grows (or a snapshot ran out), with the findings and their fixes.

    Raises:
        ValueError: neither a model nor a snapshot, ``steps < 1``, ``loss_fn`` or
            ``zero_grad=False`` with ``step_fn``, model in eval mode.
        TypeError: a ``step_fn`` that is not callable.

    Example:
        >>> losses = []
        >>> def train_step(model, batch):
        ...     loss = model(**batch).loss
        ...     loss.backward()
        ...     losses.append(loss)          # the tensor, not loss.item()
        >>> report = remat.doctor(model, batch, step_fn=train_step)
        >>> report.healthy, report.findings[0].cause.value
        (False, 'outputs_kept')
    """
    if model is None and snapshot is None:
        raise ValueError(message(_API, "nothing to examine", {"model": None, "snapshot": None},
                                 fix="pass a model and its batch, or snapshot=path"))
    diagnosis = read_snapshot(snapshot) if snapshot is not None else None
    rows: tuple[DoctorStep, ...] = ()
    findings: list[Finding] = []
    device = None
    if model is not None:
        _check(model, step_fn, loss_fn, zero_grad, steps)
        # a step_fn takes its batch as it is (any object); remat's step needs a Step's
        step = Step(model, batch if step_fn is None else (), loss_fn=loss_fn,
                    optimizer=optimizer, blocks=blocks)
        rows, found = _run(step, batch, step_fn, steps, zero_grad, settings)
        findings.extend(found)
        device = str(step.device)
    if diagnosis is not None:
        findings.extend(diagnosis.findings)
    findings.sort(key=lambda f: f.severity != ERROR)
    return DoctorReport(rows, tuple(findings), diagnosis, device)


def _check(model: nn.Module, step_fn: StepFn | None, loss_fn: LossFn | None, zero_grad: bool,
           steps: int) -> None:
    check_trainable(model, api=_API)
    check_runnable(model, api=_API)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(message(_API, "steps must be a positive integer",
                                 {"found": repr(steps)}, fix="pass steps=4 (3 or more to "
                                                             "see growth)"))
    if step_fn is None:
        return
    if not callable(step_fn):
        raise TypeError(message(_API, "step_fn must be callable",
                                {"found": type(step_fn).__name__},
                                fix="pass def step_fn(model, batch): ... (your training step)"))
    if loss_fn is not None or not zero_grad:
        raise ValueError(message(
            _API, "loss_fn and zero_grad are remat's step; step_fn is your own",
            {"loss_fn": "given" if loss_fn is not None else None, "zero_grad": zero_grad},
            fix="compute the loss (and clear gradients, or not) inside step_fn"))


def _step_call(step: Step, batch: Any, step_fn: StepFn | None, zero_grad: bool
               ) -> Callable[[], None]:
    """One training step as the job runs it (NOTE [ What doctor runs ], 1.)."""
    model, optimizer = step.model, step.optimizer
    if step_fn is not None:
        args: tuple[Any, ...] = (model, batch)
        if optimizer is not None:
            try:
                inspect.signature(step_fn).bind(model, batch, optimizer)
                args = (model, batch, optimizer)
            except (TypeError, ValueError):
                pass
        user = step_fn

        def run_user() -> None:
            user(*args)  # what it returns is dropped, as a loop drops it

        return run_user

    def run_remat() -> None:
        if zero_grad:
            step.run()  # steps the optimizer, then zero_grad(set_to_none=True)
            if optimizer is None:
                clear_grads(model)
            return
        step.with_model(model, None).run()  # forward and backward; gradients add up
        if optimizer is not None:
            optimizer.step()

    return run_remat


def _run(step: Step, batch: Any, step_fn: StepFn | None, steps: int, zero_grad: bool,
         settings: SettingsLike) -> tuple[tuple[DoctorStep, ...], list[Finding]]:
    model, device = step.model, step.device
    named = step.blocks_found(api=_API, required=False)
    optimizers: list[torch.optim.Optimizer] = [step.optimizer] if step.optimizer else []
    with preserved_state(model, step.optimizer, device):
        clear_grads(model)
        tracker = _StepTracker(device=device, blocks=named, record_ops=False)
        tracker.register_step(model, step.optimizer, batch_tensors(batch))
        buffers = {id(st) for b in model.buffers() if (st := storage_of(b)) is not None}

        def census() -> _Boundary:
            # the young generations hold what the step made (collection was held in it)
            gc.collect(1)
            return _census(tracker, model, optimizers, batch, buffers)

        def pre_hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            tracker.optimizing += 1
            if all(opt is not o for o in optimizers):
                optimizers.append(opt)

        def post_hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            tracker.optimizing = max(tracker.optimizing - 1, 0)

        call = _step_call(step, batch, step_fn, zero_grad)
        boundaries = [census()]
        watches: list[_Watch] = []
        handles = [register_optimizer_step_pre_hook(pre_hook),
                   register_optimizer_step_post_hook(post_hook)]
        try:
            for _ in range(steps):
                watches.append(_watch(tracker, boundaries[-1]))
                tracker.set_phase("forward")
                with held_gc(), tracker:
                    call()
                boundaries.append(census())
        finally:
            for handle in handles:
                handle.remove()
        timeline = tracker.timeline
        log = tracker.allocations
        clear_grads(model)
    rows = _rows(boundaries, [w.freed for w in watches], timeline, log, settings)
    return rows, _findings(rows, boundaries)


def _census(tracker: _StepTracker, model: nn.Module, optimizers: list[torch.optim.Optimizer],
            batch: Any, buffers: set[int]) -> _Boundary:
    records = tracker.live_records()
    holders, roots = model_holders(model, optimizers, batch, buffers)
    unexplained = {rec.key for rec in records if rec.key not in holders}
    if unexplained:
        created = {rec.key for rec in records if rec.kind in CREATED_KINDS}
        holders.update(python_holders(unexplained, created, roots))
    boundary = _Boundary(tracker.sample_count, tracker.logged, {})
    for rec in records:
        holder = holders.get(rec.key, Holder("other", "other"))
        if holder.kind in _RETAG and rec.kind != _RETAG[holder.kind]:
            # the optimizer state a first step creates is state from its creation on
            tracker.relabel(rec.key, _RETAG[holder.kind])
        boundary.holders[rec.key] = holder
        boundary.nbytes[rec.key] = rec.nbytes
        label = holder.label
        boundary.bytes_by_label[label] = boundary.bytes_by_label.get(label, 0) + rec.nbytes
        boundary.kinds[label] = holder.kind
        boundary.created.setdefault(label, set()).add(rec.kind)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    with torch.no_grad():
        boundary.grads_zeroed = bool(grads) and not any(bool(g.any()) for g in grads)
    return boundary


@dataclass
class _Watch:
    """The non-static storages alive when a step starts, watched as they die."""

    freed: dict[int, int] = field(default_factory=dict)  # key -> sample when freed
    refs: list[weakref.ref[Any]] = field(default_factory=list)


def _watch(tracker: _StepTracker, boundary: _Boundary) -> _Watch:
    """Watch the non-static storages alive at ``boundary`` (NOTE [ What doctor runs ], 3.)."""
    watch = _Watch()
    for rec in tracker.live_records():
        holder = boundary.holders.get(rec.key)
        storage = rec()
        if holder is None or holder.kind in STATIC_KINDS or storage is None:
            continue

        def died(_: Any, key: int = rec.key) -> None:
            watch.freed[key] = tracker.sample_count

        watch.refs.append(weakref.ref(storage, died))
    return watch


def _rows(boundaries: list[_Boundary], freed: list[dict[int, int]], timeline: MemoryTimeline,
          log: AllocationLog, settings: SettingsLike) -> tuple[DoctorStep, ...]:
    live = timeline.live_bytes
    peaks: list[int] = []
    for before, after in zip(boundaries, boundaries[1:], strict=False):
        span = range(before.samples, min(after.samples, len(live)))
        peaks.append(max(span, key=lambda i: (live[i], -i)) if len(span) else -1)
    at_peak = _at_samples(timeline, peaks)
    start = boundaries[0].logged
    cuts = [min(max(b.logged - start, 0), len(log.events)) for b in boundaries]
    reserved = _replay_steps(log, cuts, settings)
    expandable = _replay_steps(log, cuts, replace(as_settings(settings),
                                                  expandable_segments=True))
    rows = []
    for k, (before, after) in enumerate(zip(boundaries, boundaries[1:], strict=False)):
        peak = peaks[k]
        held: dict[str, int] = {}
        for key, holder in before.holders.items():
            if holder.kind in STATIC_KINDS:
                continue
            died = freed[k].get(key)
            if peak >= 0 and (died is None or died > peak):
                held[holder.label] = held.get(holder.label, 0) + before.nbytes[key]
        growth = {label: after.bytes_by_label.get(label, 0) - before.bytes_by_label.get(label, 0)
                  for label in {*after.bytes_by_label, *before.bytes_by_label}}
        categories, blocks = at_peak[k]
        rows.append(DoctorStep(
            step=k + 1, start_bytes=before.total,
            peak_bytes=live[peak] if peak >= 0 else before.total, end_bytes=after.total,
            peak_phase=timeline.phases[peak] if peak >= 0 else None,
            peak_breakdown=categories if peak >= 0 else {},
            peak_blocks=blocks, held_bytes={k2: v for k2, v in held.items() if v},
            growth={k2: v for k2, v in sorted(growth.items(), key=lambda kv: -abs(kv[1])) if v},
            reserved_bytes=reserved[k][0], allocated_bytes=reserved[k][1],
            expandable_reserved_bytes=expandable[k][0]))
    return tuple(rows)


def _at_samples(timeline: MemoryTimeline, samples: list[int]
                ) -> list[tuple[dict[Category, int], dict[str, int]]]:
    """Bytes by category and activation bytes by block at each sample (-1: none)."""
    out: list[tuple[dict[Category, int], dict[str, int]]] = [({}, {}) for _ in samples]
    for at, category, block, delta in timeline.events:
        for (categories, blocks), sample in zip(out, samples, strict=True):
            if 0 <= at <= sample:
                key = Category(category)
                categories[key] = categories.get(key, 0) + delta
                if key is Category.ACTIVATIONS and block is not None:
                    blocks[block] = blocks.get(block, 0) + delta
    return [({c: v for c, v in categories.items() if v}, {b: v for b, v in blocks.items() if v})
            for categories, blocks in out]


def _replay_steps(log: AllocationLog, cuts: list[int], settings: SettingsLike
                  ) -> list[tuple[int, int]]:
    """``(reserved peak, allocated peak)`` of each stretch ``log.events[cuts[i]:cuts[i+1]]``
    on one model of the CUDA caching allocator (NOTE [ What doctor runs ], 4.)."""
    model = CachingAllocatorModel(as_settings(settings))
    pre = set()
    for key, nbytes, _, stream in log.preexisting:
        model.malloc(("pre", key), nbytes, stream)
        pre.add(key)
    live: set[Any] = set()
    out = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        model.reset_peak()
        for key, signed, _, stream in log.events[a:b]:
            if signed > 0:
                model.malloc(key, signed, stream)
                live.add(key)
            elif key in live:
                live.discard(key)
                model.free(key)
            elif key in pre:
                pre.discard(key)
                model.free(("pre", key))
        out.append((model.peak_reserved_bytes, model.peak_allocated_bytes))
    return out


# ---- findings (NOTE [ What doctor runs ], 5.) ----------------------------------------------

_GRADS_FIX = ("call optimizer.zero_grad(set_to_none=True) (or model.zero_grad()) once per "
              "step, after optimizer.step(); if the steps accumulate gradients on purpose "
              "(micro-batches), pass the whole accumulation as one step_fn")
_FIXES = {
    Cause.STATE_GROWS: "keep it bounded: clear or reset it every step (a cache belongs to "
                       "generation, not training: use_cache=False), and keep .item() or "
                       ".detach() values of what you record",
    Cause.RECOMPUTE_GROWS: "do not change state in a checkpointed forward: skip the update "
                           "while remat.is_recomputing() is True (the forward runs again in "
                           "backward), and keep it bounded",
    Cause.OUTPUTS_KEPT: "keep numbers, not tensors: append loss.item() (a metric's .item()); "
                        "a detached tensor still holds its bytes, one with a grad_fn holds its "
                        "autograd graph too, and a graph never backpropagated holds every "
                        "activation it saved",
    Cause.GROWS: "look for tensors kept across steps in hooks or C++ extensions; run "
                 "remat.doctor on a step_fn that does less to find which part keeps them",
}
_DETAILS = {
    Cause.STATE_GROWS: "module state that grows on every forward",
    Cause.RECOMPUTE_GROWS: "module state that grows on every forward, and again when the "
                           "checkpointed forward is recomputed in backward",
    Cause.OUTPUTS_KEPT: "tensors the loop keeps from every step",
    Cause.GROWS: "bytes that grow with no Python reference found",
}


def _cause(kind: str, created: set[str]) -> Cause:
    if kind == "module":
        return Cause.RECOMPUTE_GROWS if "recompute" in created else Cause.STATE_GROWS
    if kind in ("python", "graph"):
        return Cause.OUTPUTS_KEPT
    return Cause.GROWS


def _findings(rows: tuple[DoctorStep, ...], boundaries: list[_Boundary]) -> list[Finding]:
    findings: list[Finding] = []
    held = [(row.step, row.held_bytes.get("gradients", 0)) for row in rows]
    kept = [(step, nbytes) for step, nbytes in held if nbytes]
    if kept:
        step, _ = kept[0]
        zeroed = boundaries[step - 1].grads_zeroed
        detail = ("the gradients are zeroed but kept (zero_grad(set_to_none=False)): they "
                  "stay allocated through the next step's forward") if zeroed else \
            ("the gradients are never cleared: they stay allocated through the next "
             "step's forward, and each backward adds to them")
        findings.append(Finding(Cause.GRADIENTS_KEPT, ERROR, "gradients",
                                max(n for _, n in kept), 0, step, detail, _GRADS_FIX))
    if len(boundaries) >= 3:  # growth from the end of the first step to the end of the last
        first, last = boundaries[1], boundaries[-1]
        for label, nbytes in last.bytes_by_label.items():
            grown = nbytes - first.bytes_by_label.get(label, 0)
            if grown <= 0:
                continue
            cause = _cause(last.kinds[label], last.created.get(label, set()))
            per_step = grown // (len(boundaries) - 2)
            step = next(k for k in range(1, len(boundaries))
                        if boundaries[k].bytes_by_label.get(label, 0)
                        > boundaries[k - 1].bytes_by_label.get(label, 0))
            detail = _DETAILS[cause]
            if last.kinds[label] == "graph":
                detail += ", through the autograd graphs of tensors it keeps"
            findings.append(Finding(cause, ERROR, label, nbytes, per_step, step, detail,
                                    _FIXES[cause]))
    findings.extend(_fragmentation(rows))
    return findings


def _fragmentation(rows: tuple[DoctorStep, ...]) -> list[Finding]:
    """Reserved bytes that grow over the steady steps while allocated bytes do not; else,
    expandable segments advised where they reserve much less."""
    steady = rows[1:]
    if len(steady) < 2:
        return []
    first, last = steady[0], steady[-1]
    reserved = [r.reserved_bytes or 0 for r in (first, last)]
    allocated = [r.allocated_bytes or 0 for r in (first, last)]
    expandable = [r.expandable_reserved_bytes or 0 for r in (first, last)]
    if reserved[1] > reserved[0] and allocated[1] <= allocated[0]:
        grown = reserved[1] - reserved[0]
        return [Finding(
            Cause.FRAGMENTATION, ERROR, "", grown, grown // (len(steady) - 1), last.step,
            "on CUDA the caching allocator would reserve more every step while "
            "allocating the same: its free blocks cannot serve the step's requests",
            "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" if expandable[1] <=
            expandable[0] else "allocate the step's large tensors in the same order and "
                               "sizes every step")]
    free = reserved[1] - allocated[1]
    saved = reserved[1] - (expandable[1] or reserved[1])
    if free >= max(FRAGMENTED_SHARE * reserved[1], _MIN_FREE_BYTES) and saved >= _MIN_FREE_BYTES:
        return [Finding(Cause.FRAGMENTATION, ADVICE, "", saved, 0, last.step,
                        "on CUDA a large share of what the caching allocator reserves would "
                        "be free blocks; expandable segments reserve less",
                        "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")]
    return []
