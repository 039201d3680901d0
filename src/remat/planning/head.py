"""The chunked output head as a planner choice (``chunked_head:N`` under ``"<head>"``).

NOTE [ Head choice ]
    The head and the loss run after the last block, so a chunked head changes no block's
    candidates: it changes only the windows the head runs in (the logits, their float32
    copy, the log-softmax the loss saves and their gradients). Its choice is therefore a
    shift of window constants, not a column of the solver's tables. For each chunk count
    in :data:`CHUNKS` one whole fake step is cut into windows with the chunked head
    applied (``run_windows`` on the context's fake copy), and the peak model's constants
    move by that step's window peaks minus the un-chunked ones: the peak model stays
    exact for any block choice (NOTE [ Peak model ]). Its recompute is one output
    projection whatever the chunk count, so more chunks only cost smaller matmuls.
    The planner tries the head only where no block-only plan fits (a head-dominated
    step at a small budget), with the fewest chunks first: the first chunk count whose
    plan fits is the plan. These contexts are measured only then, so planning a budget
    that block strategies reach costs no more steps.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

from remat.core.budget import Budget
from remat.errors import BudgetTooSmall, StrategyError
from remat.measure.step import Step
from remat.measure.windows import quiet, run_windows
from remat.planning.context import PlanContext
from remat.planning.loop import close_loop
from remat.planning.plans import Plan
from remat.strategies import apply_decisions, preserved_strategy
from remat.strategies.builtin import ChunkedHead
from remat.strategies.head import HEAD_KEY, check_head

#: Chunk counts the planner tries, fewest first.
CHUNKS = (2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class HeadOption:
    """One chunked head measured on the context's fake copy (NOTE [ Head choice ]).

    Args:
        strategy: the head's decision.
        window_delta_bytes: per window label, its peak with the head minus without.
    """

    strategy: ChunkedHead
    window_delta_bytes: Mapping[str, int]


def head_options(step: Step, ctx: PlanContext) -> Iterator[HeadOption]:
    """The chunked heads of :data:`CHUNKS`, measured one at a time; none where the model's
    head cannot be chunked (``check_head``) or no fake copy is at hand."""
    setup = ctx.setup
    if setup is None:
        return
    try:
        check_head(setup.model, api="remat.plan")
    except StrategyError:
        return
    model = ctx.peak_model
    base = model.window_bytes([0] * model.num_blocks)  # the calibration step's peaks
    for chunks in CHUNKS:
        strategy = ChunkedHead(chunks)
        with preserved_strategy(setup.model), quiet():
            apply_decisions(setup.model, {HEAD_KEY: strategy}, blocks=step.blocks)
            windows = run_windows(setup, loss_fn=step.loss_fn, warm_up=False)
        if set(windows.peaks) != set(base):
            return  # the windows are not the same step's: nothing to shift
        yield HeadOption(strategy, {w: windows.peaks[w] - base[w] for w in base})


def with_head(ctx: PlanContext, option: HeadOption) -> PlanContext:
    """``ctx`` with the head decided: window constants shifted, decisions including it."""
    model = ctx.peak_model
    windows = tuple(replace(w, constant_bytes=w.constant_bytes
                            + option.window_delta_bytes[w.label]) for w in model.windows)
    return replace(ctx, peak_model=replace(model, windows=windows), head=option.strategy)


def plan_with_head(step: Step, ctx: PlanContext, budget_bytes: int, *, simulate: bool,
                   budget: Budget | None, error: BudgetTooSmall) -> Plan:
    """The plan with the fewest head chunks that fits, where no block-only plan does
    (NOTE [ Head choice ]).

    Raises:
        BudgetTooSmall: no chunk count fits either: the error of the most chunks (the
            smallest reachable peak), or ``error`` when the head cannot be chunked.
    """
    for option in head_options(step, ctx):
        try:
            return close_loop(step, with_head(ctx, option), budget_bytes, simulate=simulate,
                              budget=budget)
        except BudgetTooSmall as exc:
            error = exc
    raise error
