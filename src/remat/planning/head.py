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
    The planner tries the head where no block-only plan fits (a head-dominated
    step at a small budget) and keeps the fewest chunks whose plan fits. More chunks
    hold less at once (each slice's logits, float32 copy and gradient), so it closes the
    loop on the most chunks first: when that does not fit, nothing does, and the error is
    that count's (one closed loop where a batch size is out of reach, as in a throughput
    search); when it fits, a bisection over the counts finds the fewest that fit.

NOTE [ Priced head ]
    Where a block-only plan fits, the head may still be cheaper than the last bytes the
    blocks free: in a shallow model the log-softmax the loss saves is a large share of
    what must go, and freeing it costs one output projection, while the blocks' last
    bytes cost whole recompute chains. Three steps, each run only when the one before
    says the head can pay:
    1. Free: solve the peak model without the windows between the last block's forward
       and its backward (the only ones the head changes). Unless that cuts the
       block-only cost by :data:`HEAD_BINDS` or more, the head is not tried: those
       windows barely bind, and steps 2 and 3 cost a fake step and a closed loop each,
       a large share of a deep model's planning time.
    2. One fake step with :data:`PRICED_CHUNKS` chunks, its ops recorded: the head's
       window shifts and its recompute (the ops in the ``recompute`` phase; no block is
       checkpointed in that step). Solve the shifted model; the choice's cost plus the
       head's must undercut the block-only plan.
    3. The closed loop with that head; its plan is kept only when its measured recompute
       is lower.
    With measured costs (``cost="measured"``) the head is not priced: its time is not
    in the candidates' timings.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from remat.card_fit import CardBudget
from remat.core.budget import Budget
from remat.core.peak import PeakModel
from remat.core.solver import solve
from remat.errors import BudgetTooSmall, StrategyError
from remat.measure.step import Step
from remat.measure.windows import run_windows
from remat.planning.context import PlanContext
from remat.planning.loop import close_loop
from remat.planning.plans import Plan
from remat.planning.recompute_cost import recompute_ms
from remat.strategies import trial
from remat.strategies.builtin import ChunkedHead
from remat.strategies.head import HEAD_KEY, check_head

#: Chunk counts the planner tries, fewest first.
CHUNKS = (2, 4, 8, 16, 32, 64)
#: The least share of the block-only cost that dropping the head's windows must cut for
#: the head to be priced (NOTE [ Priced head ], step 1).
HEAD_BINDS = 1 / 3
#: The chunk count priced against a block-only plan (NOTE [ Priced head ]): most of the
#: head's bytes (94% of the 64-chunk saving on a 3-layer Falcon) for one fake step of 8
#: small output projections.
PRICED_CHUNKS = 8


@dataclass(frozen=True)
class HeadOption:
    """One chunked head measured on the context's fake copy (NOTE [ Head choice ]).

    Args:
        strategy: the head's decision.
        window_delta_bytes: per window label, its peak with the head minus without.
        recompute_ms: the head's recompute cost on the cost device, ms, when measured
            (NOTE [ Priced head ]). Default: None.
    """

    strategy: ChunkedHead
    window_delta_bytes: Mapping[str, int]
    recompute_ms: float | None = None


def head_options(step: Step, ctx: PlanContext, chunk_counts: Sequence[int] = CHUNKS, *,
                 priced: bool = False) -> Iterator[HeadOption]:
    """The chunked heads of ``chunk_counts`` (default :data:`CHUNKS`), measured one at a
    time (``priced``: with their recompute cost); none where the model's head cannot be
    chunked (``check_head``) or no fake copy is at hand."""
    setup = ctx.setup
    if setup is None:
        return
    try:
        check_head(setup.model, api="remat.plan")
    except StrategyError:
        return
    model = ctx.peak_model
    base = model.window_bytes([0] * model.num_blocks)  # the calibration step's peaks
    for chunks in chunk_counts:
        strategy = ChunkedHead(chunks)
        with trial(setup.model, {HEAD_KEY: strategy}, blocks=step.blocks):
            windows = run_windows(setup, loss_fn=step.loss_fn, warm_up=False,
                                  record_ops=priced)
        if set(windows.peaks) != set(base):
            return  # the windows are not the same step's: nothing to shift
        yield HeadOption(strategy, {w: windows.peaks[w] - base[w] for w in base},
                         recompute_ms(windows.ops, ctx.device) if priced else None)


def with_head(ctx: PlanContext, option: HeadOption) -> PlanContext:
    """``ctx`` with the head decided: window constants shifted, decisions including it."""
    model = ctx.peak_model
    windows = tuple(replace(w, constant_bytes=w.constant_bytes
                            + option.window_delta_bytes[w.label]) for w in model.windows)
    return replace(ctx, peak_model=replace(model, windows=windows), head=option.strategy)


def _without_head_windows(model: PeakModel[Any]) -> PeakModel[Any]:
    """``model`` less the windows between the last block's forward and its backward."""
    return replace(model, windows=tuple(w for w in model.windows if not (
        w.block is None and w.prefix == model.num_blocks)))


def cheaper_with_head(step: Step, ctx: PlanContext, budget_bytes: int, plan: Plan, *,
                      simulate: bool, budget: Budget | None,
                      card: CardBudget | None = None) -> Plan:
    """``plan``, or a plan with a chunked head where that is cheaper (NOTE [ Priced head ]).

    Args:
        step, ctx, budget_bytes: what ``plan`` was planned for.
        plan: the block-only plan (its measured peak fits ``budget_bytes``).
        simulate, budget, card: as for :func:`~remat.planning.loop.close_loop`.

    Returns:
        The plan with the lower recompute cost (``plan`` on a tie).
    """
    if ctx.head is not None or ctx.cost_source != "roofline":
        return plan
    free = solve(_without_head_windows(ctx.peak_model), budget_bytes)
    if free is None or ctx.recompute_ms(free) > (1 - HEAD_BINDS) * plan.recompute_ms:
        return plan
    try:
        for option in head_options(step, ctx, (PRICED_CHUNKS,), priced=True):
            headed = with_head(ctx, option)
            choice = solve(headed.peak_model, budget_bytes)
            if (choice is None or headed.recompute_ms(choice) + (option.recompute_ms or 0.0)
                    >= plan.recompute_ms):
                return plan
            found = close_loop(step, headed, budget_bytes, simulate=simulate, budget=budget,
                               card=card)
            return found if found.recompute_ms < plan.recompute_ms else plan
    except (BudgetTooSmall, StrategyError):  # a forward the chunked head refuses at run time
        return plan
    except Exception:  # noqa: BLE001
        # The trial is optional and ``plan`` already fits: a forward that breaks under a
        # chunked head (TRL's fused-loss forward needs the labels it is not given) keeps
        # the block-only plan instead of failing the user's call.
        return plan
    return plan


def plan_with_head(step: Step, ctx: PlanContext, budget_bytes: int, *, simulate: bool,
                   budget: Budget | None, error: BudgetTooSmall,
                   card: CardBudget | None = None) -> Plan:
    """The plan with the fewest head chunks that fits, where no block-only plan does
    (NOTE [ Head choice ]).

    Raises:
        BudgetTooSmall: no chunk count fits either: the error of the most chunks (the
            smallest reachable peak), or ``error`` when the head cannot be chunked.
    """
    def attempt(i: int) -> Plan | BudgetTooSmall | None:
        """The plan with ``CHUNKS[i]`` chunks; None where the head cannot be chunked."""
        option = next(head_options(step, ctx, (CHUNKS[i],)), None)  # one fake step
        if option is None:
            return None
        try:
            return close_loop(step, with_head(ctx, option), budget_bytes,
                              simulate=simulate, budget=budget, card=card)
        except BudgetTooSmall as exc:
            return exc

    best = attempt(len(CHUNKS) - 1)
    if best is None:
        raise error
    if isinstance(best, BudgetTooSmall):
        raise best
    lo, hi = 0, len(CHUNKS) - 1  # CHUNKS[hi] fits: best is its plan
    while lo < hi:
        mid = (lo + hi) // 2
        found = attempt(mid)
        if found is None or isinstance(found, BudgetTooSmall):
            lo = mid + 1
        else:
            hi, best = mid, found
    return best
