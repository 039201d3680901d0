"""Planning: the cheapest checkpointing plan whose measured peak fits a budget.

The verbs are :func:`remat.plan` and :func:`remat.auto`; this package holds what they
are made of: candidates measured per kind of block (``candidates.py``), the peak model
(``remat.core.peak``), the integer program (``remat.core.solver``), the closed loop
(``planner.py``) and the :class:`Plan` value with its versioned JSON (``plans.py``).

Example::

    >>> import remat
    >>> from remat.models import build_model, make_batch
    >>> model = build_model("gpt-small")
    >>> p = remat.plan(model, make_batch(model, 8), budget="60%")
    >>> p.measured_peak_bytes <= p.budget_bytes
    True
    >>> remat.Plan.from_json(p.to_json()) == p
    True
"""

from __future__ import annotations

from remat.blocks import NamedBlocks
from remat.planning.candidates import BlockGroup, Candidate
from remat.planning.context import PlanContext, prepare
from remat.planning.loop import measure_decisions
from remat.planning.options import PlanOptions
from remat.planning.planner import auto, plan, plan_step, plan_throughput
from remat.planning.plans import PLAN_FORMAT_VERSION, Plan, ThroughputRow
from remat.planning.seq_len import SeqLenResult, SeqLenRow, SeqLenSearch, plan_seq_len
from remat.planning.throughput import ThroughputSearch

__all__ = [
    "PLAN_FORMAT_VERSION",
    "BlockGroup",
    "Candidate",
    "NamedBlocks",
    "Plan",
    "PlanContext",
    "PlanOptions",
    "SeqLenResult",
    "SeqLenRow",
    "SeqLenSearch",
    "ThroughputRow",
    "ThroughputSearch",
    "auto",
    "measure_decisions",
    "plan",
    "plan_seq_len",
    "plan_step",
    "plan_throughput",
    "prepare",
]
