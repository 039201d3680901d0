"""The built-in strategies as closed-loop options: a plan never recomputes more than one that fits.

NOTE [ Never worse than manual ]
    The solver picks the cheapest choice the peak model predicts to fit, but the peak
    model and the cost model predict: the closed loop tightens past a choice the
    allocator reads over, the executed recompute can differ from the candidates' sum,
    and a built-in strategy's decision may not be among a block's candidates at all
    (``ops`` keeps every heavy op's output by name, the candidates by call). So after
    the loop has a plan, it weighs the built-in strategies ``remat compare`` shows
    beside a plan (the registry's ``"frontier"`` strategies that decide block by block:
    ``full``, ``every:N``, ``attn``, ``mlp``, ``ops``; with a chunked head decided, each
    with that head) by the same measure the plan reports: the roofline time of the ops
    the applied strategy recomputes, measured, and its fit on the allocator, first step
    included. A strategy is measured only where it could win:

    * its predicted cost is below the best executed cost so far. The prediction reads
      the peak model with each block's decision measured like a candidate: one of its
      candidates, or, for a decision no candidate spells, measured beside them on the
      kind of block (``PlanContext.builtin``: one more block run per kind, outside the
      solver's tables, which stay as they were). A strategy without a prediction (a
      block run that failed) is measured;
    * its predicted peak is within the budget plus the most the peak model over-predicted
      a choice this loop measured (the peak model is exact on the tracked step of a block
      choice, NOTE [ Peak model ], so a prediction beyond that is a measured peak beyond
      the budget).

    The cheapest that fits wins; the plan says which (``Plan.source``) and why. ``sqrt``
    is left out: its regions span blocks, which a plan's per-block decisions cannot say,
    and it recomputes every op ``full`` does and more (each segment's inner block
    outputs), so where ``full`` fits it never wins.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from torch import nn

from remat.blocks import find_sublayer
from remat.errors import BlocksNotFound, StrategyError
from remat.strategies import BlockStrategy, Part, block_handler_of, handler_of, parse_strategy
from remat.strategies.builtin import Full
from remat.strategies.builtin.sublayer import SublayerStrategy
from remat.strategies.head import HEAD_KEY
from remat.strategies.registry import default_strategies

if TYPE_CHECKING:
    from remat.planning.context import PlanContext


@dataclass(frozen=True)
class ManualOption:
    """One built-in strategy as the closed loop weighs it (NOTE [ Never worse than manual ]).

    Args:
        name: the strategy as written (``"every:2"``), with ``+<head>`` when a chunked
            head is decided.
        decisions: what each module gets (the plan's spelling: a sub-layer strategy as
            ``full`` on the sub-layer), the context's head included.
        choice: the same decisions as candidate indices, one per block, where every
            block's decision is one of its candidates; else None.
        predicted_peak_bytes: the peak model's peak for the decisions, where each block's
            decision was measured (a candidate or ``PlanContext.builtin``); else None.
        predicted_ms: the decisions' summed recompute cost, ms, where predicted.
    """

    name: str
    decisions: Mapping[str, BlockStrategy]
    choice: tuple[int, ...] | None
    predicted_peak_bytes: int | None = None
    predicted_ms: float | None = None


def manual_options(ctx: PlanContext, blocks: Sequence[tuple[str, nn.Module]]
                   ) -> list[ManualOption]:
    """The built-in block-by-block strategies for ``blocks`` (the model's, in model
    order), each mapped to a choice where it can be; strategies that do not apply (no
    attention sub-layer, say) are left out.

    Example:
        >>> [o.name for o in manual_options(ctx, step.blocks_found())]
        ['full', 'every:2', 'every:3', 'attn', 'mlp', 'ops']
    """
    modules = dict(blocks)
    out: list[ManualOption] = []
    for name in default_strategies("frontier", num_blocks=len(blocks)):
        if name == "none":
            continue
        strategy = parse_strategy(name)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a sub-layer some blocks lack
                decided = handler_of(strategy).decisions(strategy, blocks)
            if decided is None:  # regions spanning blocks (sqrt)
                continue
            decisions = _plan_spelling(decided, modules)
        except (BlocksNotFound, StrategyError):
            continue
        if any(block_handler_of(d).moves_to_host for d in decisions.values()):
            continue
        if ctx.head is not None:
            decisions[HEAD_KEY] = ctx.head
            name = f"{name}+{ctx.head}"
        out.append(_predicted(ctx, name, decisions))
    return out


def builtin_parts(name: str, block: nn.Module) -> list[tuple[Part, ...]]:
    """Each built-in strategy's decision on block ``name``, as a candidate's parts (paths
    relative to the block): what ``BlockGroup.builtin`` measures.

    Example:
        >>> builtin_parts("layers.0", block)
        [(('', Full()),), (('self_attn', Full()),), (('mlp', Full()),), (('', SelectiveOps()),)]
    """
    out: list[tuple[Part, ...]] = []
    for spelled in default_strategies("frontier", num_blocks=1):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                strategy = parse_strategy(spelled)
                decided = handler_of(strategy).decisions(strategy, [(name, block)])
            if decided is None:
                continue
            decisions = _plan_spelling(decided, {name: block})
        except (BlocksNotFound, StrategyError):
            continue
        parts = tuple((key[len(name) + 1:] if key != name else "", d)
                      for key, d in decisions.items() if not block_handler_of(d).moves_to_host)
        if parts and parts not in out:
            out.append(parts)
    return out


def _plan_spelling(decided: Mapping[str, BlockStrategy], modules: Mapping[str, nn.Module]
                   ) -> dict[str, BlockStrategy]:
    """A sub-layer strategy on a block as ``full`` on its sub-layer, as candidates say it."""
    out: dict[str, BlockStrategy] = {}
    for key, decision in decided.items():
        if isinstance(decision, SublayerStrategy) and key in modules:
            path, _ = find_sublayer(modules[key], decision.name)  # type: ignore[arg-type]
            out[f"{key}.{path}"] = Full()
        else:
            out[key] = decision
    return out


def _predicted(ctx: PlanContext, name: str, decisions: Mapping[str, BlockStrategy]
               ) -> ManualOption:
    """``decisions`` as candidate indices in the solver's tables extended by the built-in
    decisions measured beside them, and what the peak model predicts for them."""
    tables = ctx.peak_model.tables
    builtin = ctx.builtin or tuple(() for _ in tables)
    extended = tuple(tuple(t) + tuple(b) for t, b in zip(tables, builtin, strict=True))
    indices: list[int] = []
    for block, table in zip(ctx.block_names, extended, strict=True):
        mine = {k: d for k, d in decisions.items() if k == block or k.startswith(block + ".")}
        index = next((i for i, c in enumerate(table) if c.decisions_for(block) == mine), None)
        if index is None:
            return ManualOption(name, decisions, None)
        indices.append(index)
    model = replace(ctx.peak_model, tables=extended)
    in_tables = all(i < len(t) for i, t in zip(indices, tables, strict=True))
    return ManualOption(name, decisions, tuple(indices) if in_tables else None,
                        model.predict(indices),
                        sum(t[i].recompute_ms for t, i in zip(extended, indices, strict=True)))
