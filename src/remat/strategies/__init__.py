"""Checkpointing strategies: a registry of strategy configs, and applying them to a model.

Each strategy is one module (``builtin/``) holding a frozen config, how it installs, and
the planner candidates it offers; :mod:`~remat.strategies.registry` knows them all by
name. :func:`apply` puts a strategy, or a plan's strategy per block, on a model.
"""

from remat.recompute import is_recomputing, recomputing
from remat.strategies.apply import (
    AppliedStrategy,
    applied,
    apply,
    apply_decisions,
    preserved_strategy,
    remove,
)
from remat.strategies.base import BlockContext, BlockStrategy, Offer, Part, Strategy
from remat.strategies.builtin.sqrt import sqrt_segments
from remat.strategies.registry import (
    STRATEGIES,
    default_strategies,
    parse_strategy,
    register_strategy,
    registered,
    strategy_from_dict,
    strategy_to_dict,
    unregister_strategy,
)
from remat.strategies.sac import COMPUTE_HEAVY_OPS, default_save_ops

__all__ = [
    "COMPUTE_HEAVY_OPS",
    "STRATEGIES",
    "AppliedStrategy",
    "BlockContext",
    "BlockStrategy",
    "Offer",
    "Part",
    "Strategy",
    "applied",
    "apply",
    "apply_decisions",
    "default_save_ops",
    "default_strategies",
    "is_recomputing",
    "parse_strategy",
    "preserved_strategy",
    "recomputing",
    "register_strategy",
    "registered",
    "remove",
    "sqrt_segments",
    "strategy_from_dict",
    "strategy_to_dict",
    "unregister_strategy",
]
