"""remat: trade compute for memory in PyTorch training.

Give remat a model, a batch and a budget in bytes; get a checkpointing plan that
fits, costs the least recompute, and leaves gradients unchanged::

    import remat
    from remat.models import build_model, make_batch

    model = build_model("gpt-small")
    batch = make_batch(model, 8)
    print(remat.profile(model, batch).peak_bytes)      # exact bytes of one step
    plan = remat.auto(model, batch, budget="60%")      # plan, apply, measure
    assert remat.validate(model, batch, plan).passed   # gradients unchanged

Importing remat is light and has no side effects: the public names below load their
subpackage on first use (NOTE [ Lazy public API ]), so ``import remat`` loads neither
torch's distributed/compile machinery nor plotting or Hugging Face libraries, and never
initializes CUDA.

NOTE [ Lazy public API ]
    Each public name maps to the module that defines it (``_EXPORTS``); module
    ``__getattr__`` (PEP 562) imports it on first access and caches it in the module
    dict. The verbs are functions whose names differ from every subpackage
    (``remat.plan`` the function, ``remat.planning`` the package; ``remat.validate`` /
    ``remat.validation``), so importing a subpackage never shadows a verb.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "BatchRejected": "remat.errors",
    "BlockHandler": "remat.strategies.handler",
    "BlockStrategy": "remat.strategies.base",
    "BlocksNotFound": "remat.errors",
    "BudgetTooSmall": "remat.errors",
    "Category": "remat.core.cost",
    "DoctorReport": "remat.core.doctor",
    "Handler": "remat.strategies.handler",
    "ParityError": "remat.errors",
    "ParityReport": "remat.core.parity",
    "Plan": "remat.planning.plans",
    "PlanOptions": "remat.planning.options",
    "Profile": "remat.core.results",
    "RematError": "remat.errors",
    "RematWarning": "remat.errors",
    "STRATEGIES": "remat.strategies.registry",
    "SeqLenResult": "remat.planning.seq_len",
    "SeqLenSearch": "remat.planning.seq_len",
    "ShapeEnvelope": "remat.core.shapes",
    "ShapeOutsidePlan": "remat.errors",
    "Step": "remat.measure.step",
    "StepCost": "remat.core.cost",
    "Strategy": "remat.strategies.base",
    "StrategyError": "remat.errors",
    "ThroughputSearch": "remat.planning.throughput",
    "apply": "remat.strategies.apply",
    "auto": "remat.planning.planner",
    "doctor": "remat.measure.doctor",
    "find_blocks": "remat.blocks",
    "format_bytes": "remat.units",
    "is_recomputing": "remat.recompute",
    "parse_bytes": "remat.units",
    "plan": "remat.planning.planner",
    "plan_compiled": "remat.compiled.plan",
    "plan_seq_len": "remat.planning.seq_len",
    "plan_throughput": "remat.planning.planner",
    "profile": "remat.measure.profile",
    "register_strategy": "remat.strategies.registry",
    "remove": "remat.strategies.apply",
    "validate": "remat.validation.parity",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from remat.blocks import find_blocks
    from remat.compiled.plan import plan_compiled
    from remat.core.cost import Category, StepCost
    from remat.core.doctor import DoctorReport
    from remat.core.parity import ParityReport
    from remat.core.results import Profile
    from remat.core.shapes import ShapeEnvelope
    from remat.errors import (
        BatchRejected,
        BlocksNotFound,
        BudgetTooSmall,
        ParityError,
        RematError,
        RematWarning,
        ShapeOutsidePlan,
        StrategyError,
    )
    from remat.measure.doctor import doctor
    from remat.measure.profile import profile
    from remat.measure.step import Step
    from remat.planning.options import PlanOptions
    from remat.planning.planner import auto, plan, plan_throughput
    from remat.planning.plans import Plan
    from remat.planning.seq_len import SeqLenResult, SeqLenSearch, plan_seq_len
    from remat.planning.throughput import ThroughputSearch
    from remat.recompute import is_recomputing
    from remat.strategies.apply import apply, remove
    from remat.strategies.base import BlockStrategy, Strategy
    from remat.strategies.handler import BlockHandler, Handler
    from remat.strategies.registry import STRATEGIES, register_strategy
    from remat.units import format_bytes, parse_bytes
    from remat.validation.parity import validate


def __getattr__(name: str) -> Any:
    """Import a public name on first use (NOTE [ Lazy public API ])."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'remat' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
