"""Exceptions raised by remat.

Every remat error subclasses a built-in, so existing ``except ValueError`` /
``except RuntimeError`` handlers keep working::

    RematError (RuntimeError)
    ├── BlocksNotFound (also ValueError)   no repeated blocks / sub-layer found
    ├── StrategyError (also ValueError)    unknown or malformed strategy
    ├── BudgetTooSmall                     no plan reaches the budget
    ├── BatchRejected (also TypeError)     the user's model raised on the batch remat passed
    ├── ParityError                        gradients differ from the reference
    └── ShapeOutsidePlan (also ValueError) a batch outside the shapes a plan was made for

    RematWarning (UserWarning)             a pitfall remat detected (BatchNorm, hooks, ...)

Message format (NOTE [ Error message format ])
----------------------------------------------
Every error remat raises on purpose (these classes, and the ``ValueError`` /
``TypeError`` of input validation) and every :class:`RematWarning` reads the same
way, built by :func:`message`::

    remat.apply: unknown strategy 'fulll'
      valid strategies: none, full, every:N
      fix: pass one of the valid strategies

- the first line names the call the user made (``remat.apply``, ``remat.plan``,
  ``remat simulate`` for the command line, ``Plan`` for a dataclass's own checks)
  and what is wrong, short;
- then one fact per line, indented two spaces, as ``label: value`` (a value of
  several lines goes on indented four spaces);
- the last line, ``fix: ...``, says what to do instead.

A lower layer that does not know which call reached it (a strategy's ``parse``)
raises without the call's name; the entry point adds it with :func:`with_api`.

``KeyError`` prints the repr of its message (``\\n`` escaped, in quotes), so a
``KeyError`` carries the same parts on one line, joined by ``"; "``
(:func:`one_line`): ``Plan.decision: no block 'x'; blocks: a, b; fix: ...``.

NOTE [ Error message format ]
    A user meets a message far from the code that raised it, so each one says which
    of their calls failed (the first line's prefix is that call, never a lower
    layer's or a higher layer's name), what it saw (facts, one per line, values
    included) and what to do (the ``fix:`` line). Build messages with
    :func:`message`, never by hand; keep every fact and the fix when rewording one.
    Tests match the first line's prefix and the fix line, not whole sentences.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, ParamSpec, TypeVar

if TYPE_CHECKING:  # annotations only: remat.core builds its messages with this module
    from remat.core.cost import Category, StepCost

if TYPE_CHECKING:
    from remat.core.shapes import ShapeEnvelope

__all__ = [
    "BatchRejected",
    "BlocksNotFound",
    "BudgetTooSmall",
    "ParityError",
    "RematError",
    "RematWarning",
    "ShapeOutsidePlan",
    "StrategyError",
    "message",
    "one_line",
    "with_api",
]

Facts = Mapping[str, object] | Iterable[tuple[str, object]]


def message(api: str, what: str, facts: Facts = (), fix: str | None = None) -> str:
    """An error or warning message in remat's format (see the module docstring).

    Args:
        api: the call the user made (``"remat.apply"``), or ``""`` where a lower layer
            does not know it (the caller adds it with :func:`with_api`).
        what: what is wrong, short.
        facts: ``label -> value`` (a mapping or ``(label, value)`` pairs), one line each.
        fix: what to do instead. Default: no fix line.

    Example:
        >>> print(message("remat.apply", "unknown strategy 'fulll'",
        ...               {"valid strategies": "none, full"},
        ...               fix="pass one of the valid strategies"))
        remat.apply: unknown strategy 'fulll'
          valid strategies: none, full
          fix: pass one of the valid strategies
    """
    lines = [f"{api}: {what}" if api else what]
    pairs = facts.items() if isinstance(facts, Mapping) else facts
    for label, value in pairs:
        lines.append(f"  {label}: " + str(value).replace("\n", "\n    "))
    if fix:
        lines.append("  fix: " + fix.replace("\n", "\n    "))
    return "\n".join(lines)


def one_line(text: str) -> str:
    """A :func:`message` on one line, its parts joined by ``"; "`` (for ``KeyError``, which
    prints the repr of its message)."""
    return "; ".join(part.strip() for part in text.splitlines())


def with_api(api: str, text: str) -> str:
    """``text`` (a message a lower layer built without the call's name) with ``api``
    in front of its first line; unchanged if it already starts with ``api``."""
    if not api or text.startswith(f"{api}:"):
        return text
    return f"{api}: {text}"


_P = ParamSpec("_P")
_R = TypeVar("_R")
_CALL: ContextVar[str | None] = ContextVar("remat_call", default=None)


def names_the_call(api: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Mark a public entry point, so lower layers name it in their messages.

    The outermost marked call wins (``remat.auto`` reaching ``remat.plan`` reaching
    ``remat.profile`` is ``remat.auto`` to the user); :func:`current_call` reads it.
    """
    def mark(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(fn)
        def marked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            if _CALL.get() is not None:
                return fn(*args, **kwargs)
            token = _CALL.set(api)
            try:
                return fn(*args, **kwargs)
            finally:
                _CALL.reset(token)
        return marked
    return mark


def current_call(default: str) -> str:
    """The public call the user made (see :func:`names_the_call`), else ``default``."""
    return _CALL.get() or default


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
        self.breakdown: dict[Category, int] = dict(breakdown or {})
        self.cost = cost


class BatchRejected(RematError, TypeError):
    """The user's model raised when remat called it on the batch it was given.

    The message says how remat called the model (``model(**batch)``, ``model(*batch)``
    or ``model(batch)``) with each input's name, dtype and shape; the model's own
    exception is chained as ``__cause__``.
    """


class ParityError(RematError):
    """A checkpointed model's gradients differ from the un-checkpointed model's."""


class ShapeOutsidePlan(RematError, ValueError):
    """A training batch's shapes are outside the shapes the applied plan was made for
    (NOTE [ Shape envelope ] in remat/core/shapes.py), so its budget does not hold.

    Attributes:
        shapes: the batch's tensor inputs, path -> shape.
        envelope: the plan's :class:`~remat.core.shapes.ShapeEnvelope`.
    """

    def __init__(self, message: str, *, shapes: Mapping[str, tuple[int, ...]],
                 envelope: ShapeEnvelope) -> None:
        super().__init__(message)
        self.shapes = dict(shapes)
        self.envelope = envelope


class RematWarning(UserWarning):
    """A pitfall remat detected and handled or could not handle (see the message)."""
