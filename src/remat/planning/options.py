"""How to plan: one options value shared by ``remat.plan``, ``remat.auto`` and the
throughput search."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from remat.devices import DeviceSpec
from remat.errors import message
from remat.planning.budget import Budget, BudgetLike, parse_budget

__all__ = ["COSTS", "MAXIMIZE", "PlanOptions"]

#: ``cost=`` values: measured time on CUDA and roofline elsewhere, or either one forced.
COSTS: tuple[str, ...] = ("auto", "roofline", "measured")
#: ``maximize=`` values besides ``None``.
MAXIMIZE: tuple[str, ...] = ("throughput",)


@dataclass(frozen=True)
class PlanOptions:
    """What to plan for and how (the arguments of :func:`remat.plan` but the step's own).

    Args:
        budget: the step's peak: bytes, ``"12GiB"``, or ``"60%"`` of the un-checkpointed
            peak; parsed into a :class:`~remat.planning.budget.Budget`.
        simulate: measure the closed loop on fake tensors. Default: ``False``.
        maximize: ``"throughput"`` to search the batch size, or ``None``. Default: ``None``.
        device: the cost device (name or spec). Default: the model's GPU when known,
            else ``"h100-80gb"``.
        batch_size: with ``maximize``, the batch size percentages refer to. Default: 8.
        max_batch_size: with ``maximize``, the largest batch size tried. Default: 1024.
        cost: ``"auto"``, ``"roofline"`` or ``"measured"``. Default: ``"auto"``.
        compile: plan the step as it runs with every block compiled (see
            ``remat/planning/compiled_plan.py``). Default: ``False``.

    Example:
        >>> PlanOptions(budget="60%").budget.fraction
        0.6
    """

    budget: Budget = field(default_factory=lambda: parse_budget("100%"))
    simulate: bool = False
    maximize: str | None = None
    device: str | DeviceSpec | None = None
    batch_size: int = 8
    max_batch_size: int = 1024
    cost: str = "auto"
    compile: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", parse_budget(self.budget))
        if self.maximize is not None and self.maximize not in MAXIMIZE:
            raise ValueError(message("remat.plan", "maximize must be 'throughput' or None",
                                     {"found": repr(self.maximize)},
                                     fix="pass maximize='throughput' or leave it out"))
        if self.cost not in COSTS:
            raise ValueError(message("remat.plan", "unknown cost", {"found": repr(self.cost)},
                                     fix=f"pass one of {COSTS}"))
        for name in ("batch_size", "max_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(message("remat.plan",
                                         "batch_size and max_batch_size must be >= 1",
                                         {"found": f"{name}={value!r}"},
                                         fix=f"pass {name} as an int >= 1"))

    @classmethod
    def of(cls, budget: BudgetLike | Budget, **kwargs: object) -> PlanOptions:
        """Options from :func:`remat.plan`'s keyword arguments."""
        return cls(budget=parse_budget(budget), **kwargs)  # type: ignore[arg-type]

    def with_budget(self, budget: BudgetLike | Budget) -> PlanOptions:
        """A copy with another budget (the throughput search plans every size in bytes)."""
        return replace(self, budget=parse_budget(budget))
