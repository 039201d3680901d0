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

Importing remat has no side effects (and does not initialize CUDA): the public
names below are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "BlockDecision": "remat.strategies.spec",
    "BlocksNotFound": "remat.errors",
    "BudgetTooSmall": "remat.errors",
    "ParityError": "remat.errors",
    "ParityReport": "remat.validate.parity",
    "Plan": "remat.plan",
    "Profile": "remat.measure",
    "RematError": "remat.errors",
    "RematWarning": "remat.errors",
    "STRATEGIES": "remat.strategies.spec",
    "StrategyError": "remat.errors",
    "apply": "remat.strategies.apply",
    "auto": "remat.plan",
    "find_blocks": "remat.blocks",
    "format_bytes": "remat.units",
    "is_recomputing": "remat.strategies.context",
    "parse_bytes": "remat.units",
    "plan": "remat.plan",
    "profile": "remat.measure",
    "remove": "remat.strategies.apply",
    "validate": "remat.validate.parity",
}

__all__ = [
    "BlockDecision",
    "BlocksNotFound",
    "BudgetTooSmall",
    "ParityError",
    "ParityReport",
    "Plan",
    "Profile",
    "RematError",
    "RematWarning",
    "STRATEGIES",
    "StrategyError",
    "apply",
    "auto",
    "find_blocks",
    "format_bytes",
    "is_recomputing",
    "parse_bytes",
    "plan",
    "profile",
    "remove",
    "validate",
]

if TYPE_CHECKING:
    from remat.blocks import find_blocks
    from remat.errors import (
        BlocksNotFound,
        BudgetTooSmall,
        ParityError,
        RematError,
        RematWarning,
        StrategyError,
    )
    from remat.measure import Profile, profile
    from remat.plan import Plan, auto, plan
    from remat.strategies.apply import apply, remove
    from remat.strategies.context import is_recomputing
    from remat.strategies.spec import STRATEGIES, BlockDecision
    from remat.units import format_bytes, parse_bytes
    from remat.validate.parity import ParityReport, validate


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'remat' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
