"""Which op calls a save set frees from recompute, for ranking save-set entries.

SAC's recompute skips op calls nothing needs once the save set is cached (NOTE
[ Dead ops in recompute ] in ``remat.strategies.dead_ops``): caching Phi's ``tanh``
in ``gelu_new`` also frees the ``pow``, ``mul``, ``add``, ``mul`` before it. Ranking
entries by their own recompute time per byte misses that, so the save-set chains
(NOTE [ Candidate decisions ] in remat.planning.candidates, item 3) add the time of the calls an
entry frees. :func:`block_graphs` records the dependencies once per kind of block, on
the fake copy, with the same ledger the recompute uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from remat.blocks import Sublayer
from remat.measure.attribution import hook_calls
from remat.measure.dispatch_modes import direct_dispatch
from remat.strategies.dead_ops import Ledger
from remat.strategies.op_kinds import classify
from remat.strategies.sac import op_name, split_entries


@dataclass(frozen=True)
class OpGraph:
    """One region's forward op calls, as the recompute's ledger sees them.

    Args:
        ledger: calls keyed by op name (``"aten.mul"``) and call index in the region,
            what each reads, and which outputs were packed, read or escaped the region.
    """

    ledger: Ledger

    def freed(self, entries: Iterable[str]) -> list[tuple[str, int]]:
        """``(op name, call index)`` of the calls that become dead when ``entries`` are
        cached (and nothing else is)."""
        names, calls = split_entries(entries)
        keys = [c[:2] for c in self.ledger.calls]

        def cached(call: int) -> bool:
            name, index = keys[call]
            return name in names or (name, index) in calls

        return [keys[c] for c in self.ledger.dead_calls(cached)]


@direct_dispatch
class _Recorder(TorchDispatchMode):
    def __init__(self, ledger: Ledger) -> None:
        super().__init__()
        self.ledger = ledger
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = classify(func)
        if kind == "unknown":
            self.ledger.broken = True
        if kind in ("metadata", "unknown") or self.ledger.broken:
            return out
        name = op_name(func)
        index = self.counts.get(name, 0)
        self.counts[name] = index + 1
        try:
            self.ledger.record(kind == "skippable", name, index, args, kwargs, out,
                               view=kind == "view")
        except Exception:  # what the recompute's ledger gives up on (tensors without storage)
            self.ledger.broken = True
        return out


def _region(ledger: Ledger, start: int, end: int) -> OpGraph:
    """The calls ``[start, end)`` as a region of their own (later reads: escaped)."""
    part = Ledger(None)
    counts: dict[str, int] = {}
    for name, _, reads, meta in ledger.calls[start:end]:
        index = counts.get(name, 0)
        counts[name] = index + 1
        part.calls.append((name, index, [p - start for p in reads if p >= start], meta))
        part.read.append(False)
    for call in range(start, len(ledger.calls)):
        for p in ledger.calls[call][2]:
            if start <= p < end:
                part.read[p - start] = True
                if call >= end:
                    part.escaped.add(p - start)
    part.packed = {c - start for c in ledger.packed if start <= c < end}
    # Early stop ends a region's recompute at its own last pack (NOTE [ Dead ops in
    # recompute ], item 6). A pack between call end - 1 and the next call may be the
    # caller's (saving the region's output): counted, it keeps every call live.
    inside = [p for p in ledger.pack_points or () if start - 1 <= p < end]
    part.last_pack = max(inside) - start if inside else -1
    part.early_stop = ledger.early_stop
    part.views = {c - start for c in ledger.views if start <= c < end}
    part.escaped |= {c - start for c in ledger.escaped if start <= c < end}
    return OpGraph(part)


def block_graphs(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 sublayers: Mapping[str, Sublayer]) -> dict[str, OpGraph]:
    """Per region (``""``: the block, else each sub-layer kind: a module or a method), its
    :class:`OpGraph`.

    Runs ``block``'s forward once with grad enabled (call it under the fake copy's
    mode); regions whose forward the ledger cannot follow are left out.
    """
    ledger = Ledger(None)
    ledger.pack_points = []  # each region's own last pack (``_region``)
    spans: dict[str, list[int]] = {kind: [] for kind in sublayers}
    handles = []
    for kind, target in sublayers.items():
        handles += hook_calls(target, lambda *_, kind=kind: spans[kind].append(len(ledger.calls)),
                              lambda *_, kind=kind: spans[kind].append(len(ledger.calls)))
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                lambda t: t, lambda t: t):
            ledger.start()
            try:
                with _Recorder(ledger):
                    out = block(*args, **kwargs)
                ledger.mark_outputs(out)
            finally:
                ledger.stop()
    finally:
        for handle in handles:
            handle.remove()
    if ledger.broken:
        return {}
    graphs = {"": _region(ledger, 0, len(ledger.calls))}
    for kind, span in spans.items():
        if len(span) == 2:  # called once
            graphs[kind] = _region(ledger, span[0], span[1])
    return graphs
