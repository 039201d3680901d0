"""Plan checkpointing for a memory budget: the cheapest plan whose measured peak fits.

``remat.plan`` is this package *and* the function: calling the package calls
:func:`remat.plan.plan` (see NOTE [ Callable package ]).

Example::

    >>> import remat.plan
    >>> from remat.models import build_model, make_batch
    >>> model = build_model("gpt-small")
    >>> p = remat.plan(model, make_batch(model, 8), budget="60%")
    >>> p.measured_peak_bytes <= p.budget_bytes
    True

NOTE [ Callable package ]
    The public API spells planning ``remat.plan(model, batch, budget=...)`` while
    the planner lives in the package ``remat.plan``. Once any code imports
    ``remat.plan.<module>``, Python binds the attribute ``remat.plan`` to this
    package, shadowing a function of the same name. So the package's module class
    is swapped for a subclass of ``types.ModuleType`` whose ``__call__`` is
    :func:`plan`: ``remat.plan(...)`` plans, and ``remat.plan.Plan``,
    ``remat.plan.auto``, ... are still attributes.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from remat.plan.budget import Budget, parse_budget
from remat.plan.candidates import BlockGroup, Candidate
from remat.plan.frontier import Frontier, FrontierPoint, add_plan_row
from remat.plan.peak import PeakModel, Window
from remat.plan.planner import PlanContext, auto, measure_decisions, plan, prepare
from remat.plan.plans import PLAN_FORMAT_VERSION, NamedBlocks, Plan, ThroughputRow

__all__ = [
    "PLAN_FORMAT_VERSION",
    "BlockGroup",
    "Budget",
    "Candidate",
    "Frontier",
    "FrontierPoint",
    "NamedBlocks",
    "PeakModel",
    "Plan",
    "PlanContext",
    "ThroughputRow",
    "Window",
    "add_plan_row",
    "auto",
    "measure_decisions",
    "parse_budget",
    "plan",
    "prepare",
]


class _CallablePackage(types.ModuleType):
    """This package; calling it calls :func:`plan` (NOTE [ Callable package ])."""

    def __call__(self, *args: Any, **kwargs: Any) -> Plan:
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
