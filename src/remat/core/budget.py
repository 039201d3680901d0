"""Memory budgets: absolute byte counts, or a percentage of the un-checkpointed peak or of
its activations.

NOTE [ Budget forms ]
    ``"60%"`` is 60% of the whole un-checkpointed peak, parameters, gradients, optimizer
    state and batch included. Those *static* bytes no checkpointing can remove, so on a
    small model ``"50%"`` can lie below every plan. ``"activations:50%"`` is what users
    usually mean: the static bytes plus half of the rest of the peak (the activations and
    temporaries checkpointing can trade), ``static + 0.5 * (peak - static)``, where
    ``static`` is the static bytes (parameters, buffers, gradients, optimizer state and
    batch: NOTE [ Static bytes ] in cost.py) alive at the un-checkpointed peak.
    :meth:`Budget.other_form` writes a resolved budget in the other form, for messages
    (``BudgetTooSmall``).

    ``"device"`` is the card itself: its capacity less what lives outside PyTorch's
    allocator, applied to the step's predicted *reserved* peak with the library workspaces
    (NOTE [ Fits on the card ] in card_fit.py), so a plan for it trains without
    running out of memory on that card. It resolves to the card's limit in bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from remat.errors import current_call, message
from remat.units import parse_bytes

BudgetLike = int | str


@dataclass(frozen=True)
class Budget:
    """A peak-memory budget for a whole training step.

    Exactly one of ``bytes_`` and ``fraction`` is set, or neither with ``of="device"``.

    Args:
        bytes_: an absolute budget, bytes.
        fraction: a fraction of the un-checkpointed step's peak (``"60%"`` is 0.6), or of
            its activations with ``of="activations"`` (NOTE [ Budget forms ]).
        of: what ``fraction`` is of: ``"peak"`` or ``"activations"``; or ``"device"``, the
            card's capacity less the memory outside the allocator, on the reserved peak
            (NOTE [ Budget forms ]). Default: ``"peak"``.

    Example:
        >>> parse_budget("60%").resolve(1000)
        600
        >>> parse_budget("activations:50%").resolve(1000, static_bytes=400)
        700
    """

    bytes_: int | None = None
    fraction: float | None = None
    of: str = "peak"

    def __post_init__(self) -> None:
        if self.of == "device":
            if self.bytes_ is not None or self.fraction is not None:
                raise ValueError(message("Budget", "of='device' takes no bytes_ or fraction",
                                         {"bytes_": self.bytes_, "fraction": self.fraction},
                                         fix="pass Budget(of='device') (or parse 'device')"))
            return
        if (self.bytes_ is None) == (self.fraction is None):
            raise ValueError(message("Budget", "set exactly one of bytes_ and fraction",
                                     {"bytes_": self.bytes_, "fraction": self.fraction},
                                     fix="pass Budget(bytes_=...) or Budget(fraction=...)"))
        if self.bytes_ is not None and self.bytes_ <= 0:
            raise ValueError(message("Budget", "bytes_ must be > 0", {"found": self.bytes_},
                                     fix="pass a positive byte count"))
        if self.of not in _OF:
            raise ValueError(message("Budget", f"unknown of={self.of!r}",
                                     fix=f"pass one of {', '.join(_OF)}"))
        if self.of != "peak" and self.fraction is None:
            raise ValueError(message("Budget", f"of={self.of!r} needs a fraction",
                                     fix="pass Budget(fraction=..., of=...)"))
        if self.fraction is not None and not (math.isfinite(self.fraction)
                                              and self.fraction > 0):
            raise ValueError(message("Budget", "fraction must be > 0", {"found": self.fraction},
                                     fix="pass a finite fraction > 0 (0.6 for 60%)"))

    @property
    def is_relative(self) -> bool:
        """True for a percentage budget."""
        return self.fraction is not None

    @property
    def is_device(self) -> bool:
        """True for the card's own budget (``"device"``: NOTE [ Budget forms ])."""
        return self.of == "device"

    def resolve(self, no_checkpoint_peak_bytes: int, *, static_bytes: int | None = None,
                device_limit_bytes: int | None = None) -> int:
        """The budget in bytes, given the un-checkpointed step's peak and, for an
        ``"activations:"`` budget, its static bytes; for ``"device"``, the card's
        capacity less what lives outside the allocator (NOTE [ Budget forms ]).

        Raises:
            ValueError: an ``"activations:"`` budget without ``static_bytes``, or a
                ``"device"`` one without ``device_limit_bytes``.
        """
        if self.of == "device":
            if device_limit_bytes is None:
                raise ValueError(message(
                    "Budget.resolve", "budget 'device' needs the card's limit",
                    fix="pass device_limit_bytes= (remat.card_fit.card_budget(...)"
                        ".limit_bytes)"))
            return device_limit_bytes
        if self.bytes_ is not None:
            return self.bytes_
        fraction = self.fraction or 0.0
        if self.of == "peak":
            return int(fraction * no_checkpoint_peak_bytes)
        if static_bytes is None:
            raise ValueError(message("Budget.resolve", f"{self} needs the step's static bytes",
                                     fix="pass static_bytes= (parameters, buffers, gradients, "
                                         "optimizer state and batch at the peak)"))
        static = min(static_bytes, no_checkpoint_peak_bytes)
        return static + int(fraction * (no_checkpoint_peak_bytes - static))

    def other_form(self, budget_bytes: int, no_checkpoint_peak_bytes: int,
                   static_bytes: int) -> str:
        """``budget_bytes`` written in the form not given (NOTE [ Budget forms ]): a
        percentage of the peak for an ``"activations:"`` budget, ``"activations:X%"``
        otherwise.

        Example:
            >>> parse_budget("activations:50%").other_form(700, 1000, 400)
            '70% of the peak'
        """
        if self.of != "peak":
            share = 100.0 * budget_bytes / max(no_checkpoint_peak_bytes, 1)
            return f"{share:.3g}% of the peak"
        active = no_checkpoint_peak_bytes - static_bytes
        share = 100.0 * (budget_bytes - static_bytes) / max(active, 1)
        return f"activations:{share:.3g}%" if share > 0 else \
            "below the static bytes (no activations:X% reaches it)"

    def __str__(self) -> str:
        if self.of == "device":
            return "device"
        if self.fraction is not None:
            prefix = "activations:" if self.of == "activations" else ""
            return f"{prefix}{self.fraction * 100:g}%"
        return f"{self.bytes_} B"


#: What a fractional budget is of (NOTE [ Budget forms ]).
_OF: tuple[str, ...] = ("peak", "activations", "device")


def parse_budget(budget: BudgetLike | Budget) -> Budget:
    """Read a budget: an int (bytes), ``"12GiB"`` / ``"800MB"``, ``"60%"``,
    ``"activations:50%"`` or ``"device"`` (the card: NOTE [ Budget forms ]).

    A percentage is a fraction of the un-checkpointed step's peak
    (``remat.profile(model, batch).peak_bytes`` without checkpointing); it may exceed
    100%, which asks for no checkpointing at all. ``"activations:50%"`` keeps the static
    bytes and half of the rest of that peak (NOTE [ Budget forms ]).

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
    hint = "write budget as bytes (an int), with a unit (\"12GiB\", \"800MB\"), as a " \
           "percentage of the un-checkpointed peak (\"60%\") or of its activations " \
           "(\"activations:50%\"), or \"device\" for the card's own memory"
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise ValueError(message(current_call("remat.plan"), f"cannot read budget {budget!r}",
                                 {"type": type(budget).__name__}, fix=hint))
    of = "peak"
    if isinstance(budget, str) and budget.strip().lower() == "device":
        return Budget(of="device")
    if isinstance(budget, str) and budget.strip().lower().startswith("activations:"):
        of, budget = "activations", budget.strip()[len("activations:"):]
        if not budget.strip().endswith("%"):
            raise ValueError(message(
                current_call("remat.plan"), f"cannot read budget 'activations:{budget}'",
                fix="write activations:X% (a percentage)"))
    if isinstance(budget, str) and budget.strip().endswith("%"):
        text = budget.strip()[:-1].strip()
        try:
            percent = float(text)
        except ValueError:
            raise ValueError(message(current_call("remat.plan"), f"cannot read budget {budget!r}",
                                     fix=hint)) from None
        if not (math.isfinite(percent) and percent > 0):
            raise ValueError(message(
                current_call("remat.plan"), f"budget {budget!r} must be a percentage > 0",
                fix=hint))
        return Budget(fraction=percent / 100.0, of=of)
    try:
        value = parse_bytes(budget)
    except ValueError as exc:
        reason = str(exc).splitlines()[0].removeprefix("parse_bytes: ")
        raise ValueError(message(current_call("remat.plan"), f"cannot read budget {budget!r}",
                                 {"reason": reason}, fix=hint)) from None
    if value <= 0:
        raise ValueError(message(current_call("remat.plan"), "budget must be > 0 bytes",
                                 {"found": repr(budget)}, fix=hint))
    return Budget(bytes_=value)
