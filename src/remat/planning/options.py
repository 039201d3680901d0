"""How to plan: one options value shared by ``remat.plan``, ``remat.auto``,
``remat.plan_throughput`` (each batch size) and ``remat.plan_compiled``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from remat.core.budget import Budget, BudgetLike, parse_budget
from remat.devices import DeviceSpec
from remat.errors import message

#: ``cost=`` values: measured time on CUDA and roofline elsewhere, or either one forced.
COSTS: tuple[str, ...] = ("auto", "roofline", "measured")


@dataclass(frozen=True)
class PlanOptions:
    """What to plan for and how (the arguments of :func:`remat.plan` but the step's own).

    Args:
        budget: the step's peak: bytes, ``"12GiB"``, or ``"60%"`` of the un-checkpointed
            peak; parsed into a :class:`~remat.core.budget.Budget`.
        simulate: measure the closed loop on fake tensors. Default: ``False``.
        device: the cost device (name or spec). Default: the model's GPU when known,
            else ``"h100-80gb"``.
        cost: ``"auto"``, ``"roofline"`` or ``"measured"``. Default: ``"auto"``.

    Example:
        >>> PlanOptions(budget="60%").budget.fraction
        0.6
    """

    budget: Budget = field(default_factory=lambda: parse_budget("100%"))
    simulate: bool = False
    device: str | DeviceSpec | None = None
    cost: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", parse_budget(self.budget))
        if self.cost not in COSTS:
            raise ValueError(message("remat.plan", "unknown cost", {"found": repr(self.cost)},
                                     fix=f"pass one of {COSTS}"))

    def with_budget(self, budget: BudgetLike | Budget) -> PlanOptions:
        """A copy with another budget (the throughput search plans every size in bytes)."""
        return replace(self, budget=parse_budget(budget))
