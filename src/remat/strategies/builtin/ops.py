"""``ops``: op-level selective checkpointing: keep chosen ops' outputs, recompute the rest.

The strategy's field is a save set (``SelectiveOps(save_ops=frozenset({...}))``); the bare
``"ops"`` keeps every compute-heavy op's output (matmuls, attention, convolutions) and
recomputes pointwise ops and norms (see :mod:`remat.strategies.sac`). For the planner it
offers chains of save sets of increasing size, for the whole block and for each of its
sub-layers (:func:`save_set_chain`).
"""

from __future__ import annotations

import difflib
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from remat.blocks import BlockMethod
from remat.core.op_record import OpRecord
from remat.devices import DeviceSpec
from remat.errors import message, with_api
from remat.measure.roofline import op_roofline_ms
from remat.strategies.base import BlockContext, BlockStrategy, Offer
from remat.strategies.handler import BlockHandler
from remat.strategies.op_graph import OpGraph
from remat.strategies.regions import install_checkpoint
from remat.strategies.sac import COMPUTE_HEAVY_OPS, call_entry, default_save_ops, parse_entry
from remat.strategies.save_cuts import with_cut_sets

_MAX_LIGHT_OPS = 4  # pointwise op names added one by one to a sub-layer's save-set chain
_MAX_LIGHT_OPS_BLOCK = 2  # ... to a whole block's (block-wide pointwise sets rarely pay off)
_EXHAUSTIVE = 3  # sub-layers with at most this many op names try every save set
_CUT_SETS = 6  # minimum-cut save sets offered per region (NOTE [ Dense hull for shallow models ])
_CUT_SETS_SHALLOW = 12  # ... in a model of at most _SHALLOW_BLOCKS blocks
_SHALLOW_BLOCKS = 4

# NOTE [ Dense hull for shallow models ]
#     Each region's minimum-cut save sets are the vertices of its bytes/recompute hull
#     (NOTE [ Save sets as minimum cuts ]); measuring each is a block run, so at most
#     ``_CUT_SETS`` spread along the hull are offered. In a deep model that loses little:
#     the solver gives neighbouring blocks neighbouring vertices and so reaches the levels
#     in between. With a few blocks it cannot, and a vertex left out costs the gap to
#     the next one in every block (benchmarks/planner.py measures it on shallow
#     held-out decoders), so shallow models are offered the whole hull. Block runs are
#     per kind of block, so the extra runs weigh most where a step is longest (deep
#     models), which keep the sparse hull.


def cut_sets_for(model_blocks: int) -> int:
    """How many minimum-cut save sets to offer per region of a model with ``model_blocks``
    blocks (0: unknown; NOTE [ Dense hull for shallow models ]).

    Example:
        >>> cut_sets_for(2), cut_sets_for(32)
        (12, 6)
    """
    return _CUT_SETS_SHALLOW if 0 < model_blocks <= _SHALLOW_BLOCKS else _CUT_SETS


_OP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*")


def check_op_name(name: str) -> None:
    """Refuse a save-set op name that is not ``<namespace>.<op>``, or an unknown aten op.

    A name that matches no op saves nothing: the region silently recomputes
    everything. Only ``aten`` names are looked up (other namespaces may be registered
    later, by importing their library).

    Raises:
        ValueError: the name is malformed or names no aten op; the message suggests
            the closest aten op names.
    """
    if not _OP_NAME.fullmatch(name):
        raise ValueError(message(
            "", f"{name!r} is not an op name",
            fix="write an aten overload packet such as 'aten.mm' (or 'aten.mm#2' for its "
                "third call in the region)"))
    namespace, op = name.split(".")
    if namespace == "aten" and not hasattr(torch.ops.aten, op):
        known = {n.split("::", 1)[1].split(".", 1)[0]
                 for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")}
        close = difflib.get_close_matches(op, sorted(known), n=3)
        raise ValueError(message(
            "", f"unknown aten op {name!r}",
            {"why": "no region runs it, so saving it would save nothing and recompute "
                    "everything"},
            fix=f"did you mean {', '.join('aten.' + c for c in close)}?" if close else
                "write the name of an aten op (torch.ops.aten.<op>)"))


@dataclass(frozen=True)
class SelectiveOps(BlockStrategy):
    """Keep the outputs of compute-heavy ops (or of ``save_ops``), recompute the rest.

    Buys most of ``full``'s memory for a fraction of its recompute: matmul outputs are
    a small share of a block's bytes and the costliest to redo.

    Args:
        save_ops: aten overload-packet names whose outputs are kept, e.g.
            ``frozenset({"aten.mm", "aten.addmm"})``, or single calls of one
            (``"aten.mm#2"``: the third ``aten.mm`` of the region's forward); any iterable
            of names is turned into a frozenset. ``None`` keeps every compute-heavy op's
            output (:func:`~remat.strategies.sac.default_save_ops`). Default: ``None``.

    Example:
        >>> remat.apply(model, "ops")
        >>> SelectiveOps(frozenset({"aten.mm"})).label()
        'ops[aten.mm]'
    """

    name: ClassVar[str] = "ops"

    save_ops: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if self.save_ops is None:
            return
        if isinstance(self.save_ops, str):
            raise ValueError(message("SelectiveOps", "save_ops must be a set of op names",
                                     {"found": f"the string {self.save_ops!r}"},
                                     fix=f"write frozenset({{{self.save_ops!r}}})"))
        object.__setattr__(self, "save_ops", frozenset(self.save_ops))
        for entry in self.save_ops:
            try:
                check_op_name(parse_entry(entry)[0])
            except ValueError as exc:
                raise ValueError(with_api("SelectiveOps", f"save_ops: {exc}")) from None

    def label(self) -> str:
        """``"ops"``, or ``"ops[aten.mm,aten.addmm]"`` with a save set."""
        if self.save_ops is None:
            return self.name
        return f"{self.name}[" + ",".join(sorted(self.save_ops)) + "]"



class SelectiveOpsHandler(BlockHandler[SelectiveOps]):
    """A selective-checkpoint region keeping the save set; offers save-set chains."""

    summary: ClassVar[str] = "keep matmul/attention outputs, recompute the rest"

    def install_block(self, config: SelectiveOps, block: nn.Module) -> list[nn.Module]:
        save_ops = config.save_ops if config.save_ops is not None else default_save_ops()
        install_checkpoint(block, label=config.label(), save_ops=save_ops)
        return [block]

    def install_method(self, config: SelectiveOps, method: BlockMethod) -> list[nn.Module]:
        save_ops = config.save_ops if config.save_ops is not None else default_save_ops()
        install_checkpoint(method.owner, label=config.label(), save_ops=save_ops,
                           method=method.name)
        return [method.owner]

    def offers(self, config: SelectiveOps, context: BlockContext) -> list[Offer]:
        """Block-wide save-set chains, then each sub-layer's (NOTE [ Candidate decisions ]
        in remat.planning.candidates, items 3 and 5)."""
        chain = save_set_chain(context.forward_ops, context.cost_device,
                               max_light_ops=_MAX_LIGHT_OPS_BLOCK,
                               recomputed=context.recomputed.get(""),
                               graph=context.graphs.get(""))
        chain = _with_cuts(context, "", context.forward_ops, chain)
        offers = [Offer((("", SelectiveOps(s)),)) for s in chain]
        for kind, (path, ops) in context.sublayers.items():
            sets = save_set_chain(ops, context.cost_device, exhaustive_up_to=_EXHAUSTIVE,
                                  recomputed=context.recomputed.get(kind),
                                  graph=context.graphs.get(kind))
            for s in _with_cuts(context, kind, ops, sets):
                offers.append(Offer(((path, SelectiveOps(s)),), sublayer=kind))
        return offers


def _with_cuts(context: BlockContext, region: str, ops: Sequence[OpRecord],
               chain: list[frozenset[str]]) -> list[frozenset[str]]:
    """The chain with the region's minimum-cut save sets (NOTE [ Save sets as minimum
    cuts ]), less the sets another beats."""
    return with_cut_sets(context.graphs.get(region), ops, context.cost_device, chain,
                         recomputed=context.recomputed.get(region),
                         max_sets=cut_sets_for(context.model_blocks))


def _is_attention(op_name: str) -> bool:
    return "attention" in op_name


def _add_freed(graph: OpGraph, calls: dict[str, list[OpRecord]], redone: dict[str, int] | None,
               cost_ms: dict[str, float], device: DeviceSpec) -> None:
    """Add to each entry's cost the recompute time of the calls caching it frees."""
    counts: dict[str, int] = {}
    for name, *_ in graph.ledger.calls:
        counts[name] = counts.get(name, 0) + 1
    for entry in cost_ms:
        for name, index in graph.freed([entry]):
            ops = calls.get(name, [])
            if counts[name] != len(ops) or (redone is not None and index >= redone.get(name, 0)):
                continue  # the tracker saw other calls, or recompute never reaches it
            cost_ms[entry] += op_roofline_ms(ops[index], device)


def save_set_chain(forward_ops: Sequence[OpRecord], device: DeviceSpec, *,
                   max_light_ops: int = _MAX_LIGHT_OPS,
                   exhaustive_up_to: int = 0,
                   recomputed: Sequence[OpRecord] | None = None,
                   graph: OpGraph | None = None) -> list[frozenset[str]]:
    """Save sets of increasing size for op-level checkpointing (NOTE [ Candidate decisions ], 3).

    Compute-heavy ops (matmuls, attention) called more than once in the region enter
    the sets call by call (``"aten.mm#2"``, see ``remat.strategies.sac``), so the
    cheapest matmuls per byte can be recomputed while the others are kept; pointwise
    ops enter by name. A set holding every call of an op names the op instead.

    Args:
        forward_ops: the region's forward ops without checkpointing, in order.
        device: the cost device (ranks entries by roofline time per output byte).
        max_light_ops: at most this many pointwise op names are added. Default: 4.
        exhaustive_up_to: with at most this many entries, every proper subset follows
            the chain. Default: 0 (the chain only).
        recomputed: the ops the region's backward recomputes when it is fully
            checkpointed (``BlockContext.recomputed``). Recomputation stops once every
            saved tensor is back, so calls missing from it (a region's last matmul, say)
            are never recomputed: keeping their outputs costs bytes and saves nothing, and
            they are left out of every set. Default: ``None`` (every call counts).
        graph: the region's :class:`~remat.strategies.op_graph.OpGraph`: an entry's value
            adds the recompute time of the calls caching it frees (their outputs feed only
            it; the recompute skips them). Default: ``None`` (own time only).

    Returns:
        Non-empty save sets: the chain, each a superset of the previous one, whose last one
        leaves at least one entry to recompute; then the other subsets, if exhaustive.

    Example:
        >>> chain = save_set_chain(prof.ops_in("forward"), get_device("h100-80gb"))
        >>> chain[0]  # attention kept first, dropped last
        frozenset({'aten._scaled_dot_product_flash_attention_for_cpu'})
    """
    calls: dict[str, list[OpRecord]] = {}
    excluded: set[str] = set()
    for op in forward_ops:
        calls.setdefault(op.name, []).append(op)
        if op.name.endswith("_") or op.read_bytes == 0:
            # In-place ops (aten's trailing underscore) cannot be saved: SAC refuses a cached
            # output that is mutated later. Factories (no input) cost nothing to redo.
            excluded.add(op.name)
    redone: dict[str, int] = {}  # calls of each op recomputed (the first ones: a prefix)
    for op in recomputed if recomputed is not None else ():
        redone[op.name] = redone.get(op.name, 0) + 1
    out_bytes: dict[str, int] = {}
    cost_ms: dict[str, float] = {}
    entries_of: dict[str, list[str]] = {}
    for name, ops in calls.items():
        if name in excluded:
            continue
        per_call = len(ops) > 1 and (name in COMPUTE_HEAVY_OPS or _is_attention(name))
        entries = [call_entry(name, i) for i in range(len(ops))] if per_call else [name]
        groups = [list(enumerate(ops))] if not per_call else [[c] for c in enumerate(ops)]
        limit = redone.get(name, 0) if recomputed is not None else len(ops)
        for entry, group in zip(entries, groups, strict=True):
            written = sum(op.write_bytes for _, op in group)
            cost = sum(op_roofline_ms(op, device) for i, op in group if i < limit)
            if written > 0 and cost > 0:
                out_bytes[entry], cost_ms[entry] = written, cost
                entries_of.setdefault(name, []).append(entry)
    if graph is not None:
        _add_freed(graph, calls, redone if recomputed is not None else None, cost_ms, device)
    items = list(out_bytes)

    def value(e: str) -> tuple[float, int]:
        return (-cost_ms[e] / out_bytes[e], out_bytes[e])

    def kind(e: str) -> str:
        return parse_entry(e)[0]

    attention = sorted((e for e in items if _is_attention(kind(e))), key=value)
    heavy = sorted((e for e in items if kind(e) in COMPUTE_HEAVY_OPS
                    and not _is_attention(kind(e))), key=value)
    light = sorted((e for e in items if kind(e) not in COMPUTE_HEAVY_OPS
                    and not _is_attention(kind(e))), key=value)[:max_light_ops]
    order = attention + heavy + light
    whole = {name: frozenset(es) for name, es in entries_of.items()
             if len(es) == len(calls[name]) and len(es) > 1}

    def named(entries: Sequence[str]) -> frozenset[str]:
        chosen = set(entries)
        for name, es in whole.items():  # every call of an op: name the op
            if es <= chosen:
                chosen = (chosen - es) | {name}
        return frozenset(chosen)

    total = len(items)
    chain: list[frozenset[str]] = []
    for k in range(1, len(order) + 1):
        if k >= total:  # saving every op's output is "none" with extra steps
            break
        chain.append(named(order[:k]))
    if 1 < total <= exhaustive_up_to:  # few entries: every proper subset, chain first
        for k in range(1, total):
            for subset in itertools.combinations(order, k):
                if named(subset) not in chain:
                    chain.append(named(subset))
    return chain
