"""The throughput search: the batch size with the most samples per second under a budget.

See NOTE [ Throughput search ] in planner.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from remat.errors import BudgetTooSmall, message
from remat.measure.step import Step
from remat.planning.card import card_of
from remat.planning.context import prepare_step
from remat.planning.options import PlanOptions
from remat.planning.plans import Plan, ThroughputRow
from remat.planning.search import largest_fitting
from remat.progress import report

_REFINE_STEPS = 4

PlanOne = Callable[[Step, PlanOptions], Plan]
"""Plans one batch size: ``(step, options) -> Plan`` (raises BudgetTooSmall)."""


@dataclass(frozen=True)
class ThroughputSearch:
    """Which batch sizes :func:`remat.plan_throughput` searches.

    Args:
        batch_size: the batch size a percentage budget refers to (``"60%"`` of the
            un-checkpointed peak at this size). Default: 8.
        max_batch_size: the largest batch size tried. Default: 1024.

    Example:
        >>> ThroughputSearch(batch_size=4, max_batch_size=64)
        ThroughputSearch(batch_size=4, max_batch_size=64)
    """

    batch_size: int = 8
    max_batch_size: int = 1024

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(message("ThroughputSearch", f"{name} must be an int >= 1",
                                         {"found": repr(value)}, fix=f"pass {name} >= 1"))


@dataclass
class _Search:
    """The sizes tried so far and what each gave."""

    step: Step
    make_batch: Callable[[int], Any]
    options: PlanOptions
    plan_one: PlanOne
    plans: dict[int, Plan] = field(default_factory=dict)
    rows: dict[int, ThroughputRow] = field(default_factory=dict)
    first_error: BudgetTooSmall | None = None

    def fits(self, n: int) -> bool:
        if n in self.rows:
            return self.rows[n].fits
        report(f"batch size {n}", len(self.rows), len(self.rows) + 1)
        try:
            p = self.plan_one(self.step.with_batch(self.make_batch(n)), self.options)
        except BudgetTooSmall as exc:
            self.first_error = self.first_error or exc
            self.rows[n] = ThroughputRow(n, False, "", exc.min_peak_bytes, 0.0, 0.0, 0.0)
            return False
        p = replace(p, batch_size=n)
        step_ms = p.predicted_step_ms or 0.0
        self.plans[n] = p
        self.rows[n] = ThroughputRow(n, True, p.label(), p.measured_or_predicted_peak_bytes,
                                     p.recompute_ms, step_ms,
                                     n / step_ms * 1e3 if step_ms > 0 else 0.0)
        return True


def search_budget_bytes(step: Step, options: PlanOptions,
                        reference_batch: Callable[[], Any]) -> int:
    """A search's budget in bytes: a percentage refers to the un-checkpointed step on
    ``reference_batch()`` (made only then), bytes are bytes.

    Example:
        >>> search_budget_bytes(step, options, lambda: make_batch(8))
    """
    budget = options.budget
    if budget.is_device:  # the card's limit, on reserved bytes (NOTE [ Fits on the card ])
        return card_of(step, options).limit_bytes
    if not budget.is_relative:
        return budget.resolve(0)
    reference = prepare_step(step.with_batch(reference_batch()), device=options.device,
                             cost="roofline", stand_in=not options.simulate)
    return budget.resolve(reference.no_checkpoint_peak_bytes,
                          static_bytes=reference.static_bytes)


def search_throughput(step: Step, make_batch: Callable[[int], Any], options: PlanOptions,
                      sizes: ThroughputSearch, plan_one: PlanOne) -> Plan:
    """NOTE [ Throughput search ]: double the batch size until nothing fits, then bisect
    (:func:`~remat.planning.search.largest_fitting`).

    Args:
        step: the step (its batch is replaced by ``make_batch(n)`` for each size n).
        make_batch: ``n -> batch`` of n samples.
        options: the planning options; a percentage budget refers to
            ``sizes.batch_size``.
        sizes: the batch sizes to search.
        plan_one: plans one batch size for a byte budget.
    """
    budget_bytes = search_budget_bytes(step, options,
                                       lambda: make_batch(sizes.batch_size))
    search = _Search(step, make_batch, options if options.budget.is_device
                     else options.with_budget(budget_bytes), plan_one)
    # NOTE [ Grow then bisect ] in search.py; a few steps: the winner is rarely the largest.
    largest_fitting(search.fits, first=1, last=sizes.max_batch_size,
                    refine_steps=_REFINE_STEPS)
    if not search.plans and search.first_error is not None:
        raise search.first_error
    best = max(search.plans, key=lambda k: (search.rows[k].samples_per_s, -k))
    table = tuple(search.rows[k] for k in sorted(search.rows))
    return replace(search.plans[best], throughput=table)
