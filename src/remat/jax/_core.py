"""The one door from ``remat.jax`` into remat's framework-neutral core.

Every import of remat's shared internals (solver, peak model, budgets, errors,
profiles, comparison rows, units) made by the JAX backend goes through this
module, so moving those modules (``remat.planning``, ``remat.validation``, ``remat.compare``)
means fixing the paths here only.

NOTE [ Duck-typed candidates ]
    The solver and :class:`PeakModel` read a candidate's ``saved_bytes``,
    ``forward_peak_bytes``, ``backward_peak_bytes`` and ``recompute_ms`` (and
    ``label()``) only. :func:`make_peak_model` hands them JAX candidates under
    the PyTorch candidate's static type until the core is typed against a
    protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from remat.core.budget import Budget, BudgetLike, parse_budget
from remat.core.checks import check_int, decisions_label, opt_int
from remat.core.parity import ParityReport
from remat.core.peak import PeakModel, Window
from remat.core.results import BlockProfile, Profile
from remat.core.rows import ComparisonResult, StrategyRow
from remat.core.solver import min_peak_choice, solve
from remat.errors import BlocksNotFound, BudgetTooSmall, ParityError, RematError, StrategyError
from remat.units import format_bytes, parse_bytes

__all__ = [
    "BlockProfile",
    "BlocksNotFound",
    "Budget",
    "BudgetLike",
    "BudgetTooSmall",
    "ComparisonResult",
    "ParityError",
    "ParityReport",
    "PeakModel",
    "Profile",
    "RematError",
    "StrategyError",
    "StrategyRow",
    "Window",
    "check_int",
    "decisions_label",
    "format_bytes",
    "make_peak_model",
    "min_peak_choice",
    "opt_int",
    "parse_budget",
    "parse_bytes",
    "solve",
]


def make_peak_model(windows: Sequence[Window], tables: Sequence[Sequence[Any]],
                    block_names: Sequence[str], reference_peak_bytes: int) -> PeakModel:
    """A :class:`PeakModel` over duck-typed candidates (see NOTE [ Duck-typed candidates ])."""
    return PeakModel(tuple(windows), cast(Any, tuple(tuple(t) for t in tables)),
                     tuple(block_names), int(reference_peak_bytes))
