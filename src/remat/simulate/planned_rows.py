"""The planner hook of :func:`remat.simulate.simulate`: the rows labelled ``"plan"``.

NOTE [ Planner hook ]
``plan=True`` adds rows labelled "plan": for each batch size, remat.plan(...,
simulate=True) picks per-block decisions for the device budget, the plan is applied
and simulated like a strategy. A batch size no plan fits gets a row with the smallest
reachable peak (per rank) and no times; one whose ``"none"`` row fits gets that row
(no recompute: nothing is cheaper), without planning. By default the planner's parts
are measured on the stack cut short and the row is composed (NOTE [ Fast plan rows ]
in plan_fast.py); ``exact=True``, and whatever that path cannot give, plans on the
whole model as described here.

NOTE [ Per-rank budgets ]
The planner plans the one-device step, so the bytes a rank's tensors may take on its
card, ``M`` (capacity less outside memory less workspaces: ``CardBudget.tensor_bytes``,
NOTE [ Fits on the card ] in card_fit.py), are translated into a one-device
budget that keeps the rank's peak, as :func:`~remat.simulate.point.point` computes it
(NOTE [ Peaks under sharding ]), within ``M``. ``P``, ``G`` and ``O`` are the one-device
parameter, gradient and optimizer-state bytes, ``W`` the ranks, ``U`` what FSDP
unshards at once (NOTE [ Sharding arithmetic ] in distributed/sharding.py):

* ``"none"``: ``M``.
* ``"ddp"``: the rank holds the one-device step plus gradient buckets of ``G`` bytes
  (NOTE [ Sharding arithmetic ]), so ``M - G``. Exact.
* ``"fsdp"``: the rank's peak at a forward/backward moment holding ``R`` bytes of
  activations and temporaries and ``g`` bytes of gradients is
  ``R + ceil(P/W) + ceil(g/W) + ceil(O/W) + U``, while the one-device step without an
  optimizer holds ``R + P + g`` then. The optimizer's own moment (the optimizer step)
  holds no activations and is the same under every plan, so the step is planned
  *without the optimizer*. Gradients alive at a moment run from 0 (forward) to ``G``
  (end of backward), so no single one-device budget is exact for every moment:
  ``lo = M + P - ceil(P/W) - ceil(O/W) - U`` is safe for every moment (it credits no
  gradient) and ``hi = lo + G - ceil(G/W)`` is exact only when every gradient is
  alive. The plan is made for ``hi`` and, while its simulated rank peak is over ``M``,
  for a budget tightened by the overshoot (not below ``lo``), a few rounds, like the
  planner's own closed loop (NOTE [ How a plan is made ]). Should no plan fit the rank
  then, the plan that checkpoints every block is simulated: the plan row fits whenever
  ``full`` does. (Planning the step with its optimizer against
  ``M + (P+G+O)(1 - 1/W) - U``, as remat did before, let plans overshoot ``M`` by up to
  ``G (1 - 1/W)``.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from remat.core.cost import Category, StepCost
from remat.simulate.fast_rows import FastContext
from remat.simulate.plan_fast import fast_plan_rows
from remat.simulate.point import per_rank, point, row_of
from remat.simulate.result import SimulationRow
from remat.simulate.sim_setup import Setup

_FSDP_ROUNDS = 4
_RESERVED_ROUNDS = 3


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _budget(setup: Setup, static: Mapping[Category, int]) -> int:
    """The one-device budget for ``"none"`` and ``"ddp"`` (NOTE [ Per-rank budgets ])."""
    memory = setup.card.tensor_bytes
    if setup.sharding == "ddp":
        return max(memory - static[Category.GRADIENTS], 1)
    return memory


def _fsdp_budgets(setup: Setup, static: Mapping[Category, int]) -> tuple[int, int]:
    """``(lo, hi)`` one-device budgets without the optimizer (NOTE [ Per-rank budgets ])."""
    params, grads, states = (static[Category.PARAMETERS], static[Category.GRADIENTS],
                             static[Category.OPTIMIZER_STATE])
    w = setup.world_size
    layout = setup.layout
    unsharded = (layout.block_param_bytes + layout.block_grad_bytes
                 + layout.root_param_bytes + layout.root_grad_bytes)
    lo = setup.card.tensor_bytes + params - _ceil_div(params, w) - _ceil_div(states, w) \
        - unsharded
    return max(lo, 1), max(lo + grads - _ceil_div(grads, w), 1)


def _planner_kwargs(setup: Setup) -> dict[str, Any]:
    return {"loss_fn": setup.loss_fn, "blocks": setup.blocks, "simulate": True,
            "device": setup.device}


def _no_plan_row(setup: Setup, batch_size: int, seq_len: int, static: Mapping[Category, int],
                 min_peak_bytes: int, budget_bytes: int) -> SimulationRow:
    """The row of a batch size no plan fits: the smallest peak, per rank, and no times.

    ``min_peak_bytes`` is the planner's (one-device) smallest peak for ``budget_bytes``;
    the rank's equivalent is it plus what the budget translation took off (an upper
    bound under FSDP, see NOTE [ Per-rank budgets ]).
    """
    rank_peak = min_peak_bytes + max(setup.card.tensor_bytes - budget_bytes, 0)
    cost = StepCost(peak_bytes=rank_peak, step_ms=0.0, activation_bytes=0,
                    param_bytes=per_rank(setup, static[Category.PARAMETERS]),
                    grad_bytes=per_rank(setup, static[Category.GRADIENTS]),
                    optimizer_bytes=per_rank(setup, static[Category.OPTIMIZER_STATE]),
                    flops=0, recompute_flops=0, recompute_ms=0.0)
    fit = setup.card.check(rank_peak, rank_peak)
    return SimulationRow(
        strategy="plan", batch_size=batch_size, seq_len=seq_len, cost=cost, fits=False,
        samples_per_s=0.0, tokens_per_s=0.0, single_device_peak_bytes=min_peak_bytes,
        note="no plan fits the budget", reserved_bytes=fit.reserved_bytes,
        margin_bytes=fit.margin_bytes,
    )


def _simulate_plan(setup: Setup, chosen: Any, batch_size: int, seq_len: int) -> SimulationRow:
    from remat.strategies import apply

    apply(setup.model, chosen, blocks=setup.blocks, on_new_shape="off")  # a measured copy
    return point(setup, "plan", batch_size, seq_len)


def _plan_row(setup: Setup, batch_size: int, seq_len: int,
              static: Mapping[Category, int]) -> SimulationRow:
    """One batch size's plan row, unsharded or DDP: one plan for the translated budget.

    The row is the profile of the plan's step on the planner's own warm fake copy (NOTE
    [ Closed loop on the fake copy ] in planning/loop.py): the same step, bytes and ops
    as a fresh simulation, without copying the model and warming it up again."""
    from remat.errors import BudgetTooSmall
    from remat.measure.step import Step
    from remat.planning.context import prepare_step
    from remat.planning.loop import measure_on_copy
    from remat.planning.planner import derived_budgets
    from remat.planning.planner import plan as planner

    budget = _budget(setup, static)
    batch = setup.batch_fn(batch_size, seq_len)
    step = Step(setup.model, batch, loss_fn=setup.loss_fn, optimizer=setup.optimizer,
                blocks=setup.blocks)
    context = prepare_step(step, device=setup.device, cost="roofline", stand_in=False)
    row: SimulationRow | None = None
    for _ in range(_RESERVED_ROUNDS):  # NOTE [ Reserved per rank ]: tighten by the excess
        try:
            with derived_budgets():  # translated from the device: the rank's own checks
                chosen = planner(setup.model, batch, budget=budget, optimizer=setup.optimizer,
                                 context=context, **_planner_kwargs(setup))
        except BudgetTooSmall as exc:
            if row is not None:
                return row
            return _no_plan_row(setup, batch_size, seq_len, static, int(exc.min_peak_bytes),
                                budget)
        prof = measure_on_copy(step, context, chosen.decisions)
        row = _simulate_plan(setup, chosen, batch_size, seq_len) if prof is None \
            else row_of(setup, "plan", batch_size, seq_len, prof, batch)
        if row.fits or row.margin_bytes >= 0:
            return row
        budget -= -row.margin_bytes
    assert row is not None
    return row


def _fsdp_plan_row(setup: Setup, batch_size: int, seq_len: int,
                   static: Mapping[Category, int]) -> SimulationRow:
    """One batch size's plan row under FSDP; see NOTE [ Per-rank budgets ]."""
    from remat.errors import BudgetTooSmall
    from remat.planning.context import prepare
    from remat.planning.planner import derived_budgets
    from remat.planning.planner import plan as planner
    from remat.strategies import apply

    batch = setup.batch_fn(batch_size, seq_len)
    context = prepare(setup.model, batch, loss_fn=setup.loss_fn, optimizer=None,
                      blocks=setup.blocks, device=setup.device, cost="roofline", stand_in=False)
    lo, budget = _fsdp_budgets(setup, static)
    tried: list[SimulationRow] = []
    rows: dict[Any, SimulationRow] = {}  # by decisions: a tighter budget may choose the same
    for _ in range(_FSDP_ROUNDS):
        try:
            with derived_budgets():  # the rank's budget, the optimizer's shards left out
                chosen = planner(setup.model, batch, budget=budget, context=context,
                                 **_planner_kwargs(setup))
        except BudgetTooSmall as exc:
            if not tried:  # not even the most lenient budget: no plan fits the rank
                return _no_plan_row(setup, batch_size, seq_len, static,
                                    int(exc.min_peak_bytes), lo)
            break
        key = tuple(chosen.decisions.items())  # a plan keeps its decisions in block order
        if key not in rows:
            rows[key] = _simulate_plan(setup, chosen, batch_size, seq_len)
        row = rows[key]
        if row.fits:
            return row
        tried.append(row)
        # ``lo`` is safe for allocated bytes; the reserved overhead comes on top of them
        # (NOTE [ Reserved per rank ] in point.py)
        floor = max(1, lo - max(row.reserved_bytes - setup.card.workspace_bytes
                                - row.peak_bytes, 0))
        if budget <= floor:
            break
        budget = max(floor, budget + min(row.margin_bytes, 0))
    apply(setup.model, "full", blocks=setup.blocks)  # every block checkpointed
    tried.append(point(setup, "plan", batch_size, seq_len))
    return min(tried, key=lambda r: (not r.fits, r.peak_bytes))


def plan_rows(setup: Setup, batch_sizes: Sequence[int], seq_len: int,
              static: Mapping[Category, int],
              on_row: Callable[[SimulationRow], None] | None,
              simulated: Sequence[SimulationRow] = (),
              fast: FastContext | None = None) -> list[SimulationRow]:
    """The ``"plan"`` row of every batch size (see NOTE [ Planner hook ]).

    Args:
        static: one device's parameter, gradient and optimizer-state bytes (``static_parts``).
        simulated: the strategies' rows. Where ``"none"``'s row fits the device, the
            plan row is that row: nothing recomputed is the cheapest plan there is, and
            its step was simulated already. Default: none given.
        fast: the fast rows' context: plan rows from shallow steps where NOTE [ Fast plan
            rows ] (in plan_fast.py) applies, needing the ``"none"`` rows among
            ``simulated``. Default: None (every row planned on the whole model).
    """
    make_row = _fsdp_plan_row if setup.sharding == "fsdp" else _plan_row
    nones = {r.batch_size: r for r in simulated if r.strategy == "none"}
    fitting_none = {b: r for b, r in nones.items() if r.fits}
    planned = [b for b in batch_sizes if b not in fitting_none]
    budget = _budget(setup, static)

    def no_plan(batch_size: int, min_peak_bytes: int) -> SimulationRow:
        return _no_plan_row(setup, batch_size, seq_len, static, min_peak_bytes, budget)

    done = fast_plan_rows(fast, planned, seq_len, static, nones, (budget, no_plan)) \
        if fast is not None and planned and setup.sharding != "fsdp" else {}
    rows: list[SimulationRow] = []
    for batch_size in batch_sizes:
        row = (dataclasses.replace(fitting_none[batch_size], strategy="plan")
               if batch_size in fitting_none else done[batch_size] if batch_size in done
               else make_row(setup, batch_size, seq_len, static))
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows
