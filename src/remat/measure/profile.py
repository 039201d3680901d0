"""``profile``: one training step measured exactly (bytes, FLOPs) and timed.

NOTE [ What a profile runs ]
    1. A warm-up step (untracked): creates the optimizer state when an optimizer
       is given, and any lazily built caches, so the measured step is a steady
       state step. Gradients are set to None before every step.
    2. The tracked step under :class:`~remat.measure.tracker.MemoryTracker`
       (automatic garbage collection held, so frees happen when reference counts
       say, identically in real and fake runs): parameters, buffers, optimizer state and the
       batch are registered first; the phases are forward (model and loss),
       backward and optimizer (``step()`` then ``zero_grad(set_to_none=True)``).
    3. Timing (real runs, ``timing=True``): ``repeats`` untracked steps for the
       phase times, then ``repeats`` forward passes with block hooks for the
       per-block times (medians).
    4. On CUDA, one more untracked step between ``reset_peak_memory_stats`` and
       ``max_memory_allocated`` for ``cuda_peak_bytes``.
    Everything the steps change is restored afterwards (see :func:`profile`).
    With ``simulate=True`` steps 1-2 run on fake copies under FakeTensorMode
    and 3-4 are skipped.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.measure.fake import (
    check_fake_device,
    fake_batch,
    fake_copy_with_map,
    fake_optimizer,
)
from remat.measure.step import LossFn, batch_tensors, clear_grads, model_device, run_step
from remat.measure.timing import time_blocks, time_step
from remat.measure.tracker import PHASES, MemoryTracker, OpRecord

__all__ = ["BlockProfile", "Profile", "preserved_state", "profile", "profile_simulated"]

_API = "remat.profile"


@dataclass(frozen=True)
class BlockProfile:
    """What one block costs in a training step.

    Args:
        name: qualified module name, e.g. ``"blocks.3"``.
        saved_bytes: bytes of the storages the block created in forward that were
            still alive when backward started (its share of ``activation_bytes``).
        forward_flops: FLOPs of the forward ops run inside it (innermost block only,
            if blocks nest).
        forward_ms: median forward time, ms; ``None`` when not timed.
        backward_flops: FLOPs of backward ops attributed to it (recompute excluded).
        recompute_flops: FLOPs recomputed for it during backward.
    """

    name: str
    saved_bytes: int
    forward_flops: int
    forward_ms: float | None = None
    backward_flops: int = 0
    recompute_flops: int = 0

    def __post_init__(self) -> None:
        for key in ("saved_bytes", "forward_flops", "backward_flops", "recompute_flops"):
            if getattr(self, key) < 0:
                raise ValueError(f"BlockProfile({self.name!r}): {key} must be >= 0, "
                                 f"got {getattr(self, key)}")
        if self.forward_ms is not None and self.forward_ms < 0:
            raise ValueError(f"BlockProfile({self.name!r}): forward_ms must be >= 0, "
                             f"got {self.forward_ms}")


@dataclass(frozen=True)
class Profile:
    """One training step, measured: exact bytes and FLOPs, and (real runs) times.

    Bytes are exact sums of tensor storage sizes on the model's device (see
    NOTE [ What the tracker cannot see ] in tracker.py); FLOPs follow
    ``torch.utils.flop_counter``.

    Args:
        peak_bytes: the step's high-water mark of live tensor bytes, including
            parameters, buffers, gradients, optimizer state and the batch.
        activation_bytes: bytes created during forward (model and loss) that were
            still alive when backward started: what autograd saved, plus the loss.
        param_bytes: parameters (tied weights once).
        buffer_bytes: buffers.
        grad_bytes: gradients when backward ended.
        optimizer_bytes: optimizer state (after the warm-up step created it).
        batch_bytes: the batch's tensors.
        flops: ``forward_flops + backward_flops + recompute_flops`` (optimizer excluded).
        forward_flops: forward and loss.
        backward_flops: backward, recomputation *excluded*.
        recompute_flops: ops run while ``remat.strategies.context.is_recomputing()``.
        forward_ms: median forward+loss time, ms (None when simulated or not timed).
        backward_ms: median backward time, recomputation included, ms.
        step_ms: median whole-step time, optimizer included, ms.
        blocks: per-block figures, in forward order.
        ops: every op of the tracked step, in order.
        simulated: the step ran under FakeTensorMode.
        device: the device the step ran on (fake device when simulated), e.g. ``"cpu"``.
        cuda_peak_bytes: on CUDA, ``max_memory_allocated`` during an untracked step,
            minus what was allocated before it, plus the bytes the tracker counts at the
            step's start (parameters, buffers, optimizer state, batch): the allocator's
            view of ``peak_bytes``. It reads higher by allocator rounding (512-byte
            blocks) and kernel workspaces. None elsewhere.
        peak_phase: the phase in which the peak was reached.
        peak_breakdown: bytes per kind at the peak (``"params"``, ``"grads"``,
            ``"optimizer_state"``, ``"batch"``, ``"forward"`` (activations),
            ``"backward"``, ``"recompute"``, ``"optimizer"``, ...).
    """

    peak_bytes: int
    activation_bytes: int
    param_bytes: int
    buffer_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    batch_bytes: int
    flops: int
    forward_flops: int
    backward_flops: int
    recompute_flops: int
    forward_ms: float | None
    backward_ms: float | None
    step_ms: float | None
    blocks: tuple[BlockProfile, ...]
    ops: tuple[OpRecord, ...] = field(repr=False)  # thousands of them
    simulated: bool
    device: str
    cuda_peak_bytes: int | None = None
    peak_phase: str | None = None
    peak_breakdown: Mapping[str, int] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for key in ("peak_bytes", "activation_bytes", "param_bytes", "buffer_bytes",
                    "grad_bytes", "optimizer_bytes", "batch_bytes", "flops", "forward_flops",
                    "backward_flops", "recompute_flops"):
            if getattr(self, key) < 0:
                raise ValueError(f"Profile: {key} must be >= 0, got {getattr(self, key)}")
        parts = self.forward_flops + self.backward_flops + self.recompute_flops
        if self.flops != parts:
            raise ValueError(
                f"Profile: flops ({self.flops}) must equal forward_flops + backward_flops + "
                f"recompute_flops ({parts})"
            )
        for key in ("forward_ms", "backward_ms", "step_ms"):
            value = getattr(self, key)
            if value is not None and (self.simulated or value < 0):
                raise ValueError(f"Profile: {key} must be None when simulated and >= 0 "
                                 f"otherwise, got {value} (simulated={self.simulated})")

    @property
    def fixed_bytes(self) -> int:
        """Bytes no checkpointing can remove: parameters, buffers, gradients, optimizer state."""
        return self.param_bytes + self.buffer_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def recompute_overhead(self) -> float:
        """Recomputed FLOPs as a fraction of the step's other FLOPs (0.0 = none)."""
        base = self.forward_flops + self.backward_flops
        return self.recompute_flops / base if base else 0.0

    @property
    def backward_forward_ratio(self) -> float | None:
        """``backward_ms / forward_ms`` (about 2 without checkpointing); None if untimed."""
        if self.forward_ms is None or self.backward_ms is None or self.forward_ms <= 0:
            return None
        return self.backward_ms / self.forward_ms

    def block(self, name: str) -> BlockProfile:
        """The block called ``name``; KeyError listing the known names otherwise."""
        for b in self.blocks:
            if b.name == name:
                return b
        raise KeyError(f"Profile.block: no block {name!r}; blocks: "
                       f"{', '.join(b.name for b in self.blocks) or '(none)'}")

    def ops_in(self, phase: str) -> tuple[OpRecord, ...]:
        """The ops of one phase: ``"forward"``, ``"backward"``, ``"recompute"``, ``"optimizer"``."""
        if phase not in PHASES:
            raise ValueError(f"Profile.ops_in: phase must be one of {PHASES}, got {phase!r}")
        return tuple(op for op in self.ops if op.phase == phase)


# ---- checks and block lookup -------------------------------------------------------------

def _check_trainable(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{_API}: model must be an nn.Module, got {type(model).__name__}")
    if not model.training:
        raise ValueError(
            f"{_API}: {type(model).__name__} is in eval mode, so there is no training step "
            "to measure (dropout off, nothing to checkpoint). Call model.train() first."
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"{_API}: no parameter of {type(model).__name__} requires grad "
            f"({sum(1 for _ in model.parameters())} parameters), so there is nothing to train. "
            "Unfreeze some with p.requires_grad_(True)."
        )


def _named_blocks(model: nn.Module, blocks: Any) -> list[tuple[str, nn.Module]]:
    from remat.blocks import named_blocks
    from remat.errors import BlocksNotFound

    if blocks is not None:
        return named_blocks(model, blocks)
    try:
        return named_blocks(model)
    except BlocksNotFound:  # a model without repeated blocks still has a profile
        return []


# ---- snapshot / restore ------------------------------------------------------------------

def _host_copy(t: Tensor) -> Tensor:
    return t.detach().to("cpu", copy=True)


@contextmanager
def preserved_state(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    device: torch.device) -> Iterator[None]:
    """Restore parameters, gradients, buffers, optimizer state and RNG on exit.

    Parameters and optimizer state are copied to host memory only when an optimizer
    is given (only an update changes them); gradients are put back as the same tensors.
    """
    params = list(dict.fromkeys(model.parameters()))
    grads = [(p, p.grad) for p in params]
    values = [(p, _host_copy(p)) for p in params] if optimizer is not None else []
    buffers = [(b, _host_copy(b)) for b in model.buffers()]
    state: list[tuple[Any, dict[str, Any], list[tuple[str, Any, Any]]]] = []
    groups: list[dict[str, Any]] = []
    if optimizer is not None:
        for p, entries in optimizer.state.items():
            saved = [(k, v, _host_copy(v) if isinstance(v, Tensor) else copy.deepcopy(v))
                     for k, v in entries.items()]
            state.append((p, entries, saved))
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                  for g in optimizer.param_groups]
    devices = [device.index or 0] if device.type == "cuda" else []
    with ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=devices))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, v in values:
                    p.copy_(v)
                for b, v in buffers:
                    b.copy_(v)
            for p, g in grads:
                p.grad = g
            if optimizer is not None:
                optimizer.state.clear()
                for p, entries, saved in state:
                    entries.clear()
                    for k, original, value in saved:
                        if isinstance(original, Tensor):
                            with torch.no_grad():
                                original.copy_(value)
                            entries[k] = original
                        else:
                            entries[k] = value
                    optimizer.state[p] = entries
                for group, saved_group in zip(optimizer.param_groups, groups, strict=True):
                    group.update(saved_group)


# ---- the tracked step --------------------------------------------------------------------

@dataclass
class _Tracked:
    tracker: MemoryTracker
    static: dict[str, int]
    grad_bytes: int


def _tracked_step(model: nn.Module, batch: Any, *, loss_fn: LossFn | None,
                  optimizer: torch.optim.Optimizer | None,
                  blocks: Sequence[tuple[str, nn.Module]], device: torch.device) -> _Tracked:
    tracker = MemoryTracker(device=device, blocks=blocks)
    tracker.register_model(model)
    if optimizer is not None:
        tracker.register_optimizer(optimizer)
    tracker.register(batch_tensors(batch), "batch")
    static = tracker.current_breakdown
    grad_bytes = 0

    def on_phase(phase: str) -> None:
        nonlocal grad_bytes
        if phase in ("optimizer", "end") and tracker.phase == "backward":
            grad_bytes = tracker.bytes_of(p.grad for p in model.parameters())
        if phase != "end":
            tracker.set_phase(phase)

    # Automatic garbage collection would free cyclic garbage at arbitrary moments, and
    # differently in real and fake runs (they allocate different Python objects): hold it.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with tracker:
            run_step(model, batch, loss_fn=loss_fn, optimizer=optimizer, on_phase=on_phase)
    finally:
        if gc_was_enabled:
            gc.enable()
    return _Tracked(tracker, static, grad_bytes)


def _build(tracked: _Tracked, blocks: Sequence[tuple[str, nn.Module]], *, simulated: bool,
           device: torch.device, times: Any = None, block_ms: Mapping[str, float] | None = None,
           cuda_peak_bytes: int | None = None) -> Profile:
    tracker = tracked.tracker
    ops = tracker.ops
    phase_flops = dict.fromkeys(PHASES, 0)
    per_block: dict[tuple[str | None, str], int] = {}
    for op in ops:
        phase_flops[op.phase] += op.flops
        if op.flops and op.block is not None:
            key = (op.block, op.phase)
            per_block[key] = per_block.get(key, 0) + op.flops
    saved = tracker.block_saved_bytes
    block_profiles = tuple(
        BlockProfile(
            name=name,
            saved_bytes=saved.get(name, 0),
            forward_flops=per_block.get((name, "forward"), 0),
            forward_ms=(block_ms.get(name, 0.0) if block_ms is not None else None),
            backward_flops=per_block.get((name, "backward"), 0),
            recompute_flops=per_block.get((name, "recompute"), 0),
        )
        for name, _ in blocks
    )
    static = tracked.static
    return Profile(
        peak_bytes=tracker.peak_bytes,
        activation_bytes=tracker.activation_bytes,
        param_bytes=static.get("params", 0),
        buffer_bytes=static.get("buffers", 0),
        grad_bytes=tracked.grad_bytes,
        optimizer_bytes=static.get("optimizer_state", 0),
        batch_bytes=static.get("batch", 0),
        flops=phase_flops["forward"] + phase_flops["backward"] + phase_flops["recompute"],
        forward_flops=phase_flops["forward"],
        backward_flops=phase_flops["backward"],
        recompute_flops=phase_flops["recompute"],
        forward_ms=times.forward_ms if times is not None else None,
        backward_ms=times.backward_ms if times is not None else None,
        step_ms=times.step_ms if times is not None else None,
        blocks=block_profiles,
        ops=ops,
        simulated=simulated,
        device=str(device),
        cuda_peak_bytes=cuda_peak_bytes,
        peak_phase=tracker.peak_phase,
        peak_breakdown=tracker.peak_breakdown,
    )


def _cuda_peak(model: nn.Module, batch: Any, loss_fn: LossFn | None,
               optimizer: torch.optim.Optimizer | None, device: torch.device,
               static_bytes: int) -> int:
    clear_grads(model)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_step(model, batch, loss_fn=loss_fn, optimizer=optimizer)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    clear_grads(model)
    return int(peak - before + static_bytes)


# ---- public entry points -----------------------------------------------------------------

def profile(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    simulate: bool = False,
    blocks: Any = None,
    timing: bool = True,
    repeats: int = 5,
) -> Profile:
    """Measure one training step exactly: peak and activation bytes, FLOPs, times, per block.

    Bytes come from a storage-level tracker (every tensor the step creates, counted
    once per storage and subtracted when freed), not from estimates, so they are
    exact on CPU and CUDA alike; the tracker costs a few microseconds per op, so
    times come from separate untracked runs. ``simulate=True`` runs the same step
    on fake tensors: nothing is allocated, the bytes are the same on CPU, and
    models on the meta device can be measured at any size (no timings then).
    See NOTE [ What a profile runs ] for the exact sequence of steps.

    Note:
        The model, its gradients, its buffers, the optimizer state and the RNG state are
        left as they were: parameters, buffers and optimizer state are snapshotted
        (to host memory) and copied back, gradients are put back as the same tensors.
        This needs host memory for one copy of them when an optimizer is given.

    Args:
        model: the model, in train mode, with at least one parameter requiring grad.
            Apply a strategy first (``remat.apply``) to measure it.
        batch: a tensor (``model(batch)``), a tuple/list (``model(*batch)``) or a dict
            (``model(**batch)``).
        loss_fn: ``loss_fn(output, batch) -> scalar``. Default: ``output.loss`` when
            present, else the first element of a tuple output, else ``output.float().mean()``.
        optimizer: stepped in the measured step (its state counts toward the peak); a
            warm-up step creates the state first. Default: ``None`` (no update).
        simulate: run under FakeTensorMode instead of for real. Default: ``False``.
        blocks: which modules are blocks (class, classes or ``(name, module) -> bool``).
            Default: the repeated blocks :func:`remat.blocks.named_blocks` finds, or
            none when the model has no repeated blocks.
        timing: measure times (real runs only). Default: ``True``.
        repeats: timed runs per median, >= 1. Default: 5.

    Returns:
        A :class:`Profile`.

    Raises:
        ValueError: model in eval mode, no trainable parameter, ``repeats < 1``, or a loss
            that does not require grad.
        TypeError: unsupported batch type, or no loss can be derived from the output.

    Example:
        >>> from remat.models import build_model, make_batch
        >>> model = build_model("gpt-tiny")
        >>> prof = profile(model, make_batch(model, 2), timing=False)
        >>> prof.activation_bytes > 0 and prof.peak_bytes > prof.param_bytes
        True
    """
    _check_trainable(model)
    if repeats < 1:
        raise ValueError(f"{_API}: repeats must be >= 1, got {repeats}")
    if simulate:
        return profile_simulated(model, batch, loss_fn=loss_fn, optimizer=optimizer,
                                 blocks=blocks)
    named = _named_blocks(model, blocks)
    device = model_device(model)
    with preserved_state(model, optimizer, device):
        clear_grads(model)
        run_step(model, batch, loss_fn=loss_fn, optimizer=optimizer)  # warm-up
        clear_grads(model)
        tracked = _tracked_step(model, batch, loss_fn=loss_fn, optimizer=optimizer,
                                blocks=named, device=device)
        clear_grads(model)
        times = block_ms = None
        if timing:
            times = time_step(model, batch, loss_fn=loss_fn, optimizer=optimizer,
                              repeats=repeats, device=device, warmup=0)
            block_ms = time_blocks(model, batch, named, loss_fn=loss_fn, repeats=repeats,
                                   device=device, warmup=0)
        cuda_peak = None
        if device.type == "cuda":
            cuda_peak = _cuda_peak(model, batch, loss_fn, optimizer, device,
                                   sum(tracked.static.values()))
    return _build(tracked, named, simulated=False, device=device, times=times,
                  block_ms=block_ms, cuda_peak_bytes=cuda_peak)


def profile_simulated(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    blocks: Any = None,
    device: torch.device | str | None = None,
) -> Profile:
    """:func:`profile` with ``simulate=True``, plus the choice of the fake device.

    The model is copied with :func:`~remat.measure.fake.fake_copy` (the original, real or
    on the meta device, is never run), the batch is made fake, and the optimizer is
    rebuilt over the fake parameters with the same class and hyperparameters.

    Args:
        model, batch, loss_fn, optimizer, blocks: as for :func:`profile`.
        device: device the fake tensors claim to be on; it decides which kernels' output
            shapes are used (e.g. the attention kernel). A CUDA device needs a
            CUDA-enabled PyTorch build (not a GPU). Default: each tensor's own device,
            CPU for meta tensors.

    Example:
        >>> from remat.models import build_model, make_batch
        >>> with torch.device("meta"):
        ...     model = build_model("gpt-tiny")
        >>> batch = make_batch("gpt-tiny", 2)
        >>> profile_simulated(model, batch).simulated
        True
    """
    _check_trainable(model)
    check_fake_device(device)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fmodel, replaced = fake_copy_with_map(model, fake_mode, device=device)
    fbatch = fake_batch(batch, fake_mode, device=device)
    fopt = fake_optimizer(optimizer, replaced) if optimizer is not None else None
    named = _named_blocks(fmodel, blocks)
    fdevice = model_device(fmodel)
    with fake_mode:
        run_step(fmodel, fbatch, loss_fn=loss_fn, optimizer=fopt)  # warm-up, as for real
        clear_grads(fmodel)
        tracked = _tracked_step(fmodel, fbatch, loss_fn=loss_fn, optimizer=fopt,
                                blocks=named, device=fdevice)
    return _build(tracked, named, simulated=True, device=fdevice)
