"""``profile``: one training step measured exactly (bytes, FLOPs) and timed.

NOTE [ Compiled models ]
    A TorchDispatchMode or a module hook around a compiled model makes dynamo fall back
    to eager code (and can exhaust its recompile limit, leaving the user's model eager
    for good). So :func:`profile` hands compiled models to
    :func:`remat.compiled.measure.profile_compiled`, which reads the allocator instead of
    tracking ops (see that module). ``simulate=True`` hands them to
    :func:`remat.compiled.simulate.simulate_compiled`, which replays inductor's own
    generated code on a fake copy (NOTE [ Simulating compiled code ] there).

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
    4. On CUDA (or when asked, on CPU), one more untracked step read by the allocator
       (``max_memory_allocated``; the CPU allocator's profiler events) for
       ``allocator_peak_bytes``.
    Everything the steps change is restored afterwards (see :func:`profile`).
    With ``simulate=True`` steps 1-2 run on fake copies under FakeTensorMode
    and 3-4 are skipped.

NOTE [ The first step ]
    The first training step after ``remat.apply`` is not a steady step, and it is the
    one a job runs out of memory on. What it holds that later steps do not:

    * selective regions learn on their first call (NOTE [ Skipping only where it pays ]
      in strategies/sac.py): the dead-op ledger and the RNG replay of kept random ops
      (one 5056-byte CPU RNG state per kept random op that drew from the generator, such
      as attention with dropout; NOTE [ Kept random ops and the RNG ] in
      strategies/sac_rng.py) run in the first forward and are dropped where they saved
      nothing;
    * caches a model builds on its first forward (rotary tables, masks), allocated
      inside the first step and alive after it;
    * the optimizer state, created inside the first ``optimizer.step()`` (torch's
      optimizers create it lazily), while later steps start with it.

    With a fresh optimizer the missing state usually hides the first two (its bytes are
    not alive in the first forward), but a job resumed from a checkpoint starts with its
    optimizer state loaded *and* new regions: there the first step is the step's highest
    (a tiny Hugging Face Llama under ``ops`` with AdamW: 634,492 B against 624,380 B for
    later steps on the CPU allocator). The warm-up step every measurement runs first (NOTE
    [ What a profile runs ]) hides all of it. So wherever a plan's fit is checked on the
    allocator, the check runs the first step on the model with the choice freshly applied
    and the optimizer as the user passed it, then, with an optimizer, the first step of a
    resumed job (the choice applied anew over the state the first step made), then a
    steady step; the choice's allocator peak is the highest of them
    (:func:`first_step_peak`, ``first_steps_peak`` in planning/loop.py).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import DynamicOutputShapeException

from remat.core.cost import StepCost
from remat.core.op_record import PHASES
from remat.core.results import BlockProfile, Profile
from remat.errors import RematError, message, names_the_call, one_line
from remat.measure import shadow
from remat.measure.allocator import allocator_peak
from remat.measure.fake import (
    check_fake_device,
    fake_batch,
    fake_copy_with_map,
    fake_failure,
    fake_optimizer,
)
from remat.measure.fake_mode import new_fake_mode
from remat.measure.ledger import categorized
from remat.measure.shapes import unguarded
from remat.measure.state import preserved_state
from remat.measure.step import (
    LossFn,
    Step,
    batch_tensors,
    check_runnable,
    clear_grads,
    step_loss,
    warn_zeroed_gradients,
)
from remat.measure.timing import time_blocks, time_step
from remat.measure.tracked_step import Tracked, check_trainable, tracked_step
from remat.measure.tracker import MemoryTracker

_API = "remat.profile"


def profile_from_tracked(tracked: Tracked, blocks: Sequence[tuple[str, nn.Module]], *,
                         simulated: bool, device: torch.device, times: Any = None,
                         block_ms: Mapping[str, float] | None = None,
                         allocator_peak_bytes: int | None = None) -> Profile:
    """The :class:`~remat.core.results.Profile` of a step the tracker ran (``tracked``):
    its peak and breakdown, per-block bytes and FLOPs by phase."""
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
    cost = StepCost(
        peak_bytes=tracker.peak_bytes,
        breakdown=categorized(tracker.peak_breakdown),
        activation_bytes=tracker.activation_bytes,
        **tracked.resident_fields(),
        forward_flops=phase_flops["forward"],
        backward_flops=phase_flops["backward"],
        recompute_flops=phase_flops["recompute"],
        forward_ms=times.forward_ms if times is not None else None,
        backward_ms=times.backward_ms if times is not None else None,
        step_ms=times.step_ms if times is not None else None,
    )
    return Profile(
        cost=cost,
        blocks=block_profiles,
        ops=ops,
        simulated=simulated,
        device=str(device),
        allocator_peak_bytes=allocator_peak_bytes,
        peak_phase=tracker.peak_phase,
        phase_peaks=tracker.phase_peaks,
        timeline=tracker.timeline,
        allocations=tracker.allocations,
    )


def allocator_step_peak(step: Step, start_bytes: int) -> int:
    """The allocator's peak of one untracked step of ``step``, as the tracker counts a peak.

    The allocator's high-water mark above where the step started (NOTE [ What the
    allocator peak includes ] in allocator.py: CUDA's ``max_memory_allocated``, the CPU
    allocator's events under the profiler), plus ``start_bytes``, the bytes alive before
    the step that the tracker counts (parameters, buffers, optimizer state, batch). The
    step runs as the model is now: after a warm-up step it is a steady step, right after
    ``remat.apply`` it is the first step (:func:`first_step_peak`); the caller restores
    the model after. Automatic garbage collection is held, as in the tracked step.

    Args:
        step: the step to run once, untracked.
        start_bytes: bytes alive at the step's start, from the tracker, bytes.

    Example:
        >>> allocator_step_peak(step, prof.param_bytes + prof.batch_bytes)
    """
    clear_grads(step.model)
    held = gc.isenabled()
    gc.disable()
    try:
        peak = allocator_peak(step.run, device=step.device).peak_bytes
    finally:
        if held:
            gc.enable()
    clear_grads(step.model)
    return int(peak + start_bytes)


def start_bytes(step: Step) -> int:
    """Bytes alive on the step's device before it runs, as the tracker counts them:
    parameters, buffers, the optimizer state that exists now and the batch (each storage
    once). Gradients the model holds now are not counted: :func:`allocator_step_peak`
    clears them before its step, as a training loop's ``zero_grad`` does, so a model
    planned after a step of its own (gradients still set) reads the same peak as one
    planned before.

    Example:
        >>> start_bytes(Step(torch.nn.Linear(4, 4), torch.randn(2, 4)))
        112
    """
    tracker = MemoryTracker(device=step.device, record_ops=False)
    return tracker.register_step(step.model, step.optimizer, batch_tensors(step.batch),
                                 grads=False)


def first_step_peak(step: Step) -> int:
    """The allocator's peak of the step run now as the first step after ``remat.apply``,
    plus the bytes alive before it (NOTE [ The first step ]).

    Call it on a model whose regions were just installed, with the optimizer as the
    user's job has it (no state before its first ``step()``: the state is created inside
    the measured step); the caller restores the model after.

    Example:
        >>> remat.apply(model, plan)
        >>> first_step_peak(Step(model, batch, optimizer=opt)) <= plan.budget_bytes
        True
    """
    return allocator_step_peak(step, start_bytes(step))


# ---- public entry points -----------------------------------------------------------------

@names_the_call("remat.profile")
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
    accumulating: bool = False,
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
        A compiled model (``torch.compile(model)``, ``model.compile()`` or compiled blocks)
        is measured as it runs compiled (NOTE [ Compiled models ]): the peak from the
        allocator's own events (CPU) or statistics (CUDA), FLOPs from the partitioned
        graphs; remat installs no dispatch mode or hook on it, so it keeps running the
        same compiled graphs afterwards. ``blocks=`` is then not used. With
        ``simulate=True`` a compiled model is simulated from inductor's own generated code
        on fake tensors (:func:`remat.compiled.simulate.simulate_compiled`): nothing is
        allocated and the model is neither run nor compiled.

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
        accumulating: measure a gradient-accumulation micro-step after the first, which
            starts with every gradient held (:class:`~remat.measure.step.Accumulating`).
            Default: ``False`` (the step starts without gradients).

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
    from remat.compiled.measure import is_compiled, profile_compiled  # compiled imports us

    warn_zeroed_gradients(model, accumulating=accumulating, api="remat.profile")
    loss_fn = step_loss(loss_fn, accumulating=accumulating, api="remat.profile")
    if simulate:
        _check_repeats(repeats)
        return next(simulated_profiles(model, [batch], loss_fn=loss_fn, optimizer=optimizer,
                                       blocks=blocks))
    check_trainable(model)
    # A measurement, not training: a plan's shape guard lets any batch through (NOTE
    # [ Shape guard ] in strategies/guard.py), so a plan is measured at other shapes too.
    with unguarded():
        if is_compiled(model):  # NOTE [ Compiled models ]
            return profile_compiled(model, batch, loss_fn=loss_fn, optimizer=optimizer,
                                    timing=timing, repeats=repeats)
        step = Step(model, batch, loss_fn=loss_fn, optimizer=optimizer, blocks=blocks)
        return profile_step(step, timing=timing, repeats=repeats)


def simulated_profiles(model: nn.Module, batches: Sequence[Any], *,
                       loss_fn: LossFn | None = None,
                       optimizer: torch.optim.Optimizer | None = None,
                       blocks: Any = None) -> Iterator[Profile]:
    """``profile(model, batch, simulate=True)`` on each of ``batches``, one warm-up for all,
    each profile yielded as soon as its step is simulated (progress bars move per batch).

    The trade-off against one :func:`profile` call per batch: the batches share one fake
    copy and its warm-up step (:class:`WarmFake`), so ``n`` batches cost ``n + 1`` fake
    steps instead of ``2 n``; each batch's tracked step is still the whole step. A
    compiled model is simulated one batch at a time (its simulation,
    :func:`remat.compiled.simulate.simulate_compiled`, has no warm-up to share). The model
    and batches are checked when this is called; the steps run as the profiles are read,
    with the model as it is then.

    Args:
        model, loss_fn, optimizer, blocks: as for :func:`profile`.
        batches: the batches, profiled in order. At least one.

    Example:
        >>> from remat.models import build_model, make_batch
        >>> model = build_model("gpt-tiny")
        >>> batches = [make_batch(model, 1), make_batch(model, 2)]
        >>> small, large = simulated_profiles(model, batches)
        >>> small.activation_bytes < large.activation_bytes
        True
    """
    if not batches:
        raise ValueError(message(f"{_API}(simulate=True)", "no batch to profile",
                                 fix="pass one batch or more"))
    check_trainable(model)
    return _simulated_profiles(model, list(batches), loss_fn=loss_fn, optimizer=optimizer,
                               blocks=blocks)


def _simulated_profiles(model: nn.Module, batches: list[Any], *, loss_fn: LossFn | None,
                        optimizer: torch.optim.Optimizer | None,
                        blocks: Any) -> Iterator[Profile]:
    from remat.compiled.measure import is_compiled  # compiled imports us

    # Measurements, not training: each step runs unguarded (NOTE [ Shape guard ] in
    # strategies/guard.py), and nothing stays switched off between them.
    if is_compiled(model):  # NOTE [ Compiled models ]
        from remat.compiled.simulate import simulate_compiled

        for batch in batches:
            with unguarded():
                prof = simulate_compiled(model, batch, loss_fn=loss_fn,
                                         optimizer=optimizer).profile
            yield prof
        return
    with unguarded():
        step = Step(model, batches[0], loss_fn=loss_fn, optimizer=optimizer, blocks=blocks)
        check_runnable(model, api=_API, simulate=True)
    steps = _simulated_steps(step, batches, device=None)
    for _ in batches:
        with unguarded():
            prof = next(steps)
        yield prof


def _check_repeats(repeats: int) -> None:
    if repeats < 1:
        raise ValueError(message(_API, "repeats must be >= 1", {"found": repeats},
                                 fix="pass repeats >= 1"))


def profile_step(step: Step, *, simulate: bool = False, timing: bool = True,
                 repeats: int = 5, allocator: bool | None = None) -> Profile:
    """:func:`profile` of a resolved :class:`~remat.measure.step.Step` (its blocks found once).

    ``allocator`` also reads the allocator's peak of one more untracked step
    (:func:`allocator_step_peak`, ``Profile.allocator_peak_bytes``); ``None`` (the
    default) reads it on CUDA only, where it costs one step; on CPU the profiler's
    memory events make that step slower.

    Example:
        >>> profile_step(Step(model, batch), timing=False).peak_bytes > 0
        True
    """
    check_trainable(step.model)
    check_runnable(step.model, api=_API, simulate=simulate)
    _check_repeats(repeats)
    if simulate:
        return _simulated(step, device=None)
    named = step.blocks_found(api=_API, required=False)
    model, device = step.model, step.device
    with preserved_state(model, step.optimizer, device):
        clear_grads(model)
        step.run()  # warm-up
        clear_grads(model)
        tracked = tracked_step(step, named)
        clear_grads(model)
        times = block_ms = None
        if timing:
            times = time_step(model, step.batch, loss_fn=step.loss_fn, optimizer=step.optimizer,
                              repeats=repeats, device=device, warmup=0)
            block_ms = time_blocks(model, step.batch, named, loss_fn=step.loss_fn,
                                   repeats=repeats, device=device, warmup=0)
        allocator_bytes = None
        if allocator if allocator is not None else device.type == "cuda":
            allocator_bytes = allocator_step_peak(step, sum(tracked.static.values()))
    return profile_from_tracked(tracked, named, simulated=False, device=device, times=times,
                  block_ms=block_ms, allocator_peak_bytes=allocator_bytes)


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
    step = Step(model, batch, loss_fn=loss_fn, optimizer=optimizer, blocks=blocks)
    check_trainable(model)
    return _simulated(step, device=device)


def _simulated(step: Step, *, device: torch.device | str | None) -> Profile:
    """The tracked step on fake copies (NOTE [ What a profile runs ])."""
    return simulated_steps(step, [step.batch], device=device)[0]


def simulated_steps(step: Step, batches: Sequence[Any], *,
                    device: torch.device | str | None = None) -> list[Profile]:
    """Simulated profiles of ``step`` on each of ``batches``: one fake copy, one warm-up.

    The trade-off against one :func:`profile_simulated` call per batch: the warm-up
    step (NOTE [ What a profile runs ]) runs once, on the first batch, and every later
    batch's tracked step follows the previous tracked step. The optimizer state and
    caches a warm-up builds do not depend on the batch in the models remat knows, so
    the profiles are the same as separate calls' (``remat.simulate``'s fast rows rely on
    this and its tests compare them with separate full steps); a model that builds a
    batch-sized cache lazily would show that cache in a later batch's step.

    Args:
        step: the model (real or meta; never run), loss, optimizer and blocks. Its own
            batch is not profiled.
        batches: the batches, profiled in order. At least one.
        device: as for :func:`profile_simulated`. Default: each tensor's own device.

    Example:
        >>> from remat.models import build_model, make_batch
        >>> with torch.device("meta"):
        ...     model = build_model("gpt-tiny")
        >>> batches = [make_batch("gpt-tiny", 1), make_batch("gpt-tiny", 2)]
        >>> small, large = simulated_steps(Step(model, batches[0]), batches)
        >>> small.activation_bytes < large.activation_bytes
        True
    """
    if not batches:
        raise ValueError(message(_API, "simulated_steps needs at least one batch",
                                 fix="pass one batch or more"))
    return list(_simulated_steps(step, batches, device=device))


def _simulated_steps(step: Step, batches: Sequence[Any], *,
                     device: torch.device | str | None) -> Iterator[Profile]:
    """:func:`simulated_steps` as read: the warm-up at the first profile read, each batch's
    step when its profile is."""
    with _fake_step_errors():
        warm = WarmFake(step, batches[0], device=device)
    for batch in batches:
        with _fake_step_errors():
            (prof,) = warm.profiles([batch])
        yield prof


@contextmanager
def _fake_step_errors() -> Iterator[None]:
    """Raise a step fake tensors cannot run as a :class:`RematError` that says why (NOTE
    [ What fake tensors cannot run ] in measure/fake.py); other errors as they are."""
    try:
        yield
    except RematError:
        raise
    except Exception as error:
        why = fake_failure(error)
        if why is None:
            raise
        raise RematError(message(
            f"{_API}(simulate=True)", "fake tensors cannot run this step",
            {"why": why, "error": f"{type(error).__name__}: {one_line(str(error))[:200]}"},
            fix="profile on real tensors (simulate=False); remat.plan measures such a model "
                "on a real copy")) from error


class WarmFake:
    """A fake copy of a step's model and optimizer, warmed up once, to profile many steps.

    :func:`simulated_steps` profiles the model as it is; ``remat.simulate``'s fast rows
    also apply one strategy after another to :attr:`model` (the fake copy) between
    :meth:`profiles` calls, so every strategy at one depth shares one warm-up (the
    optimizer state a warm-up makes does not depend on the strategy).

    Args:
        step: the model (real or meta; never run), loss, optimizer and blocks.
        batch: the warm-up step's batch.
        device: as for :func:`profile_simulated`. Default: each tensor's own device.
        prepare: called on the copy before the warm-up (the fast rows pass
            ``remat.strategies.remove``: they apply each strategy themselves). Default: None
            (the copy runs as the model is).
    """

    def __init__(self, step: Step, batch: Any, *,
                 device: torch.device | str | None = None,
                 prepare: Callable[[nn.Module], Any] | None = None) -> None:
        check_fake_device(device)
        self.step, self.device = step, device
        self.mode = new_fake_mode()
        self.model, replaced = fake_copy_with_map(step.model, self.mode, device=device)
        if prepare is not None:
            prepare(self.model)
        self.optimizer = (fake_optimizer(step.optimizer, replaced)
                          if step.optimizer is not None else None)
        with self.mode:
            try:  # warm-up, as for real
                self._step(batch).run()
            except DynamicOutputShapeException as error:  # NOTE [ Data-dependent shapes ]
                raise shadow.data_dependent_error(error.func, error) from error

    def _step(self, batch: Any) -> Step:
        return self.step.with_model(self.model, self.optimizer,
                                    fake_batch(batch, self.mode, device=self.device))

    def profiles(self, batches: Sequence[Any]) -> list[Profile]:
        """A tracked step of the fake copy as it is now on each of ``batches``, in order."""
        fsteps = [self._step(b) for b in batches]
        named = fsteps[0].blocks_found(api=_API, required=False) if fsteps else []
        out = []
        with self.mode:
            for fstep in fsteps:
                clear_grads(self.model)
                out.append(profile_from_tracked(tracked_step(fstep, named), named, simulated=True,
                                  device=fstep.device))
        return out
