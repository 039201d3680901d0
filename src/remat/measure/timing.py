"""Wall-clock timing of a training step and of each block's forward, in untracked runs.

Timings are medians over repeated runs after one warm-up run. On CUDA every
boundary is a ``torch.cuda.Event`` and the device is synchronised once per run,
so kernel time is measured rather than launch time; on CPU
``time.perf_counter`` is used directly.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.errors import message
from remat.measure.step import (
    LossFn,
    call_model,
    clear_grads,
    default_loss,
    model_device,
    run_step,
)


class Clock:
    """Marks points in time; reads elapsed milliseconds after :meth:`sync`.

    CUDA events on a CUDA device (kernel time, not launch time), ``perf_counter``
    elsewhere.

    Example:
        >>> clock = Clock(torch.device("cpu"))
        >>> start = clock.mark(); end = clock.mark(); clock.sync()
        >>> clock.elapsed_ms(start, end) >= 0
        True
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        if self.cuda:
            return float(start.elapsed_time(end))
        return float(end - start) * 1e3


@dataclass(frozen=True)
class StepTimes:
    """Median times of one training step's phases, in milliseconds.

    Args:
        forward_ms: forward pass and loss.
        backward_ms: ``loss.backward()``, recomputation included.
        step_ms: the whole step, optimizer update included.
    """

    forward_ms: float
    backward_ms: float
    step_ms: float

    def __post_init__(self) -> None:
        for name in ("forward_ms", "backward_ms", "step_ms"):
            if getattr(self, name) < 0:
                raise ValueError(message("StepTimes", f"{name} must be >= 0",
                                         {"found": getattr(self, name)},
                                         fix=f"pass {name} >= 0"))


def time_step(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    repeats: int = 5,
    device: torch.device | None = None,
    warmup: int = 1,
) -> StepTimes:
    """Time :func:`~remat.measure.step.run_step`: median of ``repeats`` runs after ``warmup``.

    Gradients are cleared before each run (``set_to_none``), as a training loop does.
    The model's parameters and optimizer state change; :func:`remat.profile` restores them.

    Args:
        model: the model, in train mode.
        batch: as for ``run_step``.
        loss_fn: as for ``run_step``. Default: ``None``.
        optimizer: as for ``run_step``. Default: ``None``.
        repeats: timed runs, >= 1. Default: 5.
        device: where the step runs (CUDA events when CUDA). Default: the first
            parameter's device.
        warmup: untimed runs first. Default: 1.
    """
    if repeats < 1:
        raise ValueError(message("remat.measure.time_step", "repeats must be >= 1",
                                 {"found": repeats}, fix="pass repeats >= 1"))
    clock = Clock(device or model_device(model))
    forward: list[float] = []
    backward: list[float] = []
    total: list[float] = []
    for i in range(warmup + repeats):
        clear_grads(model)
        marks: dict[str, Any] = {}

        def on_phase(phase: str, marks: dict[str, Any] = marks) -> None:
            marks[phase] = clock.mark()

        run_step(model, batch, loss_fn=loss_fn, optimizer=optimizer, on_phase=on_phase)
        clock.sync()
        if i < warmup:
            continue
        forward.append(clock.elapsed_ms(marks["forward"], marks["backward"]))
        backward.append(clock.elapsed_ms(marks["backward"], marks.get("optimizer", marks["end"])))
        total.append(clock.elapsed_ms(marks["forward"], marks["end"]))
    clear_grads(model)
    return StepTimes(
        statistics.median(forward), statistics.median(backward), statistics.median(total)
    )


def time_blocks(
    model: nn.Module,
    batch: Any,
    blocks: Sequence[tuple[str, nn.Module]],
    *,
    loss_fn: LossFn | None = None,
    repeats: int = 5,
    device: torch.device | None = None,
    warmup: int = 1,
) -> dict[str, float]:
    """Median forward time of each block, in ms, from forward pre/post hooks.

    Runs forward and loss only (grad enabled, so the blocks save what they save in
    training); the hooks' own cost lands in these runs, not in :func:`time_step`'s.

    Args:
        model: the model, in train mode.
        batch: as for ``run_step``.
        blocks: ``(qualified_name, module)`` pairs.
        loss_fn: as for ``run_step``. Default: ``None``.
        repeats: timed runs, >= 1. Default: 5.
        device: as for :func:`time_step`.
        warmup: untimed runs first. Default: 1.
    """
    if repeats < 1:
        raise ValueError(message("remat.measure.time_blocks", "repeats must be >= 1",
                                 {"found": repeats}, fix="pass repeats >= 1"))
    if not blocks:
        return {}
    clock = Clock(device or model_device(model))
    runs: list[list[tuple[str, Any, Any]]] = []
    starts: dict[str, list[Any]] = {}
    current: list[tuple[str, Any, Any]] = []

    def pre(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            starts.setdefault(name, []).append(clock.mark())
        return hook

    def post(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            pending = starts.get(name)
            if pending:
                current.append((name, pending.pop(), clock.mark()))
        return hook

    handles = []
    for name, module in blocks:
        handles.append(module.register_forward_pre_hook(pre(name)))
        handles.append(module.register_forward_hook(post(name)))
    try:
        for i in range(warmup + repeats):
            current.clear()
            starts.clear()
            with torch.enable_grad():
                output = call_model(model, batch, api="remat.profile")
                loss = loss_fn(output, batch) if loss_fn is not None else default_loss(output)
                del output, loss
            clock.sync()
            if i >= warmup:
                runs.append(list(current))
    finally:
        for handle in handles:
            handle.remove()
    per_block: dict[str, list[float]] = {}
    for run in runs:
        sums: dict[str, float] = {}
        for name, start, end in run:
            sums[name] = sums.get(name, 0.0) + clock.elapsed_ms(start, end)
        for name, ms in sums.items():
            per_block.setdefault(name, []).append(ms)
    return {name: statistics.median(values) for name, values in per_block.items()}
