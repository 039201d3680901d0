"""``remat.plan_compiled``: plan the step as it will run under ``torch.compile``.

NOTE [ Predicting a compiled mixture ]
    Every candidate is measured with all blocks at it (NOTE [ Compiled candidates ]
    in candidates.py). For a mixture (block ``i`` at candidate ``c_i``) the
    predicted peak is::

        static + sum_i saved[c_i][i] + max_i transient[c_i]

    the bytes alive at the step's start, what every block's compiled forward saved
    (all alive when backward starts), and the largest backward transient among the
    candidates used. It is exact for the uniform assignments by construction. The
    mixtures considered are uniform ones and two-candidate splits (the first ``k``
    blocks at one candidate, the rest at another): ``K^2 L`` of them, not ``K^L``.

NOTE [ Compiled closed loop ]
    Assignments are ordered by (recompute cost, -predicted peak, assignment), a fixed
    total order, and those predicted over budget are skipped. Among equal recompute
    FLOPs the one keeping the most bytes comes first: FLOPs count matmuls, not the
    pointwise ops a lower compiler budget or a SAC set recomputes, so keeping more is
    the faster guess (with the whole budget, the compiler's default ``none@1``); the first one whose
    *measured* compiled peak (allocator, :func:`~remat.compiled.measure.measure_compiled`)
    fits is the plan. More budget only adds assignments to the front of the search,
    so it never gives a costlier plan: the plan found for a smaller budget is still
    found, or a cheaper one before it. At most ``max_trials`` new steps are measured;
    when none fits, :class:`~remat.errors.BudgetTooSmall` gives the lowest peak measured.

NOTE [ Whole-model options ]
    Compiling the whole model at one activation memory budget lets the partitioner
    trade across blocks, which per-block budgets cannot: at the peak of its own 0.75
    setting, the whole-model compile recomputes nothing where the best per-block mix
    recomputes ~1%. So the compiler's own settings (``CompiledContext.whole_budgets``)
    are plans too: each is measured when first needed (one compiled step), in order,
    until one fits; it becomes the plan when its recompute FLOPs are at most the
    per-block plan's (``Plan.compiled == {"": budget}``). The user then gets whichever
    of the two is cheaper, and never a plan that recomputes more than the compiler's
    first setting that fits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from remat.blocks import BlocksSpec
from remat.compiled.candidates import (
    CompiledCandidate,
    CompiledContext,
    dtype_bytes,
    measure_assignment,
    measure_whole,
    prepare_compiled,
)
from remat.compiled.install import WHOLE_MODEL
from remat.core.budget import Budget, BudgetLike
from remat.core.cost import Category, StepCost
from remat.devices import DeviceSpec
from remat.errors import BudgetTooSmall, message, names_the_call
from remat.measure.step import LossFn, Step, model_device
from remat.planning.context import check_plannable
from remat.planning.options import PlanOptions
from remat.planning.plans import Plan
from remat.planning.recompute_cost import cost_device
from remat.units import format_bytes

_API = "remat.plan_compiled"
Assignment = tuple[int, ...]


def predict_peak(ctx: CompiledContext, assignment: Sequence[int]) -> int:
    """The peak of ``assignment`` by NOTE [ Predicting a compiled mixture ]."""
    saved = sum(ctx.saved[c][i] for i, c in enumerate(assignment))
    return ctx.static_bytes + saved + max(ctx.transient[c] for c in set(assignment))


def _assignments(blocks: int, kinds: int) -> Iterator[Assignment]:
    for a in range(kinds):
        yield (a,) * blocks
        for b in range(kinds):
            if b != a:
                for k in range(1, blocks):
                    yield (a,) * k + (b,) * (blocks - k)


def _ranked(ctx: CompiledContext, ms_per_flop: float) -> list[tuple[float, int, Assignment]]:
    rows = []
    for assignment in _assignments(len(ctx.names), len(ctx.candidates)):
        flops = sum(ctx.recompute_flops[c][i] for i, c in enumerate(assignment))
        rows.append((flops * ms_per_flop, predict_peak(ctx, assignment), assignment))
    rows.sort(key=lambda row: (row[0], -row[1], row[2]))  # NOTE [ Compiled closed loop ]
    return rows


@names_the_call(_API)
def plan_compiled(
    model: nn.Module,
    batch: Any,
    *,
    budget: BudgetLike | Budget,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    blocks: BlocksSpec = None,
    device: str | DeviceSpec | None = None,
    context: CompiledContext | None = None,
) -> Plan:
    """The cheapest plan for the step as it runs with every block ``torch.compile``-d.

    Candidates are the compiler's own activation memory budgets (1.0 / 0.75 / 0.5 / 0.25
    / 0.0) beside remat's checkpoints compiled at 1.0; each is one whole compiled step,
    measured at the allocator on real tensors (compiled code is never simulated). The
    closed loop measures the compiled step's peak (NOTE [ Compiled closed loop ]), and
    ``remat.apply(model, plan)`` compiles the blocks as the plan records
    (``plan.compiled``). Costs one compile per candidate; plan several budgets from one
    ``context``.

    Args:
        model: the model, in train mode, on a real device (not meta).
        batch: a batch as :func:`remat.profile` takes it.
        budget: the compiled step's peak: bytes, ``"12GiB"``, or ``"60%"`` of the compiled
            step without remat at compiler budget 1.0.
        loss_fn, optimizer, blocks, device: as for :func:`remat.plan`.
        context: a :func:`~remat.compiled.candidates.prepare_compiled` result for this
            model and batch, to plan several budgets with one set of measurements.
            Default: measured now.

    Returns:
        A :class:`~remat.Plan` with ``compiled`` set and ``measured_peak_bytes <=
        budget_bytes``.

    Raises:
        BudgetTooSmall: no assignment's measured compiled peak fits.
        ValueError: a model on the meta device.

    Example:
        >>> plan = remat.plan_compiled(model, batch, budget="70%")
        >>> remat.apply(model, plan)  # compiles each block at its recorded budget
    """
    step = Step(model, batch, loss_fn=loss_fn, optimizer=optimizer, blocks=blocks)
    options = PlanOptions(budget=budget, device=device)  # type: ignore[arg-type]
    return plan_compiled_step(step, options, context=context)


def plan_compiled_step(step: Step, options: PlanOptions, *,
                       context: CompiledContext | None = None,
                       candidates: Sequence[CompiledCandidate] | None = None,
                       max_trials: int = 8) -> Plan:
    """:func:`plan_compiled` for a resolved step and options.

    See NOTE [ Compiled closed loop ]. ``options.budget`` as a percentage refers to the
    compiled step without remat at compiler budget 1.0.

    Args:
        step: the step (real tensors: compiled code is measured, never simulated).
        options: the budget and cost device (``simulate`` refused).
        context: a :func:`~remat.compiled.candidates.prepare_compiled` result,
            to plan several budgets with one set of measurements. Default: measured now.
        candidates: the candidates to measure when ``context`` is not given.
            Default: :func:`~remat.compiled.candidates.default_candidates`.
        max_trials: new compiled steps measured at most in the closed loop. Default: 8.

    Raises:
        BudgetTooSmall: no assignment's measured peak fits.
        ValueError: ``simulate=True``, or a model on the meta device.
    """
    if options.simulate:
        raise ValueError(message(_API, "simulate=True is not supported",
                                 {"why": "compiled plans are measured for real"},
                                 fix="plan eager steps with remat.plan(..., simulate=True), or "
                                     "drop simulate="))
    if model_device(step.model).type == "meta":
        raise ValueError(message(_API, "the model is on the meta device",
                                 {"why": "compiled steps must run"},
                                 fix="materialize the model on a real device first"))
    check_plannable(step.model)
    ctx = context if context is not None else prepare_compiled(step, candidates)
    budget = options.budget.resolve(ctx.no_checkpoint_peak_bytes, static_bytes=ctx.static_bytes)
    device = cost_device(model_device(step.model), options.device)
    ms_per_flop = 1e3 / device.flops_per_s(dtype_bytes(step))
    trials = 0
    found: Plan | None = None
    for cost_ms, predicted, assignment in _ranked(ctx, ms_per_flop):
        if predicted > budget:
            continue
        peak = ctx.measured.get(assignment)
        if peak is None:
            if trials >= max_trials:
                break
            trials += 1
            peak = measure_assignment(step, ctx.names, ctx.candidates, assignment,
                                      ctx.backends).peak_bytes
            ctx.measured[assignment] = peak
        if peak <= budget:
            found = _plan(step, ctx, assignment, budget, predicted, peak, cost_ms,
                          device.name)
            break
    whole = _whole_model(step, ctx, budget, ms_per_flop, device.name)
    if whole is not None and (found is None or whole.recompute_flops <= found.recompute_flops):
        return whole
    if found is not None:
        return found
    tried = {_label(ctx, a): peak for a, peak in ctx.measured.items()}
    tried.update({f"the whole model compiled at {b:g}": m.peak_bytes
                  for b, m in ctx.whole.items()})
    best = min(tried, key=lambda label: tried[label])
    lowest = tried[best]
    # NOTE [ Categories of each backend ] in remat/core/cost.py: the static bytes by
    # category (the same in every measurement), the step's own bytes unsplit.
    breakdown: dict[Category, int] = {
        c: v for c, v in ctx.uniform[0].profile.peak_breakdown.items()
        if c != Category.STEP_TEMPORARIES}
    before = sum(breakdown.values())
    if lowest > before:
        breakdown[Category.STEP_TEMPORARIES] = lowest - before
    raise BudgetTooSmall(
        message(_API, f"no compiled plan fits {format_bytes(budget)}",
                {"budget": format_bytes(budget),
                 "lowest compiled peak measured": f"{format_bytes(lowest)} ({best})",
                 "alive before the step": f"{format_bytes(before)} (parameters, "
                                          "optimizer state, batch)"},
                fix="raise the budget or shrink the batch"),
        budget_bytes=budget, min_peak_bytes=lowest,
        breakdown=breakdown,
    )


def _whole_model(step: Step, ctx: CompiledContext, budget: int, ms_per_flop: float,
                 device_name: str) -> Plan | None:
    """The first of the compiler's own settings that fits (NOTE [ Whole-model options ])."""
    for setting in ctx.whole_budgets:
        m = ctx.whole.get(setting)
        if m is None:
            m = ctx.whole[setting] = measure_whole(step, ctx.names, setting)
        if m.peak_bytes <= budget:
            none = ctx.candidates[0].decision
            decisions = dict.fromkeys(ctx.names, none)
            flops = int(m.profile.recompute_flops)
            return Plan(
                decisions=decisions, block_names=ctx.names, budget_bytes=budget,
                cost=StepCost(peak_bytes=m.peak_bytes, recompute_flops=flops,
                              recompute_ms=flops * ms_per_flop),
                measured_peak_bytes=m.peak_bytes,
                no_checkpoint_peak_bytes=ctx.no_checkpoint_peak_bytes,
                cost_device=device_name, cost_source="roofline",
                blocks=step.blocks,
                compiled={WHOLE_MODEL: setting})
    return None


def _label(ctx: CompiledContext, assignment: Assignment) -> str:
    labels = [ctx.candidates[c].label() for c in assignment]
    return ", ".join(f"{labels.count(x)} {x}" for x in dict.fromkeys(labels))


def _plan(step: Step, ctx: CompiledContext, assignment: Assignment, budget: int,
          predicted: int, peak: int, cost_ms: float, device_name: str) -> Plan:
    decisions = {n: ctx.candidates[c].decision for n, c in zip(ctx.names, assignment,
                                                              strict=True)}
    return Plan(
        decisions=decisions,
        block_names=ctx.names,
        budget_bytes=budget,
        cost=StepCost(peak_bytes=predicted,
                      recompute_flops=sum(ctx.recompute_flops[c][i]
                                          for i, c in enumerate(assignment)),
                      recompute_ms=cost_ms),
        measured_peak_bytes=peak,
        no_checkpoint_peak_bytes=ctx.no_checkpoint_peak_bytes,
        cost_device=device_name,
        cost_source="roofline",
        blocks=step.blocks,
        compiled={n: ctx.candidates[c].compiler_budget
                  for n, c in zip(ctx.names, assignment, strict=True)},
    )
