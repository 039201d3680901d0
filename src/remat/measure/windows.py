"""Fake steps cut into memory windows: the measuring instruments of the planner.

The planner measures on a fake copy of the model (``FakeTensorMode``, made by
:func:`~remat.planning.context.fake_setup`): every
storage the real step would create is seen by
:class:`~remat.measure.tracker.MemoryTracker` at its real size (on CPU the bytes
equal a real run's exactly), nothing is computed or allocated, and the user's
model, gradients and optimizer are never touched.

NOTE [ Memory windows ]
    A step's memory is a sequence of windows: ``pre`` (embeddings), for each
    block ``fwd:i`` (its forward) and ``gap:i`` (after it; the last one is the
    head, the loss and the head's backward), then ``bwd:i`` for each block in
    reverse (from the gradient of its output to the gradient of its input), then
    ``tail`` (the rest of backward) and ``optimizer``. :class:`WindowRecorder`
    sits inside the tracker and reads its live byte count after every op, so the
    peak of every window is known, not only the step's peak. The peak model
    (remat/core/peak.py) explains each window's peak from the blocks' decisions.

NOTE [ Gap windows ]
    ``gap:i`` opens in block i's forward hook, while the caller still holds block
    i's input (it passes it in ``args`` and has not yet rebound its variable to the
    output). That moment is no peak of its own: it is the state after block i's
    last op less what the block freed on returning, so ``fwd:i`` covers it. Counted
    in ``gap:i`` it would add block i's input to the window whether or not block i
    keeps it, which the peak model (which attributes the input to block i only when
    block i keeps it, NOTE [ Who keeps a hidden state ] in planning/block_run.py) cannot
    express. So a gap window's peak is taken after its ops and at its close (when
    the next window opens), not at its opening; the step's peak is unchanged.

NOTE [ Peak moments ]
    :class:`WindowRecorder` also notes *when* each window peaked: the number of ops
    seen and of windows opened by then. Two runs of the same program (the same model
    and strategy at two batch sizes ``b1 < b2``, both above 1) pass through the same
    moments, and each moment's live bytes are affine in ``b`` (every tensor's size
    is, NOTE [ Fast rows ] in simulate/fast_rows.py), so a window's peak, the largest of
    its moments, is convex in ``b``. When it is reached at the same moment at ``b1``
    and ``b2`` it is that moment's affine function on the whole of ``[b1, b2]``: at
    least that moment's bytes (it is the largest), at most the chord (convexity), and
    the two coincide. Values between are then interpolated exactly, without a third
    run (simulate/plan_windows.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.hooks import RemovableHandle

from remat.core.op_record import OpRecord
from remat.errors import message
from remat.measure.ledger import first_tensor
from remat.measure.step import LossFn, batch_tensors, clear_grads, run_step
from remat.measure.tracked_step import held_gc
from remat.measure.tracker import MemoryTracker
from remat.recompute import is_recomputing

if TYPE_CHECKING:
    pass


@dataclass
class FakeSetup:
    """A fake copy of a model, its batch and its optimizer, ready to run.

    ``step_ops`` is the number of ops of one step of the copy (the windows step's; 0
    until one ran): the closed loop measures a CPU model's choices on
    the real model where that is cheaper by the work of a step (NOTE [ Closed loop on the
    real model ] in planning/loop.py).

    ``real``: the copy holds real tensors, not fake ones, and ``mode`` enters nothing:
    what the planner measures on where a fake copy cannot run the step (NOTE [ Planning
    on a real copy ] in planning/context.py). ``stand_in``: a real copy measured on where
    computing is cheaper than faking (NOTE [ A real copy standing in for the fake one ] in
    planning/context.py).
    """

    mode: AbstractContextManager[Any]
    model: nn.Module
    batch: Any
    optimizer: torch.optim.Optimizer | None
    blocks: list[tuple[str, nn.Module]]
    device: torch.device
    step_ops: int = 0
    real: bool = False
    stand_in: bool = False

    @property
    def fake_mode(self) -> FakeTensorMode:
        """The fake mode of a fake copy (a ValueError for a real one)."""
        if not isinstance(self.mode, FakeTensorMode):
            raise ValueError(message("FakeSetup", "a real copy has no fake mode",
                                     fix="make fake tensors for a fake copy only"))
        return self.mode


class WindowRecorder:
    """Peak and starting live bytes of named windows (see NOTE [ Memory windows ]).

    It reads ``tracker``'s :attr:`~MemoryTracker.current_bytes` after every op the tracker
    counts (it installs itself as the tracker's ``after_op``): a listener rather than a
    dispatch mode of its own, which would cost every op another trip through Python
    dispatch.
    """

    def __init__(self, tracker: MemoryTracker) -> None:
        if tracker.after_op is not None:
            raise ValueError(message("WindowRecorder",
                                     "the tracker already has an after_op listener",
                                     fix="record windows with a fresh MemoryTracker"))
        self._tracker = tracker
        self.label: str | None = None
        self.starts: dict[str, int] = {}
        self.peaks: dict[str, int] = {}
        #: Per window, the moment of its peak (ops seen, windows opened; see NOTE [ Peak
        #: moments ]) and the phase then ("recompute" while recomputing).
        self.moments: dict[str, tuple[int, int]] = {}
        self.phases: dict[str, str] = {}
        self._at_close: set[str] = set()
        self._ops = 0
        self._opens = 0
        tracker.after_op = self._after_op

    def _raise(self, label: str, current: int) -> None:
        if label not in self.moments or current > self.peaks[label]:
            self.peaks[label] = current
            self.moments[label] = (self._ops, self._opens)
            self.phases[label] = "recompute" if is_recomputing() else self._tracker.phase

    def open(self, label: str, *, count_start: bool = True) -> None:
        """Make ``label`` the current window (its start is the first time it opens).

        With ``count_start=False`` the live bytes at opening do not count toward the
        window's peak; its ops and its closing (the next :meth:`open`) do. See NOTE
        [ Gap windows ].
        """
        current = self._tracker.current_bytes
        self._opens += 1
        if self.label in self._at_close:
            self._raise(self.label, current)
        self.label = label
        self.starts.setdefault(label, current)
        if count_start:
            self._raise(label, current)
        else:
            self._at_close.add(label)
            self.peaks.setdefault(label, 0)

    def finished_peaks(self) -> dict[str, int]:
        """Every window's peak; a window that neither ran an op nor closed gets its start."""
        return {label: peak or self.starts[label] for label, peak in self.peaks.items()}

    def _after_op(self) -> None:
        self._ops += 1
        label = self.label
        if label is not None:
            current = self._tracker.current_bytes
            if current > self.peaks[label]:
                self._raise(label, current)


@dataclass(frozen=True)
class StepWindows:
    """One tracked whole-model step cut into windows.

    Args:
        peaks: per window label, its peak live bytes.
        order: window labels in the order they first opened.
        peak_bytes: the step's peak (the tracker's, as :func:`remat.profile` reports it).
        peak_breakdown: bytes per kind at the peak.
        ops: every op of the step (with ``record_ops``; else empty).
        static: bytes registered before the step, per kind (params, batch, ...).
        moments: per window, the moment of its peak (NOTE [ Peak moments ]).
        phases: per window, the phase at its peak.
        activation_bytes: bytes the forward created still alive when backward started.
        block_saved: per block, its share of ``activation_bytes`` (blocks with none omitted).
        starts: per window, the live bytes when it first opened.
    """

    peaks: Mapping[str, int]
    order: tuple[str, ...]
    peak_bytes: int
    peak_breakdown: Mapping[str, int]
    ops: tuple[OpRecord, ...]
    static: Mapping[str, int]
    moments: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    phases: Mapping[str, str] = field(default_factory=dict)
    activation_bytes: int = 0
    block_saved: Mapping[str, int] = field(default_factory=dict)
    starts: Mapping[str, int] = field(default_factory=dict)


def run_windows(setup: FakeSetup, *, loss_fn: LossFn | None,
                record_ops: bool = False, warm_up: bool = True) -> StepWindows:
    """Run one tracked step of ``setup``'s model as :func:`remat.profile` does, with windows.

    Same sequence as ``profile(simulate=True)``: an untracked warm-up step that creates
    the optimizer state (only with an optimizer), gradients cleared, then the tracked
    step with parameters, buffers, optimizer state and batch registered first. The peak
    model needs only the bytes; ``record_ops=True`` also records every op (FLOPs and
    bytes moved, in ``StepWindows.ops``; otherwise empty), a tenth of the step's time.
    ``warm_up=False`` skips the warm-up, for a copy a previous call left warm (the
    optimizer state does not depend on the batch). The tracked step's op count goes to
    ``setup.step_ops``.
    """
    model, batch, optimizer = setup.model, setup.batch, setup.optimizer
    with setup.mode:
        if optimizer is not None and warm_up:  # fake steps have no other lazy state
            run_step(model, batch, loss_fn=loss_fn, optimizer=optimizer)
            clear_grads(model)
        tracker = MemoryTracker(device=setup.device, blocks=setup.blocks, record_ops=record_ops)
        tracker.register_step(model, optimizer, batch_tensors(batch))
        static = tracker.current_breakdown
        windows = WindowRecorder(tracker)
        handles = _window_hooks(setup.blocks, windows, tracker)

        def on_phase(phase: str) -> None:
            if phase == "optimizer":
                windows.open("optimizer")
            if phase != "end":
                tracker.set_phase(phase)

        try:
            windows.open("pre")
            with held_gc(), tracker:
                run_step(model, batch, loss_fn=loss_fn, optimizer=optimizer, on_phase=on_phase)
            setup.step_ops = tracker.samples
        finally:
            for handle in handles:
                handle.remove()
        clear_grads(model)
    order = tuple(windows.starts)
    return StepWindows(windows.finished_peaks(), order, tracker.peak_bytes, tracker.peak_breakdown,
                       tracker.ops, static, dict(windows.moments), dict(windows.phases),
                       tracker.activation_bytes, tracker.block_saved_bytes,
                       dict(windows.starts))


def _window_hooks(blocks: Sequence[tuple[str, nn.Module]], windows: WindowRecorder,
                  tracker: MemoryTracker) -> list[RemovableHandle]:
    def live() -> bool:
        return tracker.phase == "forward" and torch.is_grad_enabled() and not is_recomputing()

    def pre(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not live():
                return
            windows.open(f"fwd:{i}")
            x = first_tensor(args) if args else first_tensor(kwargs)
            if x is not None and x.requires_grad:
                x.register_hook(end_backward(i))
        return hook

    def post(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 output: Any) -> None:
            if not live():
                return
            windows.open(f"gap:{i}", count_start=False)  # NOTE [ Gap windows ]
            y = first_tensor(output)
            if y is not None and y.requires_grad:
                y.register_hook(start_backward(i))
        return hook

    def start_backward(i: int) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            windows.open(f"bwd:{i}")
        return hook

    def end_backward(i: int) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            if windows.label == f"bwd:{i}":
                windows.open("tail" if i == 0 else f"after:{i}")
        return hook

    handles: list[RemovableHandle] = []
    for i, (_, module) in enumerate(blocks):
        handles.append(module.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(module.register_forward_hook(post(i), with_kwargs=True, always_call=True))
    return handles
