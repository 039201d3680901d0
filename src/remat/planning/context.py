"""Measure once, plan many budgets: candidates measured and the peak model calibrated.

Steps 1-3 of NOTE [ How a plan is made ] (planner.py): fake copies of the step, every
candidate of every kind of block measured, one whole step cut into memory windows,
the peak model calibrated. The result, a :class:`PlanContext`, is reusable across budgets.

NOTE [ Planning on a real copy ]
    Some steps cannot run on fake tensors (NOTE [ What fake tensors cannot run ] in
    measure/fake.py): a mixture of experts that dispatches tokens with ``torch.where`` /
    ``nonzero`` (litgpt's MoE) or sizes its experts with ``.tolist()`` (JetMoE), a CTC
    loss that ``masked_select``s its targets, LED's ``.item()`` on its global-attention
    mask, a router that converts its own weights in forward. Where the fake copy fails
    for such a reason and the model is on a real device, steps 1-3 run again on a
    *real* copy of the model, batch and optimizer (``FakeSetup.real``; the same
    measuring code, each block run and the windows step computing for real), with one
    :class:`~remat.errors.RematWarning` that says why. The user's model is still
    untouched, at the price of a second copy of its tensors while planning and real
    compute for every candidate. On CPU the bytes are a real run's (NOTE [ A real copy
    standing in for the fake one ]); what a data-dependent step allocates is measured for
    the batch given (another
    routing allocates otherwise, which the closed loop, measuring the real step, checks
    for that batch). A model on the meta device has no real copy: the error says so.
    Any other error of the fake copy is the model's own and is raised as it is.

NOTE [ A real copy standing in for the fake one ]
    A fake copy computes nothing but pays Python dispatch on every op, about fifteen times
    an untracked real CPU op; on a small CPU model that dispatch costs more than the
    arithmetic it skips. So where the model is on the CPU, runs in no process group, and
    ``stand_in`` is on (``remat.plan`` without ``simulate=True``), steps 1-3 price the two
    copies from the work of the capture forward (its ops and FLOPs, NOTE [ Pricing a fake
    and a real copy ] in copy_cost.py) and measure on a real copy of the model, batch and
    optimizer when that is cheaper and the model's parameters and buffers are at most
    ``STAND_IN_MAX_BYTES`` (the copy doubles them while planning), and only where its
    capture forward records the very ops the fake one did (names, FLOPs, bytes read, written
    and allocated): a kernel may decompose otherwise on fake tensors, which would give
    the two copies other save sets (a constant made in the forward with ``torch.tensor``
    records the same traffic on both: NOTE [ Bytes moved ] in measure/flops.py). The
    stand-in measures what the fake copy would, so the plan is the same either way and
    only the time differs: its mode
    (:class:`StandIn`) forks the random number generators (the user's RNG is left as it
    was), counts no probed kernel scratch (NOTE [ Kernel scratch measured by probes ] in
    measure/scratch.py) and records no generator state for a kept random op (NOTE [ Kept
    random ops and the RNG ] in strategies/sac_rng.py: a region's first call only, which the
    first-step allocator check reads). Those are the bytes a real CPU run sees and a fake
    one does not. It computes on one intra-op thread (priced so): its ops are small, and on
    a busy machine several threads' spinning workers stall each other. A stand-in is
    ``FakeSetup.real`` and ``FakeSetup.stand_in``; the closed loop measures its choices on
    the real model as it does a fake copy's (NOTE [ Closed loop on the real model ] in
    loop.py), and a choice it measures on the copy counts as simulated, as the fake copy's
    would.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import CheckpointError

from remat.blocks import BlocksSpec, named_blocks
from remat.core.cost import static_bytes
from remat.core.op_record import OpRecord
from remat.core.peak import PeakModel
from remat.core.results import Profile
from remat.devices import DeviceSpec
from remat.errors import RematError, RematWarning, message, one_line
from remat.measure.fake import (
    fake_batch,
    fake_copy_with_map,
    fake_failure,
    fake_optimizer,
    real_copy_with_map,
)
from remat.measure.fake_mode import new_fake_mode
from remat.measure.ledger import categorized
from remat.measure.scratch import without_probed_scratch
from remat.measure.shadow import one_thread
from remat.measure.step import Step, model_device
from remat.measure.tracked_step import check_trainable
from remat.measure.tracker import MemoryTracker
from remat.measure.windows import FakeSetup, StepWindows, run_windows
from remat.planning.candidates import BlockGroup, Candidate, measure_groups
from remat.planning.capture import capture_inputs
from remat.planning.copy_cost import fake_seconds, in_process_group, real_seconds
from remat.planning.coverage import warn_uncovered
from remat.planning.in_flight import check_in_flight, forward_held_bytes, in_flight_model
from remat.planning.options import COSTS
from remat.planning.plans import COST_SOURCES
from remat.planning.recompute_cost import cost_device
from remat.planning.timed import time_groups
from remat.progress import report
from remat.strategies import BlockStrategy, remove
from remat.strategies.head import HEAD_KEY
from remat.strategies.pitfalls import check_model, warn_pitfalls
from remat.strategies.sac_rng import generators_unfollowed


def fake_setup(model: nn.Module, batch: Any, *, optimizer: torch.optim.Optimizer | None,
               blocks: BlocksSpec) -> FakeSetup:
    """Copy ``model`` (without any applied strategy), ``batch`` and ``optimizer`` as fakes."""
    mode = new_fake_mode()
    fmodel, replaced = fake_copy_with_map(model, mode)
    remove(fmodel)  # plan from the un-checkpointed model, whatever is applied to the original
    fmodel.train(model.training)
    fbatch = fake_batch(batch, mode)
    fopt = fake_optimizer(optimizer, replaced) if optimizer is not None else None
    named = named_blocks(fmodel, blocks, api="remat.plan")
    return FakeSetup(mode, fmodel, fbatch, fopt, named, model_device(fmodel))


def real_setup(model: nn.Module, batch: Any, *, optimizer: torch.optim.Optimizer | None,
               blocks: BlocksSpec) -> FakeSetup:
    """Copy ``model`` (without any applied strategy) and ``optimizer`` with real tensors,
    the batch as it is (NOTE [ Planning on a real copy ])."""
    rmodel, replaced = real_copy_with_map(model)
    remove(rmodel)
    rmodel.train(model.training)
    ropt = fake_optimizer(optimizer, replaced) if optimizer is not None else None
    named = named_blocks(rmodel, blocks, api="remat.plan")
    device = model_device(rmodel)
    return FakeSetup(KeptRng(device), rmodel, batch, ropt, named, device, real=True)


#: The largest model (parameter and buffer bytes) measured on a real stand-in copy (NOTE
#: [ A real copy standing in for the fake one ]).
STAND_IN_MAX_BYTES = 1 << 30


def stand_in_setup(model: nn.Module, batch: Any, *, optimizer: torch.optim.Optimizer | None,
                   blocks: BlocksSpec) -> FakeSetup:
    """A real copy of ``model`` measured as its fake copy would be (NOTE [ A real copy
    standing in for the fake one ])."""
    setup = real_setup(model, batch, optimizer=optimizer, blocks=blocks)
    return replace(setup, mode=StandIn(setup.device), stand_in=True)


class KeptRng:
    """A real copy's ``FakeSetup.mode``: each entry forks the random number generators
    (CPU, and ``device``'s when it is a GPU), so runs on the copy leave the user's RNG as
    it was (dropout draws, data2vec's masks)."""

    def __init__(self, device: torch.device) -> None:
        self._devices = [device] if device.type == "cuda" else []
        self._entered: list[AbstractContextManager[Any]] = []

    def __enter__(self) -> None:
        forked = torch.random.fork_rng(devices=self._devices)
        forked.__enter__()
        self._entered.append(forked)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._entered.pop().__exit__(kind, error, trace)


class StandIn(KeptRng):
    """A stand-in copy's ``FakeSetup.mode``: the generators forked as :class:`KeptRng`
    forks them, and the copy measured as a fake one is (NOTE [ A real copy standing in
    for the fake one ]): no probed kernel scratch, no generator state recorded for a
    kept random op."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._as_fake: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        super().__enter__()
        stack = contextlib.ExitStack()
        stack.enter_context(without_probed_scratch())
        stack.enter_context(generators_unfollowed())
        stack.enter_context(one_thread())
        self._as_fake.append(stack)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._as_fake.pop().close()
        super().__exit__(kind, error, trace)


@dataclass(frozen=True)
class PlanContext:
    """Everything measured to plan one model and batch (reusable across budgets).

    Args:
        peak_model: the calibrated peak model with every block's candidates.
        device: the cost device.
        no_checkpoint_peak_bytes: peak of the step without checkpointing (simulated;
            on CPU equal to a real run's).
        batch_size: the batch's leading dimension, when there is one.
        static_bytes: the bytes at the un-checkpointed peak that no checkpointing can
            remove, ``static_bytes`` of its breakdown (NOTE [ Static bytes ] in
            remat/core/cost.py): what an ``"activations:50%"`` budget keeps whole (NOTE
            [ Budget forms ]).
        cost_source: ``"roofline"`` or ``"measured"`` (candidates' costs timed on the
            model's device; see NOTE [ Measured cost ] in timed.py).
        timed_on: with ``"measured"``, the device the times come from.
        setup: the fake copy the candidates and windows were measured on, warm (optimizer
            state created); the closed loop measures on it where fake bytes are real bytes
            (NOTE [ Closed loop on the fake copy ] in loop.py). Default: None.
        head: the output head's decision every choice includes (a chunked head, NOTE
            [ Head choice ] in head.py), its bytes in the peak model's window constants.
            Default: None (the head as the model runs it).
        microbatches_in_flight: micro-batches a pipeline stage holds at its worst moment;
            the peak model holds ``microbatches_in_flight - 1`` of them besides the one
            it runs (NOTE [ Micro-batches in flight ] in in_flight.py). Default: 1.
        builtin: per block (forward order), each built-in strategy's decision on it measured
            like a candidate, outside the solver's tables (``BlockGroup.builtin``; NOTE
            [ Never worse than manual ] in manual.py). Default: ``()`` (none measured).
        copy_profiles: the profiles of the steps the closed loop measured on ``setup``, per
            set of decisions (``planning.loop.measure_on_copy``): a choice measured once is
            not measured again. The contexts derived with ``dataclasses.replace`` (a head,
            micro-batches in flight) share it, as they share ``setup``. Default: empty.
    """

    peak_model: PeakModel[Candidate]
    device: DeviceSpec
    no_checkpoint_peak_bytes: int
    batch_size: int | None
    static_bytes: int
    cost_source: str = "roofline"
    timed_on: str | None = None
    setup: FakeSetup | None = field(default=None, compare=False, repr=False)
    head: BlockStrategy | None = None
    microbatches_in_flight: int = 1
    builtin: tuple[tuple[Candidate, ...], ...] = ()
    copy_profiles: dict[tuple[tuple[str, BlockStrategy], ...], Profile | None] = field(
        default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_in_flight(self.microbatches_in_flight, api="PlanContext")
        if self.peak_model.held_copies != self.microbatches_in_flight - 1:
            raise ValueError(message(
                "PlanContext", "the peak model holds another number of micro-batches",
                {"microbatches_in_flight": self.microbatches_in_flight,
                 "peak model holds": self.peak_model.held_copies + 1},
                fix="build the peak model with planning.in_flight.in_flight_model"))
        if self.cost_source not in COST_SOURCES:
            raise ValueError(message("PlanContext", "unknown cost_source",
                                     {"found": repr(self.cost_source)},
                                     fix=f"pass one of {COST_SOURCES}"))

    def recompute_ms(self, choice: Sequence[int]) -> float:
        """The solver's cost of a choice: its candidates' recompute costs summed, ms."""
        return sum(table[c].recompute_ms
                   for table, c in zip(self.peak_model.tables, choice, strict=True))

    @property
    def block_names(self) -> tuple[str, ...]:
        """The blocks' qualified names, in forward order."""
        return self.peak_model.block_names

    def decisions(self, choice: Sequence[int]) -> dict[str, BlockStrategy]:
        """What each module gets under a choice (candidate index per block), ``"none"``
        left out."""
        out: dict[str, BlockStrategy] = {} if self.head is None else {HEAD_KEY: self.head}
        for name, table, c in zip(self.block_names, self.peak_model.tables, choice, strict=True):
            out.update(table[c].decisions_for(name))
        return out


def batch_size_of(batch: Any) -> int | None:
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    values: Any = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, (list, tuple)) or isinstance(batch, Mapping):
        for v in values:
            size = batch_size_of(v)
            if size is not None:
                return size
    return None


def resolve_cost(cost: str, model: nn.Module, *, simulate: bool = False) -> str:
    """``"roofline"`` or ``"measured"`` for ``cost="auto"|"roofline"|"measured"``.

    ``"auto"`` measures on CUDA (real runs) and uses the roofline elsewhere, where wall
    time is too noisy to plan with or nothing runs for real.

    Raises:
        ValueError: an unknown ``cost``, or ``"measured"`` where nothing runs for real.
    """
    if cost not in COSTS:
        raise ValueError(message("remat.plan", "unknown cost", {"found": repr(cost)},
                                 fix=f"pass one of {COSTS}"))
    device = model_device(model)
    if cost == "auto":
        return "measured" if device.type == "cuda" and not simulate else "roofline"
    if cost == "measured" and (simulate or device.type == "meta"):
        why = "simulate=True runs on fake tensors" if simulate else \
            "the model is on the meta device"
        raise ValueError(message(
            "remat.plan", "cost='measured' cannot run here",
            {"needs": "real forward and backward runs of the model's blocks", "but": why},
            fix="use cost='roofline' (or 'auto')"))
    return cost


def _device_label(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return str(device)


def prepare(model: nn.Module, batch: Any, *, loss_fn: Any = None,
            optimizer: torch.optim.Optimizer | None = None, blocks: Any = None,
            device: str | DeviceSpec | None = None, cost: str = "auto",
            microbatches_in_flight: int = 1, stand_in: bool = True) -> PlanContext:
    """Measure candidates and calibrate the peak model (steps 1-3 of NOTE [ How a plan is made ]).

    Bytes are measured on copies (fake ones, or on a small CPU model a real stand-in that
    measures the same bytes faster), so the model, its gradients, the optimizer and the
    RNG are untouched; with ``cost="measured"`` each candidate is also timed on the real model
    (its state is restored). :func:`remat.plan` calls this; call it yourself to plan
    several budgets for one model and batch without measuring twice
    (``remat.plan(..., context=ctx)``).

    Args:
        model, batch, loss_fn, optimizer, blocks, cost: as for :func:`remat.plan`
            (``"auto"`` here measures on CUDA).
        device: the cost device (name or spec). Default: the model's GPU when remat
            knows it, else ``"h100-80gb"``.
        microbatches_in_flight: as for :func:`remat.plan`. Default: 1.
        stand_in: measure a CPU model on a real copy where that is cheaper than on a fake
            one (the same bytes; NOTE [ A real copy standing in for the fake one ]);
            ``False`` measures on fake tensors only. Default: True.
    """
    step = Step(model, batch, loss_fn=loss_fn, optimizer=optimizer, blocks=blocks,
                microbatches_in_flight=microbatches_in_flight)
    return prepare_step(step, device=device, cost=cost, stand_in=stand_in)


def prepare_step(step: Step, *, device: str | DeviceSpec | None = None,
                 cost: str = "auto", stand_in: bool = True) -> PlanContext:
    """:func:`prepare` for a resolved :class:`~remat.measure.step.Step`."""
    model = step.model
    check_plannable(model)
    source = resolve_cost(cost, model)
    spec = cost_device(model_device(model), device)
    report("fake copy", 0, 3)
    try:
        setup = fake_setup(model, step.batch, optimizer=step.optimizer, blocks=step.blocks)
        setup, groups, windows = _measure(setup, step, spec, source, stand_in=stand_in)
    except Exception as error:  # NOTE [ Planning on a real copy ]
        why = fake_failure(error)
        if why is None:
            raise
        report("real copy", 0, 3)
        setup = _real_fallback(model, step, why, error)
        try:
            setup, groups, windows = _measure(setup, step, spec, source, stand_in=False)
        except (RuntimeError, CheckpointError) as real_error:
            again = fake_failure(real_error)
            if again is None and not isinstance(real_error, CheckpointError):
                raise
            raise RematError(message(
                "remat.plan", f"neither a fake nor a real copy of {type(model).__name__} "
                "can run its step", {"fake copy": why,
                                     "real copy": again or one_line(str(real_error))[:200]},
                fix="run one training step before planning (a module that changes itself on "
                    "its first call is then as it stays), or pass blocks= leaving out the "
                    "module that fails")) from real_error
    timed_on = None
    if source == "measured":
        groups = time_groups(model, step.batch, groups, blocks=step.blocks)
        timed_on = _device_label(model_device(model))
    peak_model = PeakModel.calibrate(groups, [n for n, _ in setup.blocks], windows)
    if step.blocks is None:  # NOTE [ Blocks that miss the activations ] in coverage.py
        warn_uncovered(step, setup, windows)
    static = static_bytes(categorized(windows.peak_breakdown))
    in_flight = step.microbatches_in_flight
    no_checkpoint = windows.peak_bytes
    if in_flight > 1:  # NOTE [ Micro-batches in flight ]
        held = forward_held_bytes(setup, loss_fn=step.loss_fn)
        peak_model = in_flight_model(peak_model, in_flight, held)
        no_checkpoint = peak_model.predict([0] * peak_model.num_blocks)
    builtin = {name: group.builtin for group in groups for name in group.names}
    return PlanContext(peak_model, spec, no_checkpoint, batch_size_of(step.batch), static,
                       source, timed_on, setup, microbatches_in_flight=in_flight,
                       builtin=tuple(builtin.get(n, ()) for n in peak_model.block_names))


def _measure(setup: FakeSetup, step: Step, spec: DeviceSpec, source: str, *, stand_in: bool
             ) -> tuple[FakeSetup, list[BlockGroup], StepWindows]:
    """Every candidate of every kind of block, and the whole step's windows, on ``setup``
    or, with ``stand_in``, on a real copy where that is cheaper (NOTE [ A real copy
    standing in for the fake one ]); the setup measured on is returned first."""
    report("block inputs", 1, 3)
    work = MemoryTracker() if stand_in and _may_stand_in(setup, step.model) else None
    inputs = capture_inputs(setup.model, setup.batch, setup.blocks,
                            mode=None if setup.real else setup.mode, tracker=work)
    if work is not None and _real_is_cheaper(work.ops):
        real = stand_in_setup(step.model, step.batch, optimizer=step.optimizer,
                              blocks=step.blocks)
        seen = MemoryTracker()
        with real.mode, seen:
            real_inputs = capture_inputs(real.model, real.batch, real.blocks)
        if seen.ops == work.ops:  # the same ops, FLOPs and bytes as the fake forward's
            setup, inputs = real, real_inputs
    groups = measure_groups(setup, spec, prune=source == "roofline",
                            builtin=source == "roofline", inputs=inputs)
    report("memory windows of the whole step", 2, 3)
    return setup, groups, run_windows(setup, loss_fn=step.loss_fn)


def _may_stand_in(setup: FakeSetup, model: nn.Module) -> bool:
    """A fake copy of a CPU model small enough to copy for real, in no process group."""
    if setup.real or model_device(model).type != "cpu" or in_process_group():
        return False
    held = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), *model.buffers()))
    return held <= STAND_IN_MAX_BYTES


def _real_is_cheaper(ops: Sequence[OpRecord]) -> bool:
    """Whether the capture forward's ``ops`` cost less on a real copy than on a fake one."""
    flops = sum(op.flops for op in ops)
    return real_seconds(len(ops), flops, threads=1) < fake_seconds(len(ops))


def _real_fallback(model: nn.Module, step: Step, why: str, error: Exception) -> FakeSetup:
    """A real copy to plan on, with the warning that says why (NOTE [ Planning on a real
    copy ]); a RematError where the model has no real tensors to copy."""
    name = type(model).__name__
    if model_device(model).type == "meta":
        raise RematError(message(
            "remat.plan", f"fake tensors cannot run a step of {name}, and it is on the meta "
            "device, so no real step can be measured either", {"why": why},
            fix="build the model on a real device (CPU, or the GPU it trains on) and plan "
                "with simulate=False")) from error
    warnings.warn(message(
        "remat.plan", f"fake tensors cannot run a step of {name}: measuring on a real copy "
        "instead", {"why": why, "costs": "a second copy of the model's tensors and real "
                    "compute per candidate while planning",
                    "bytes": "those of this batch (a data-dependent step allocates per batch)"},
        fix=None), RematWarning, stacklevel=4)
    return real_setup(model, step.batch, optimizer=step.optimizer, blocks=step.blocks)


def check_plannable(model: nn.Module) -> None:
    check_trainable(model, api="remat.plan",
                    why="a training step keeps no activations to plan for")
    # A KV cache (HF use_cache=True) would be filled while measuring blocks: turn it off
    # with the same warning remat.apply gives.
    found = [p for p in check_model(model) if p.kind in ("use_cache", "hf_gradient_checkpointing")]
    warn_pitfalls(found, api="remat.plan", model_name=type(model).__name__)
