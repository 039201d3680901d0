"""Exceptions raised by remat.

Every remat error subclasses a built-in, so existing ``except ValueError`` /
``except RuntimeError`` handlers keep working::

    RematError (RuntimeError)
    ├── BlocksNotFound (also ValueError)   no repeated blocks / sub-layer found
    ├── StrategyError (also ValueError)    unknown or malformed strategy
    ├── BudgetTooSmall                     no plan reaches the budget
    └── ParityError                        gradients differ from the reference

    RematWarning (UserWarning)             a pitfall remat detected (BatchNorm, hooks, ...)
"""

from __future__ import annotations

from collections.abc import Mapping

from remat.core.cost import Category, StepCost

__all__ = [
    "BlocksNotFound",
    "BudgetTooSmall",
    "ParityError",
    "RematError",
    "RematWarning",
    "StrategyError",
]


class RematError(RuntimeError):
    """Base class of every error remat raises on purpose."""


class BlocksNotFound(RematError, ValueError):
    """No repeated blocks (or no sub-layer of the requested kind) could be found."""


class StrategyError(RematError, ValueError):
    """An unknown or malformed strategy was requested."""


class BudgetTooSmall(RematError):
    """No plan reaches the requested peak-memory budget.

    Attributes:
        budget_bytes: the requested budget, bytes.
        min_peak_bytes: the smallest peak any plan reaches, bytes.
        breakdown: what that smallest peak is made of, bytes by
            :class:`remat.core.cost.Category` (the same categories whichever planner
            raised it: ``{Category.PARAMETERS: ..., Category.OPTIMIZER_STATE: ...}``;
            ``Category`` is a ``str`` enum, so ``breakdown["parameters"]`` works too).
        cost: that smallest peak's :class:`remat.core.cost.StepCost` when the planner
            has one, else ``None``.
    """

    def __init__(self, message: str, *, budget_bytes: int, min_peak_bytes: int,
                 breakdown: Mapping[Category, int] | None = None,
                 cost: StepCost | None = None) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_peak_bytes = min_peak_bytes
        if breakdown is None and cost is not None:
            breakdown = cost.breakdown
        self.breakdown: dict[Category, int] = {Category(k): v
                                               for k, v in (breakdown or {}).items()}
        self.cost = cost


class ParityError(RematError):
    """A checkpointed model's gradients differ from the un-checkpointed model's."""


class RematWarning(UserWarning):
    """A pitfall remat detected and handled or could not handle (see the message)."""
