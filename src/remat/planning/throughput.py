"""The throughput search: the batch size with the most samples per second under a budget.

See NOTE [ Throughput search ] in planner.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from remat.errors import BudgetTooSmall, message
from remat.measure.step import Step
from remat.planning.context import prepare_step
from remat.planning.options import PlanOptions
from remat.planning.plans import Plan, ThroughputRow
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
        self.rows[n] = ThroughputRow(n, True, p.label(), p.peak_bytes, p.recompute_ms, step_ms,
                                     n / step_ms * 1e3 if step_ms > 0 else 0.0)
        return True


def search_throughput(step: Step, make_batch: Callable[[int], Any], options: PlanOptions,
                      sizes: ThroughputSearch, plan_one: PlanOne) -> Plan:
    """NOTE [ Throughput search ]: double the batch size until nothing fits, then bisect.

    Args:
        step: the step (its batch is replaced by ``make_batch(n)`` for each size n).
        make_batch: ``n -> batch`` of n samples.
        options: the planning options; a percentage budget refers to
            ``sizes.batch_size``.
        sizes: the batch sizes to search.
        plan_one: plans one batch size for a byte budget.
    """
    budget = options.budget
    if budget.is_relative:
        reference = prepare_step(step.with_batch(make_batch(sizes.batch_size)),
                                 device=options.device, cost="roofline")
        budget_bytes = budget.resolve(reference.no_checkpoint_peak_bytes,
                                      static_bytes=reference.static_bytes)
    else:
        budget_bytes = budget.resolve(0)
    search = _Search(step, make_batch, options.with_budget(budget_bytes), plan_one)
    n, low, high = 1, 0, None
    while n <= sizes.max_batch_size:
        if not search.fits(n):
            high = n
            break
        low, n = n, n * 2
    if low == 0 and search.first_error is not None:
        raise search.first_error
    if high is None and low < sizes.max_batch_size:
        high = sizes.max_batch_size + 1
    steps = 0
    while high is not None and high - low > 1 and steps < _REFINE_STEPS:
        steps += 1  # bisect toward the largest size that fits
        mid = (low + high) // 2
        if search.fits(mid):
            low = mid
        else:
            high = mid
    best = max(search.plans, key=lambda k: (search.rows[k].samples_per_s, -k))
    table = tuple(search.rows[k] for k in sorted(search.rows))
    return replace(search.plans[best], throughput=table)
