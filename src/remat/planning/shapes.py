"""A plan for every shape a loader yields: plan the largest batch, prove the others.

NOTE [ Planning for several shapes ]
    ``remat.plan(model, batch, shapes=[...])`` makes one plan that fits every batch given.
    The largest batch (the most elements across its tensor inputs: the longest, widest
    one) is planned as a single batch is (a ``"60%"`` budget is of its peak). Then the
    plan is applied and every other batch runs its first steps on the allocator, as a job
    starts and as a resumed job starts, then a steady step (NOTE [ The first step ] in
    measure/profile.py; with ``simulate=True``, a tracked step on fake tensors): its peak
    is that batch's proof. A smaller batch can still peak higher: a mixture of experts
    routes each batch its own way, an input the largest batch lacks (an attention mask)
    runs another attention kernel. The batch most over the budget is then the one to plan
    for, with the same budget in bytes, and every other batch (the largest included) is
    proven again; where the batch most over the budget was planned for before, the plan
    is made again with a budget lower by that overshoot, the closed loop's rule (NOTE
    [ Closed loop ] in remat/core/loop.py). Each batch planned for is measured once (its
    context kept); ``_ROUNDS`` plans at most. The plan keeps the budget asked for, the
    measured peaks of the batch it was made at, and a shape envelope of every batch (NOTE
    [ Shape envelope ] in remat/core/shapes.py), which ``remat.apply``'s guard checks
    training batches against.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from remat.core.shapes import shapes_label
from remat.errors import BudgetTooSmall, current_call, message
from remat.measure.profile import start_bytes
from remat.measure.shapes import batch_envelope, batch_shapes
from remat.measure.step import Step
from remat.planning.context import PlanContext, prepare_step, resolve_cost
from remat.planning.loop import fresh_allocator_peak, measure_decisions
from remat.planning.options import PlanOptions
from remat.planning.plans import Plan
from remat.progress import report
from remat.strategies import BlockStrategy
from remat.units import format_bytes

#: Plans made at most (the largest batch's, then one per batch over the budget or tightening).
_ROUNDS = 4

PlanOne = Callable[..., Plan]


def batch_elements(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """Elements across a batch's tensor inputs: how large a batch is, to pick the one to
    plan (NOTE [ Planning for several shapes ])."""
    return sum(math.prod(shape) for shape in shapes.values())


# NOTE [ A batch without padding ]
#     A padded batch has the same shapes as an unpadded one, so the shape guard lets it
#     through, but it can run another attention path: a Hugging Face Llama given an
#     all-ones ``attention_mask`` drops the mask and runs causal attention, and given one
#     pad token builds the 4-D mask and runs another kernel (64 tokens, batch 4: 7% more
#     at the peak, and a plan made on the unpadded batch ran over its budget on the
#     padded one). Reading a mask's values per training step would cost a device sync,
#     and planning every unpadded batch with a padded twin costs a second measured
#     context and gives per-call save sets that name calls an unpadded forward never
#     makes (a packed loader never pads). So the plan covers what it is given: a loader
#     that pads plans with a padded batch, or passes one in ``shapes=``, which plans the
#     dearer of the two and proves the other.


def shape_peak(step: Step, decisions: Mapping[str, BlockStrategy], *, simulate: bool) -> int:
    """The peak of ``step`` with ``decisions`` freshly applied, bytes: on the allocator,
    the highest of the first steps after apply (NOTE [ The first step ]) and a steady
    step; with ``simulate`` (or a device without an allocator remat reads), a tracked
    step. The model is restored."""
    if simulate or step.device.type not in ("cpu", "cuda"):
        return measure_decisions(step, decisions, simulate=simulate).peak_bytes
    return fresh_allocator_peak(step, decisions, start_bytes(step))


def plan_shapes(step: Step, batches: Sequence[Any], options: PlanOptions,
                plan_one: PlanOne) -> Plan:
    """One plan for ``step.batch`` and every batch of ``batches`` (NOTE [ Planning for
    several shapes ]).

    Args:
        step: the step, on one of the batches.
        batches: the other batches.
        options: what to plan for.
        plan_one: plans one step: ``plan_one(step, options, context=...)`` (``plan_step``).

    Raises:
        BudgetTooSmall: no plan fits every batch; the message names the batch that does
            not fit.
    """
    everything = [step.batch, *batches]
    steps = [step.with_batch(b) for b in everything]
    shapes = [batch_shapes(step.model, b) for b in everything]
    target = max(range(len(everything)), key=lambda i: (batch_elements(shapes[i]), -i))
    cost = resolve_cost(options.cost, step.model, simulate=options.simulate)
    contexts: dict[int, PlanContext] = {}
    budget_bytes: int | None = None
    asked, worst = options, target
    for done in range(_ROUNDS):
        report("plan the shapes", done, _ROUNDS)
        if target not in contexts:
            contexts[target] = prepare_step(steps[target], device=options.device, cost=cost,
                                            stand_in=not options.simulate)
        try:
            plan = plan_one(steps[target], asked, context=contexts[target])
        except BudgetTooSmall as error:
            if budget_bytes is None:
                raise
            raise _no_plan(shapes[target], shapes[worst], budget_bytes, error) from None
        if budget_bytes is None:
            budget_bytes = plan.budget_bytes
        over, worst = max(((shape_peak(steps[i], plan.decisions, simulate=options.simulate)
                            - budget_bytes, i) for i in range(len(steps)) if i != target),
                          default=(0, target))
        if over <= 0:
            return replace(plan, budget_bytes=budget_bytes,
                           shape_envelope=batch_envelope(step.model, *everything))
        if worst not in contexts:  # the batch that does not fit is the one to plan
            target, asked = worst, options.with_budget(budget_bytes)
        else:  # planned at before, and over again: ask the target for that much less
            asked = options.with_budget(plan.budget_bytes - over)
    raise _no_plan(shapes[target], shapes[worst], budget_bytes or 0, None)


def _no_plan(largest: Mapping[str, tuple[int, ...]], worst: Mapping[str, tuple[int, ...]],
             budget_bytes: int, error: BudgetTooSmall | None) -> BudgetTooSmall:
    facts = {"budget": format_bytes(budget_bytes),
             "planned at": shapes_label(largest),
             "over the budget with every plan tried": shapes_label(worst)}
    if error is not None:
        facts["smallest reachable peak at the planned shape, tightened"] = \
            format_bytes(error.min_peak_bytes)
    return BudgetTooSmall(
        message(current_call("remat.plan"), "no plan fits every shape given", facts,
                fix="raise the budget, or plan the shapes that do not fit separately"),
        budget_bytes=budget_bytes,
        min_peak_bytes=error.min_peak_bytes if error is not None else budget_bytes,
        breakdown=error.breakdown if error is not None else None)
