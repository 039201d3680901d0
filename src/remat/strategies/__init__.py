"""Checkpointing strategies: a registry of strategy configs and their handlers, and
applying them to a model.

Each strategy is one module (``builtin/``) holding a frozen config (plain data) and its
handler (how it installs, the planner candidates it offers, how the CLI writes it);
:mod:`~remat.strategies.registry` knows them all by name. :func:`apply` puts a strategy,
or a plan's strategy per block, on a model; :func:`trial` tries one and restores.
"""

from remat.recompute import is_recomputing, recomputing
from remat.strategies.apply import (
    AppliedStrategy,
    applied,
    apply,
    apply_decisions,
    preserved_strategy,
    remove,
    trial,
)
from remat.strategies.base import BlockContext, BlockStrategy, Offer, Part, Strategy
from remat.strategies.builtin.sqrt import sqrt_segments
from remat.strategies.handler import BlockHandler, Handler, block_handler_of, handler_of
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
    "BlockHandler",
    "BlockStrategy",
    "Handler",
    "Offer",
    "Part",
    "Strategy",
    "applied",
    "apply",
    "apply_decisions",
    "block_handler_of",
    "default_save_ops",
    "default_strategies",
    "handler_of",
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
    "trial",
    "unregister_strategy",
]
