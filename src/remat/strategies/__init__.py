"""Checkpointing strategies: apply a strategy or a plan's per-block decisions to a model."""

from remat.strategies.apply import (
    AppliedStrategy,
    applied,
    apply,
    apply_decisions,
    preserved_strategy,
    remove,
)
from remat.strategies.context import is_recomputing, recomputing
from remat.strategies.ops import COMPUTE_HEAVY_OPS, default_save_ops
from remat.strategies.spec import (
    STRATEGIES,
    BlockDecision,
    StrategySpec,
    expand_strategy,
    parse_strategy,
    sqrt_segments,
)

__all__ = [
    "COMPUTE_HEAVY_OPS",
    "STRATEGIES",
    "AppliedStrategy",
    "BlockDecision",
    "StrategySpec",
    "applied",
    "apply",
    "apply_decisions",
    "default_save_ops",
    "expand_strategy",
    "is_recomputing",
    "parse_strategy",
    "preserved_strategy",
    "recomputing",
    "remove",
    "sqrt_segments",
]
