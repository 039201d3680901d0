"""``remat.plan`` and ``remat.auto``: the cheapest checkpointing whose measured peak fits a budget.

NOTE [ How a plan is made ]
    1. Copy the model, batch and optimizer as fake tensors (nothing is computed or
       allocated, the user's model is untouched; see ``_sim.py``).
    2. Measure every candidate of every kind of block (candidates.py) and one
       whole step without checkpointing, cut into memory windows. With measured
       costs, time every candidate on the real model (timed.py).
    3. Calibrate the peak model (peak.py) and solve for the cheapest choice whose
       predicted peak fits (solver.py).
    4. Closed loop: apply the choice to the model, measure the step with
       :func:`remat.measure.profile` (real, or simulated with ``simulate=True``),
       and if the measured peak is over budget, tighten the solver's budget by the
       overshoot and solve again. The returned plan's measured peak never exceeds
       the budget; when no plan fits, :class:`~remat.errors.BudgetTooSmall` says
       what the smallest reachable peak is and what fills it.

NOTE [ Throughput search ]
    With ``maximize="throughput"`` the batch is a function ``n -> batch``. Batch
    sizes 1, 2, 4, ... are planned until none fits the budget (or
    ``max_batch_size``), then the largest fitting size is refined by bisection.
    Each size's best plan gets a step time, predicted (cost.py, NOTE [ Step-time
    model ]) or, with measured costs, timed on the device, and samples per second;
    the plan with the most samples per second wins and carries the whole table in
    ``plan.throughput``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from remat.blocks import BlocksSpec
from remat.devices import DeviceSpec
from remat.errors import message
from remat.measure.step import LossFn, Step, model_device
from remat.planning.budget import Budget, BudgetLike
from remat.planning.compiled_candidates import CompiledContext
from remat.planning.compiled_plan import plan_compiled
from remat.planning.context import PlanContext, check_plannable, prepare_step, resolve_cost
from remat.planning.fingerprint import fingerprint_of
from remat.planning.loop import close_loop
from remat.planning.options import PlanOptions
from remat.planning.plans import Plan
from remat.planning.throughput import search_throughput
from remat.strategies import apply

__all__ = ["auto", "plan", "plan_step"]


def plan(
    model: nn.Module,
    batch: Any,
    *,
    budget: BudgetLike | Budget,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    blocks: BlocksSpec = None,
    simulate: bool = False,
    maximize: str | None = None,
    device: str | DeviceSpec | None = None,
    context: PlanContext | CompiledContext | None = None,
    batch_size: int = 8,
    max_batch_size: int = 1024,
    cost: str = "auto",
    compile: bool = False,
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
    ``remat.apply(model, plan)``, or use :func:`auto`.

    Warning:
        With ``simulate=False`` the closed loop runs real training steps (parameters,
        gradients, optimizer state and RNG are restored afterwards).

    Args:
        model: the model, in train mode.
        batch: a batch as :func:`remat.profile` takes it; with ``maximize="throughput"``
            a function ``n -> batch`` of n samples.
        budget: the whole step's peak: bytes (int), ``"12GiB"`` / ``"800MB"``, or
            ``"60%"`` of the un-checkpointed step's peak (with ``maximize``: of the peak
            at ``batch_size``). A budget above the un-checkpointed peak gives the empty plan.
        loss_fn: ``loss_fn(output, batch) -> scalar``. Default: ``output.loss``, else a mean.
        optimizer: stepped in the measured step; its state counts toward the peak.
            Default: ``None``.
        blocks: which modules are blocks (class, classes or predicate). Default: found.
        simulate: measure the closed loop under FakeTensorMode instead of for real.
            Default: ``False``.
        maximize: ``"throughput"``: search the batch size with the most samples per
            second under the budget (NOTE [ Throughput search ]). Default: ``None``.
        device: the device costs are computed for. Default: the model's GPU when remat
            knows it, else ``"h100-80gb"``.
        context: a :func:`prepare` result for this model and batch, to plan several
            budgets without measuring again (with ``compile=True``: a
            ``remat.planning.compiled_candidates.prepare_compiled`` result). Default:
            measured now.
        batch_size: with ``maximize``, the batch size percentages refer to. Default: 8.
        max_batch_size: with ``maximize``, the largest batch size tried. Default: 1024.
        cost: what the solver minimizes. ``"measured"``: each candidate's extra
            forward+backward time, timed on the model's device (NOTE [ Measured cost ]
            in timed.py; costs a few block runs per candidate); ``"roofline"``: the
            roofline time of the recomputed ops on ``device`` (exact, instant, ignores
            kernel efficiency); ``"auto"``: measured on CUDA unless ``simulate``,
            roofline elsewhere (CPU wall time is too noisy to plan with).
            Default: ``"auto"``.
        compile: plan the step as it will run with every block ``torch.compile``-d:
            candidates include the compiler's own activation memory budgets besides
            remat's checkpoints, the closed loop measures the compiled step's allocator
            peak, and ``remat.apply(model, plan)`` compiles the blocks as the plan
            records (``plan.compiled``). Percentages refer to the compiled step without
            remat. Not with ``simulate`` or ``maximize``. Default: ``False``.

    Returns:
        A :class:`~remat.Plan` with ``measured_peak_bytes <= budget_bytes``.

    Raises:
        BudgetTooSmall: no plan fits; the message gives the smallest reachable peak and
            what dominates it.
        ValueError: an unreadable budget, a model in eval mode, a bad ``maximize`` or
            ``cost``, or ``cost="measured"`` with ``simulate=True``.

    Example:
        >>> from remat.models import build_model, make_batch
        >>> model = build_model("gpt-small")
        >>> plan = remat.plan(model, make_batch(model, 8), budget="60%")
        >>> plan.measured_peak_bytes <= plan.budget_bytes
        True
        >>> remat.apply(model, plan)
    """
    options = PlanOptions(budget=budget, simulate=simulate, maximize=maximize,  # type: ignore[arg-type]
                          device=device, batch_size=batch_size, max_batch_size=max_batch_size,
                          cost=cost, compile=compile)
    if maximize is not None and not callable(batch):
        raise TypeError(message(
            "remat.plan", "maximize='throughput' needs batch to be a function n -> batch",
            {"found": type(batch).__name__},
            fix="pass a function of n samples, e.g. batch=lambda n: make_batch(model, n)"))
    if maximize is None and callable(batch) and \
            not isinstance(batch, (Tensor, Mapping, tuple, list)):
        raise TypeError(message("remat.plan", "batch is a function",
                                fix="pass maximize='throughput' to search batch sizes, or "
                                    "pass a batch"))
    step = Step(model, batch, loss_fn=loss_fn, optimizer=optimizer, blocks=blocks)
    return plan_step(step, options, context=context)


def plan_step(step: Step, options: PlanOptions, *,
              context: PlanContext | CompiledContext | None = None) -> Plan:
    """:func:`plan` for a resolved :class:`~remat.measure.step.Step` and :class:`PlanOptions`
    (with ``maximize``, ``step.batch`` is the function ``n -> batch``)."""
    if options.compile:
        return plan_compiled(step, options, context=context
                             if isinstance(context, CompiledContext) else None)
    if isinstance(context, CompiledContext):
        raise ValueError(message("remat.plan", "a compiled context (prepare_compiled) needs "
                                 "compile=True", fix="pass compile=True, or another context"))
    source = resolve_cost(options.cost, step.model, simulate=options.simulate)
    if options.maximize is not None:
        make_batch = step.batch
        return search_throughput(step, make_batch, options, _plan_one)
    if not options.simulate and model_device(step.model).type == "meta":
        raise ValueError(message(
            "remat.plan", "the model is on the meta device",
            {"why": "its steps cannot run for real"},
            fix="pass simulate=True to plan it on fake tensors"))
    if context is None:
        context = prepare_step(step, device=options.device, cost=source)
    else:
        check_plannable(step.model)
    budget_bytes = options.budget.resolve(context.no_checkpoint_peak_bytes)
    plan = close_loop(step, context, budget_bytes, simulate=options.simulate)
    # What the plan is for, so remat.apply refuses another model (NOTE [ Plan fingerprint ]).
    return replace(plan, fingerprint=fingerprint_of(step.model, plan.block_names))


def _plan_one(step: Step, options: PlanOptions) -> Plan:
    return plan_step(step, options)


def auto(model: nn.Module, batch: Any, **kwargs: Any) -> Plan:
    """Plan (see :func:`plan`, same arguments), apply the plan to ``model``, and return it.

    The returned plan's ``measured_peak_bytes`` is the peak of a step of ``model`` with
    the plan applied (real, or simulated with ``simulate=True``), and never exceeds the
    budget. With ``maximize="throughput"``, train with ``plan.batch_size`` samples.

    Example:
        >>> plan = remat.auto(model, batch, budget="8GiB")
        >>> plan.measured_peak_bytes <= plan.budget_bytes
        True
    """
    result = plan(model, batch, **kwargs)
    apply(model, result)  # result.blocks finds the decided modules
    return result
