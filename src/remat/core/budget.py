"""Memory budgets: absolute byte counts, or a percentage of the un-checkpointed peak."""

from __future__ import annotations

import math
from dataclasses import dataclass

from remat.errors import message
from remat.units import parse_bytes

BudgetLike = int | str


@dataclass(frozen=True)
class Budget:
    """A peak-memory budget for a whole training step.

    Exactly one of the fields is set.

    Args:
        bytes_: an absolute budget, bytes.
        fraction: a fraction of the un-checkpointed step's peak (``"60%"`` is 0.6).

    Example:
        >>> parse_budget("60%").resolve(1000)
        600
    """

    bytes_: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.bytes_ is None) == (self.fraction is None):
            raise ValueError(message("Budget", "set exactly one of bytes_ and fraction",
                                     {"bytes_": self.bytes_, "fraction": self.fraction},
                                     fix="pass Budget(bytes_=...) or Budget(fraction=...)"))
        if self.bytes_ is not None and self.bytes_ <= 0:
            raise ValueError(message("Budget", "bytes_ must be > 0", {"found": self.bytes_},
                                     fix="pass a positive byte count"))
        if self.fraction is not None and not (math.isfinite(self.fraction)
                                              and self.fraction > 0):
            raise ValueError(message("Budget", "fraction must be > 0", {"found": self.fraction},
                                     fix="pass a finite fraction > 0 (0.6 for 60%)"))

    @property
    def is_relative(self) -> bool:
        """True for a percentage budget."""
        return self.fraction is not None

    def resolve(self, no_checkpoint_peak_bytes: int) -> int:
        """The budget in bytes, given the un-checkpointed step's peak."""
        if self.bytes_ is not None:
            return self.bytes_
        return int((self.fraction or 0.0) * no_checkpoint_peak_bytes)

    def __str__(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction * 100:g}%"
        return f"{self.bytes_} B"


def parse_budget(budget: BudgetLike | Budget) -> Budget:
    """Read a budget: an int (bytes), ``"12GiB"`` / ``"800MB"``, or ``"60%"``.

    A percentage is a fraction of the un-checkpointed step's peak
    (``remat.profile(model, batch).peak_bytes`` without checkpointing); it may exceed
    100%, which asks for no checkpointing at all.

    Raises:
        ValueError: not a positive byte count or percentage; the message shows the forms.

    Example:
        >>> parse_budget("1.5GiB").bytes_
        1610612736
        >>> parse_budget("60%").fraction
        0.6
    """
    if isinstance(budget, Budget):
        return budget
    hint = "write budget as bytes (an int), with a unit (\"12GiB\", \"800MB\") or as a " \
           "percentage of the un-checkpointed peak (\"60%\")"
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise ValueError(message("remat.plan", f"cannot read budget {budget!r}",
                                 {"type": type(budget).__name__}, fix=hint))
    if isinstance(budget, str) and budget.strip().endswith("%"):
        text = budget.strip()[:-1].strip()
        try:
            percent = float(text)
        except ValueError:
            raise ValueError(message("remat.plan", f"cannot read budget {budget!r}",
                                     fix=hint)) from None
        if not (math.isfinite(percent) and percent > 0):
            raise ValueError(message("remat.plan", f"budget {budget!r} must be a percentage > 0",
                                     fix=hint))
        return Budget(fraction=percent / 100.0)
    try:
        value = parse_bytes(budget)
    except ValueError:
        raise ValueError(message("remat.plan", f"cannot read budget {budget!r}",
                                 fix=hint)) from None
    if value <= 0:
        raise ValueError(message("remat.plan", "budget must be > 0 bytes",
                                 {"found": repr(budget)}, fix=hint))
    return Budget(bytes_=value)
