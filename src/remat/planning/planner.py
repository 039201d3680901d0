"""``remat.plan`` and ``remat.auto``: the cheapest checkpointing whose measured peak fits a budget.

NOTE [ How a plan is made ]
    1. Copy the model, batch and optimizer as fake tensors (nothing is computed or
       allocated, the user's model is untouched; see ``context.fake_setup``).
    2. Measure every candidate of every kind of block (candidates.py) and one
       whole step without checkpointing, cut into memory windows. With measured
       costs, time every candidate on the real model (timed.py).
    3. Calibrate the peak model (remat/core/peak.py) and solve for the cheapest choice whose
       predicted peak fits (remat/core/solver.py).
    4. Closed loop: apply the choice to the model, measure the step with
       :func:`remat.measure.profile` (real, or simulated with ``simulate=True``),
       and if the measured peak is over budget, tighten the solver's budget by the
       overshoot and solve again. The returned plan's measured peak never exceeds
       the budget; when no plan fits, :class:`~remat.errors.BudgetTooSmall` says
       what the smallest reachable peak is and what fills it.

NOTE [ Throughput search ]
    :func:`plan_throughput` takes a function ``n -> batch``. Batch sizes 1, 2, 4, ...
    are planned until none fits the budget (or ``ThroughputSearch.max_batch_size``),
    then the largest fitting size is refined by bisection.
    Each size's best plan gets a step time, predicted (cost.py, NOTE [ Step-time
    model ]) or, with measured costs, timed on the device, and samples per second;
    the plan with the most samples per second wins and carries the whole table in
    ``plan.throughput``.

NOTE [ A byte budget without an optimizer ]
    A budget in bytes (``"12GiB"``, or ``"device"``: the card) promises the training job
    fits, and the job steps an optimizer whose state (AdamW: two moments, twice the
    trainable parameters' bytes) lives from its first step on. A plan made without the
    optimizer counts none of it, so :func:`plan` and :func:`plan_throughput` warn, with
    what AdamW would add. A percent budget is of a step measured as given, so it warns
    about nothing; nor do the plans remat makes for budgets it derived itself
    (:func:`derived_budgets`: a simulated rank's translated budget, a pipeline chunk's
    share of its rank's), whose callers count the optimizer state their own way.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import CheckpointError

from remat.blocks import BlocksSpec
from remat.core.budget import Budget, BudgetLike
from remat.core.shapes import check_on_new_shape
from remat.devices import DeviceSpec
from remat.errors import (
    BudgetTooSmall,
    RematError,
    RematWarning,
    current_call,
    message,
    names_the_call,
    one_line,
)
from remat.measure.shapes import batch_envelope
from remat.measure.step import (
    LossFn,
    Step,
    is_accumulating,
    model_device,
    step_loss,
    warn_zeroed_gradients,
)
from remat.planning.card import card_of
from remat.planning.context import PlanContext, check_plannable, prepare_step, resolve_cost
from remat.planning.fingerprint import fingerprint_of
from remat.planning.head import cheaper_with_head, plan_with_head
from remat.planning.loop import close_loop
from remat.planning.options import PlanOptions
from remat.planning.plans import Plan
from remat.planning.shapes import plan_shapes
from remat.planning.throughput import ThroughputSearch, search_throughput
from remat.strategies import apply
from remat.strategies.guard import set_replanner


@names_the_call("remat.plan")
def plan(
    model: nn.Module,
    batch: Any,
    *,
    budget: BudgetLike | Budget,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    blocks: BlocksSpec = None,
    simulate: bool = False,
    device: str | DeviceSpec | None = None,
    cost: str = "auto",
    context: PlanContext | None = None,
    microbatches_in_flight: int = 1,
    shapes: Sequence[Any] = (),
    accumulating: bool = False,
) -> Plan:
    """The cheapest checkpointing plan whose measured peak fits ``budget``.

    Each block gets one decision: keep everything, checkpoint it, checkpoint only its
    attention or MLP, keep only the outputs of chosen ops (op-level selective
    checkpointing), or offload (GPU only). Candidates are measured per kind of block,
    a peak model predicts the step's peak for any combination, an integer program picks
    the combination with the least recompute cost that fits (measured time on a GPU,
    roofline time on ``device`` elsewhere; see ``cost``), and the choice is measured on
    the model and tightened until it fits (see
    NOTE [ How a plan is made ]). The model is left as it was; apply the plan with
    ``remat.apply(model, plan)``, or use :func:`auto`. To search the batch size too, see
    :func:`plan_throughput`; to plan a step that runs under ``torch.compile``,
    :func:`remat.compiled.plan.plan_compiled` (``remat.plan_compiled``).

    Warning:
        With ``simulate=False`` the closed loop runs real training steps (parameters,
        gradients, optimizer state and RNG are restored afterwards).

    Args:
        model: the model, in train mode.
        batch: a batch as :func:`remat.profile` takes it.
        budget: the whole step's peak: bytes (int), ``"12GiB"`` / ``"800MB"``, or
            ``"60%"`` of the un-checkpointed step's peak. A budget above the
            un-checkpointed peak gives the empty plan. ``"device"``: the card itself (the
            GPU the model is on, or ``device=``): its capacity less what lives outside
            PyTorch's allocator, on the step's predicted reserved peak with the library
            workspaces (``plan.reserved_peak_bytes``; NOTE [ Fits on the card ]).
        loss_fn: ``loss_fn(output, batch) -> scalar``. Default: ``output.loss``, else a mean.
        optimizer: stepped in the measured step; its state counts toward the peak.
            Default: ``None``.
        blocks: which modules are blocks (class, classes or predicate). Default: found.
        simulate: measure the closed loop under FakeTensorMode instead of for real.
            Default: ``False``.
        device: the device costs are computed for. Default: the model's GPU when remat
            knows it, else ``"h100-80gb"``.
        cost: what the solver minimizes. ``"measured"``: each candidate's extra
            forward+backward time, timed on the model's device (NOTE [ Measured cost ]
            in timed.py; costs a few block runs per candidate); ``"roofline"``: the
            roofline time of the recomputed ops on ``device`` (exact, instant, ignores
            kernel efficiency); ``"auto"``: measured on CUDA unless ``simulate``,
            roofline elsewhere (CPU wall time is too noisy to plan with).
            Default: ``"auto"``.
        context: a :func:`prepare` result for this model and batch, to plan several
            budgets without measuring again. Default: measured now.
        microbatches_in_flight: for a pipeline stage, the micro-batches its schedule
            holds at once (``batch`` is one micro-batch): the peak model and the measured
            step hold that many forwards' saved tensors before the first backward (NOTE
            [ Micro-batches in flight ] in planning/in_flight.py; pass
            ``loss_fn=remat.distributed.stage_loss.StageLoss()`` for a stage whose output is a
            hidden state). Default: 1.
        shapes: more batches the plan must fit, for a loader whose shapes vary (padded
            to each batch's longest, bucketed by length, a curriculum): the largest of
            ``batch`` and these (the most elements) is planned, and every other one's
            first step is run with the plan on the allocator; one over the budget
            tightens the plan until all fit (NOTE [ Planning for several shapes ] in
            planning/shapes.py). Only shapes count for the guard: one batch per shape is
            enough, and a packed batch of a given shape is inside it. A padded one can
            run another attention path than an all-ones mask (NOTE [ A batch without
            padding ] in planning/shapes.py): when the loader pads, plan with a padded
            batch or pass one here. ``budget="60%"`` is of the largest batch's peak.
            Default: none (``batch`` only).
        accumulating: plan for gradient accumulation (the optimizer stepped, and
            ``zero_grad`` called, every few micro-batches): every micro-step after the
            first starts with the gradients of the ones before it held, up to the
            gradients' bytes above a step that starts without them, and the plan must fit
            that step (:class:`~remat.measure.step.Accumulating`); a loop that zeroes
            gradients in place (``zero_grad(set_to_none=False)``) holds them the same way.
            ``budget="60%"`` is then of that step's un-checkpointed peak. Default:
            ``False`` (each step starts without gradients, ``zero_grad`` every step).

    Returns:
        A :class:`~remat.Plan` with ``measured_peak_bytes <= budget_bytes`` (the tracked
        step) and, when the step runs for real, ``allocator_peak_bytes <= budget_bytes``
        (the device's allocator: NOTE [ Fits on the allocator ] in planning/loop.py).
        ``plan.shape_envelope`` records the shapes it was made for (``batch``'s and
        ``shapes``'); ``remat.apply`` checks each training batch against them (NOTE
        [ Shape guard ] in strategies/guard.py).

    Raises:
        BudgetTooSmall: no plan fits; the message gives the smallest reachable peak and
            what dominates it.
        ValueError: an unreadable budget, a model in eval mode, a bad ``cost``,
            ``cost="measured"`` with ``simulate=True``, or ``context`` with ``shapes``.

    Example:
        >>> from remat.models import build_model, make_batch
        >>> model = build_model("gpt-small")
        >>> plan = remat.plan(model, make_batch(model, 8), budget="60%")
        >>> plan.measured_peak_bytes <= plan.budget_bytes
        True
        >>> remat.apply(model, plan)
        >>> plan = remat.plan(model, make_batch(model, 8, seq_len=1024), budget="8GiB",
        ...                   shapes=[make_batch(model, 8, seq_len=n) for n in (256, 512)])
    """
    options = PlanOptions(budget=budget, simulate=simulate,  # type: ignore[arg-type]
                          device=device, cost=cost)
    if callable(batch) and not isinstance(batch, (Tensor, Mapping, tuple, list)):
        raise TypeError(message("remat.plan", "batch is a function",
                                fix="pass a batch, or call remat.plan_throughput(model, "
                                    "make_batch, ...) to search batch sizes"))
    api = current_call("remat.plan")  # remat.auto's own name where it is the call
    _warn_about_the_job(model, options.budget, optimizer, accumulating, api=api)
    step = Step(model, batch,
                loss_fn=step_loss(loss_fn, accumulating=accumulating, api=api),
                optimizer=optimizer, blocks=blocks,
                microbatches_in_flight=microbatches_in_flight)
    if len(shapes) > 0:
        if context is not None:
            raise ValueError(message("remat.plan", "context= and shapes= do not go together",
                                     {"why": "the context is measured at one batch; shapes= "
                                             "plans at the largest of several"},
                                     fix="drop context="))
        return plan_shapes(step, list(shapes), options, plan_step)
    return plan_step(step, options, context=context)


@names_the_call("remat.plan_throughput")
def plan_throughput(
    model: nn.Module,
    make_batch: Callable[[int], Any],
    *,
    budget: BudgetLike | Budget,
    search: ThroughputSearch | None = None,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    blocks: BlocksSpec = None,
    simulate: bool = False,
    device: str | DeviceSpec | None = None,
    cost: str = "auto",
    accumulating: bool = False,
) -> Plan:
    """The plan and batch size with the most samples per second whose peak fits ``budget``.

    Batch sizes 1, 2, 4, ... are planned with :func:`plan` until none fits, then the
    largest fitting size is refined by bisection (NOTE [ Throughput search ]); each
    size's best plan gets a step time, and the fastest per sample wins. A larger batch
    amortizes fixed costs but needs more checkpointing to fit, so the best size is
    usually below the largest that fits. Train with ``plan.batch_size`` samples.

    Args:
        model: the model, in train mode.
        make_batch: ``n -> batch`` of n samples.
        budget: the whole step's peak: bytes, ``"12GiB"``, or ``"60%"`` of the
            un-checkpointed peak at ``search.batch_size``.
        search: the batch sizes to search (:class:`ThroughputSearch`).
            Default: ``ThroughputSearch()`` (percentages of batch 8, sizes up to 1024).
        loss_fn, optimizer, blocks, simulate, device, cost, accumulating: as for
            :func:`plan`.

    Returns:
        The fastest plan per sample, with ``plan.batch_size`` set and the table of every
        size tried in ``plan.throughput``.

    Raises:
        BudgetTooSmall: not even batch size 1 fits.
        TypeError: ``make_batch`` is not a function.

    Example:
        >>> plan = remat.plan_throughput(model, lambda n: make_batch(model, n),
        ...                              budget="60%", search=ThroughputSearch(batch_size=8))
        >>> plan.batch_size, plan.throughput[-1].fits
    """
    if not callable(make_batch) or isinstance(make_batch, (Tensor, Mapping, tuple, list)):
        raise TypeError(message("remat.plan_throughput",
                                "make_batch must be a function n -> batch of n samples",
                                {"found": type(make_batch).__name__},
                                fix="pass e.g. make_batch=lambda n: make_batch(model, n)"))
    options = PlanOptions(budget=budget, simulate=simulate,  # type: ignore[arg-type]
                          device=device, cost=cost)
    _warn_about_the_job(model, options.budget, optimizer, accumulating,
                        api="remat.plan_throughput")
    loss_fn = step_loss(loss_fn, accumulating=accumulating, api="remat.plan_throughput")
    step = Step(model, make_batch, loss_fn=loss_fn, optimizer=optimizer, blocks=blocks)
    return search_throughput(step, make_batch, options, search or ThroughputSearch(), plan_step)


_DERIVED: ContextVar[bool] = ContextVar("remat_derived_budgets", default=False)


@contextmanager
def derived_budgets() -> Iterator[None]:
    """Plans made inside are for budgets remat derived, not the user's: they do not warn
    about a missing optimizer (NOTE [ A byte budget without an optimizer ]).

    Example:
        >>> with derived_budgets():
        ...     plan(model, batch, budget=rank_budget_bytes)  # no optimizer warning
    """
    token = _DERIVED.set(True)
    try:
        yield
    finally:
        _DERIVED.reset(token)


def _warn_about_the_job(model: nn.Module, budget: Budget,
                        optimizer: torch.optim.Optimizer | None, accumulating: bool, *,
                        api: str) -> None:
    """What the training job holds that the plan would not count: gradients zeroed in
    place (:func:`~remat.measure.step.warn_zeroed_gradients`), and optimizer state under a
    byte budget (NOTE [ A byte budget without an optimizer ])."""
    warn_zeroed_gradients(model, accumulating=accumulating, api=api, stacklevel=5)
    if optimizer is not None or budget.fraction is not None or _DERIVED.get():
        return
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if trainable == 0:
        return
    warnings.warn(message(
        api, f"a budget of {budget} and no optimizer",
        {"why": "the plan counts no optimizer state, which the training job holds from its "
                "first optimizer step on",
         "AdamW would add": f"{2 * trainable:,} B (two moments of {trainable:,} B of "
                            "trainable parameters)"},
        fix="pass the optimizer you train with (optimizer=...; CLI --optimizer), or a "
            "percent budget"), RematWarning, stacklevel=4)


def plan_step(step: Step, options: PlanOptions, *, context: PlanContext | None = None) -> Plan:
    """:func:`plan` for a resolved :class:`~remat.measure.step.Step` and
    :class:`PlanOptions`."""
    source = resolve_cost(options.cost, step.model, simulate=options.simulate)
    if not options.simulate and model_device(step.model).type == "meta":
        raise ValueError(message(
            "remat.plan", "the model is on the meta device",
            {"why": "its steps cannot run for real"},
            fix="pass simulate=True to plan it on fake tensors"))
    # the card before the measurements: budget="device" without one fails at once
    card = card_of(step, options) if options.budget.is_device else None
    if context is None:
        context = prepare_step(step, device=options.device, cost=source,
                               stand_in=not options.simulate)
    else:
        check_plannable(step.model)
        if context.microbatches_in_flight != step.microbatches_in_flight:
            raise ValueError(message(
                "remat.plan", "the context was prepared for another number of micro-batches "
                "in flight", {"context": context.microbatches_in_flight,
                              "asked": step.microbatches_in_flight},
                fix="prepare the context with the same microbatches_in_flight"))
    budget_bytes = options.budget.resolve(
        context.no_checkpoint_peak_bytes, static_bytes=context.static_bytes,
        device_limit_bytes=card.limit_bytes if card is not None else None)
    try:
        try:
            plan = close_loop(step, context, budget_bytes, simulate=options.simulate,
                              budget=options.budget, card=card)
            plan = cheaper_with_head(step, context, budget_bytes, plan,
                                     simulate=options.simulate, budget=options.budget, card=card)
        except BudgetTooSmall as error:  # a chunked output head may still fit it
            plan = plan_with_head(step, context, budget_bytes, simulate=options.simulate,
                                  budget=options.budget, error=error, card=card)
    except CheckpointError as error:
        raise RematError(message(
            "remat.plan", "a checkpointed block recomputed other tensors than its forward "
            "saved, so the plan's steps cannot run",
            {"likely": "a module that changes itself on its first call (converts its weights "
                       "with module.to(dtype), builds a cache), inside a checkpointed block",
             "error": one_line(str(error))[:300]},
            fix="run one training step before planning (the module is then as it stays), or "
                "pass blocks= leaving that module out")) from error
    # What the plan is for, so remat.apply refuses another model (NOTE [ Plan fingerprint ])
    # and a batch of other shapes (NOTE [ Shape guard ]).
    return replace(plan, fingerprint=fingerprint_of(step.model, plan.block_names),
                   shape_envelope=batch_envelope(step.model, step.batch),
                   accumulating=is_accumulating(step.loss_fn))


@names_the_call("remat.auto")
def auto(model: nn.Module, batch: Any, *, on_new_shape: str = "error", **kwargs: Any) -> Plan:
    """Plan (see :func:`plan`, same arguments), apply the plan to ``model``, and return it.

    The returned plan's ``measured_peak_bytes`` is the peak of a step of ``model`` with
    the plan applied (real, or simulated with ``simulate=True``), and never exceeds the
    budget.

    Args:
        model, batch, kwargs: as for :func:`plan`.
        on_new_shape: what a training batch outside the plan's shapes does (``"error"``,
            ``"warn"``, ``"replan"``, ``"off"``: :func:`remat.apply`); recorded in the
            returned plan (``plan.on_new_shape``, kept in its file). ``"replan"`` plans
            with this call's arguments (optimizer, loss, blocks, ...) and the plan's
            budget in bytes. Default: ``"error"``.

    Example:
        >>> plan = remat.auto(model, batch, budget="8GiB", on_new_shape="replan")
        >>> plan.measured_peak_bytes <= plan.budget_bytes
        True
    """
    check_on_new_shape(on_new_shape, api="remat.auto")
    result = replace(plan(model, batch, **kwargs), on_new_shape=on_new_shape)
    replan_with = {k: v for k, v in kwargs.items() if k not in ("budget", "context", "shapes")}
    apply(model, result, replan_with=replan_with)  # result.blocks finds the decided modules
    return result


def replan(model: nn.Module, batch: Any, applied: Plan, options: Mapping[str, Any]) -> Plan:
    """The shape guard's replan (NOTE [ Replanning from the guard ] in strategies/guard.py):
    :func:`plan` for ``batch`` with ``applied``'s budget in bytes and cost device, the
    keyword arguments ``options`` (``blocks``, and ``remat.auto``'s or ``remat.apply``'s
    ``replan_with``); the plan keeps ``applied``'s ``on_new_shape``, and plans the step
    ``applied`` was made for (a gradient-accumulation micro-step where it was)."""
    kwargs = {"device": applied.cost_device, "accumulating": applied.accumulating,
              **{k: v for k, v in options.items() if k not in ("budget", "context", "shapes")}}
    with derived_budgets():  # the applied plan's budget: its own call warned, if at all
        result = plan(model, batch, budget=applied.budget_bytes, **kwargs)
    return replace(result, on_new_shape=applied.on_new_shape)


set_replanner(replan)  # NOTE [ Replanning from the guard ]
