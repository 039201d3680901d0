"""Save sets that are optimal for a price of memory: minimum cuts of a region's op graph.

The save-set chains (:func:`remat.strategies.builtin.ops.save_set_chain`) rank entries
one by one. They miss sets whose value lies in a combination: recomputing an RMSNorm's
last ``mul`` frees its output for one pointwise op only while the ``mul`` before it
stays cached, and a rotary embedding's output is cheap to redo only while the
projection feeding it is kept. Here the whole graph decides.

NOTE [ Save sets as minimum cuts ]
    1. The model. Per op call ``o`` of the region's forward (the op graph of NOTE
       [ Dead ops in recompute ]): ``b_o`` bytes of output, ``c_o`` roofline ms. Under
       a save set each call is *kept* (outputs cached, ``b_o`` bytes until backward),
       *recomputed* (``c_o`` ms) or neither. A call autograd packed, a region output,
       or a call that cannot be skipped is kept or recomputed; a recomputed call needs
       each call it reads kept or recomputed. Views and in-place ops are never kept
       (SAC would hold the base; it refuses a cached output mutated later): needed,
       they are recomputed; not needed, a view runs on a placeholder for free (item 5
       of that NOTE). Calls the checkpoint's early stop never reaches when the region
       is fully checkpointed (an MLP's down projection) are left out, as in the chains.
    2. The cut. At a price ``lam`` (ms per byte) the best save set minimizes
       ``lam * kept bytes + recompute ms``. With 0/1 variables ``A_o`` (kept or
       recomputed) and ``R_o`` (recomputed) that is
       ``sum(lam*b_o*A_o + (c_o - lam*b_o)*R_o)``, and every constraint reads "if this
       is 1, that is 1" (``R_o => A_o``; ``R_o => A_p`` for each input ``p``; packed:
       ``A_o = 1``; never kept: ``A_o => R_o``). The optimum is a minimum-weight
       closure, one s-t minimum cut (scipy's maximum flow, capacities scaled to
       integers).
    3. The sweep. Every optimum lies on the lower convex hull of kept bytes vs
       recompute ms; solving where two known vertices' lines cross finds the vertex
       between them, if any (Eisner and Severance), so the whole hull costs about two
       cuts per vertex. The planner offers up to six of them next to the save-set
       chains, less every set another beats in both numbers under the model
       (:func:`with_cut_sets`): each offer is a block run. The model only ranks; the
       planner measures every set it offers, and the tests check that the recompute
       runs exactly the calls the model says.
    4. The cheap end. The vertices keeping the most bytes drop only the outputs whose
       recompute is cheapest per byte freed while their inputs are kept anyway (a
       norm's output that the next matmul saves, a router's ``topk``/``sort``, an
       activation): at a generous budget a plan needs only those, in many blocks.
       Vertices between two offered ones are reached only on the line between them,
       above the hull, so the two keeping the most are always offered and the
       others are spread over the rest of the hull.
    5. The first step. Roofline costs of memory-bound calls are their bytes over the
       bandwidth, so at the cheap end several drops often cost the same per byte: the
       hull's first edge then runs from keeping everything straight to dropping all of
       them at once (a Phi block: its layer norm's 16,896 B for 10.1 ns lie on the line
       to a vertex freeing 164,352 B for 98.1 ns), and a plan that needs a few bytes per
       block must free ten times more. So the set one drop away from the top vertex
       that frees the fewest bytes on that edge (its cost per byte freed no more than
       the edge's) is offered besides the hull's vertices.

Example:
    >>> sets = cut_save_sets(graph, forward_ops, get_device("h100-80gb"))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import sparse
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

from remat.core.op_record import OpRecord
from remat.devices import DeviceSpec
from remat.measure.roofline import op_roofline_ms
from remat.strategies.op_graph import OpGraph
from remat.strategies.sac import call_entry, split_entries

_CAPACITY = 2**28  # finite capacities, scaled to integers, sum to this
_INFINITE = 2**30


@dataclass(frozen=True)
class CutGraph:
    """A region's calls as the cut sees them (NOTE [ Save sets as minimum cuts ]).

    Args:
        names: per call, ``(op name, call index)``.
        out_bytes: per call, bytes of its outputs.
        cost_ms: per call, its roofline time.
        reads: per call, the calls whose outputs it reads.
        needed: calls that must be kept or recomputed.
        keepable: calls whose outputs a save set may cache.
    """

    names: tuple[tuple[str, int], ...]
    out_bytes: tuple[int, ...]
    cost_ms: tuple[float, ...]
    reads: tuple[tuple[int, ...], ...]
    needed: frozenset[int]
    keepable: frozenset[int]

    def solve(self, lam: float) -> tuple[frozenset[int], int, float]:
        """The cheapest assignment at ``lam`` ms per byte: kept calls, their bytes and the
        recompute ms."""
        n = len(self.names)
        source, sink = 2 * n, 2 * n + 1  # call o: node 2*o "available", 2*o+1 "recomputed"
        finite: dict[tuple[int, int], float] = {}
        infinite: set[tuple[int, int]] = set()

        def weight(node: int, w: float) -> None:
            if w < 0:
                finite[(source, node)] = finite.get((source, node), 0.0) - w
            elif w > 0:
                finite[(node, sink)] = finite.get((node, sink), 0.0) + w

        for o in range(n):
            a, r = 2 * o, 2 * o + 1
            weight(a, lam * self.out_bytes[o])
            weight(r, self.cost_ms[o] - lam * self.out_bytes[o])
            infinite.add((r, a))
            if o in self.needed:
                infinite.add((source, a))
            if o not in self.keepable:
                infinite.add((a, r))  # available means recomputed
            infinite.update((r, 2 * p) for p in self.reads[o])
        total = sum(finite.values())
        scale = _CAPACITY / total if total > 0 else 1.0
        edges = {e: max(int(round(w * scale)), 0) for e, w in finite.items()}
        edges.update(dict.fromkeys(infinite, _INFINITE))
        rows, cols = zip(*edges, strict=True) if edges else ((), ())
        capacity = sparse.csr_array(
            (np.fromiter(edges.values(), np.int32, len(edges)), (rows, cols)),
            shape=(2 * n + 2, 2 * n + 2))
        flow = maximum_flow(capacity, source, sink).flow
        residual = (capacity - flow).tocsr()
        residual.data = np.where(residual.data > 0, 1, 0).astype(np.int8)
        residual.eliminate_zeros()
        reached = set(breadth_first_order(residual, source, return_predecessors=False).tolist())
        kept = frozenset(o for o in range(n) if 2 * o in reached and 2 * o + 1 not in reached)
        cost = sum(self.cost_ms[o] for o in range(n) if 2 * o + 1 in reached)
        return kept, sum(self.out_bytes[o] for o in kept), cost

    def recomputed(self, kept: frozenset[int]) -> list[int]:
        """The calls the recompute runs when ``kept`` are cached (NOTE [ Dead ops in
        recompute ], item 2): needed ones and those a running call reads."""
        live = [False] * len(self.names)
        for o in range(len(self.names) - 1, -1, -1):
            if o not in kept and (o in self.needed or live[o]):
                live[o] = True
                for p in self.reads[o]:
                    live[p] = True
        return [o for o in range(len(self.names)) if live[o] and o not in kept]

    def price(self, kept: frozenset[int]) -> tuple[int, float]:
        """``(kept bytes, recompute ms)`` of a kept set under the model."""
        return (sum(self.out_bytes[o] for o in kept),
                sum(self.cost_ms[o] for o in self.recomputed(kept)))

    def hull(self) -> list[tuple[frozenset[int], int, float]]:
        """Every vertex of the lower convex hull of kept bytes vs recompute ms, as
        ``(kept calls, kept bytes, recompute ms)``, most kept bytes first."""
        positive = [self.out_bytes[o] for o in self.keepable if self.out_bytes[o] > 0]
        if not positive:
            return [(frozenset(), *self.price(frozenset()))]
        # At ``low`` no kept set's bytes outweigh the smallest recompute it can save; at
        # ``high`` one kept byte outweighs all recompute.
        low = min((c for c in self.cost_ms if c > 0), default=1.0) / (2 * sum(self.out_bytes))
        high = 2 * (sum(self.cost_ms) + 1.0) / min(positive)
        return _hull(self, (low, *self.solve(low)), (high, *self.solve(high)))


def cut_graph(graph: OpGraph, forward_ops: Sequence[OpRecord], device: DeviceSpec,
              recomputed: Sequence[OpRecord] | None = None) -> CutGraph | None:
    """The region's :class:`CutGraph`, or ``None`` when the op graph and the tracked ops
    do not line up (a call the tracker did not see)."""
    calls: dict[str, list[OpRecord]] = {}
    for record in forward_ops:
        calls.setdefault(record.name, []).append(record)
    redone: dict[str, int] | None = None
    if recomputed is not None:
        redone = {}
        for record in recomputed:
            redone[record.name] = redone.get(record.name, 0) + 1
    ledger = graph.ledger
    counts: dict[str, int] = {}
    for name, *_ in ledger.calls:
        if name is not None:
            counts[name] = counts.get(name, 0) + 1
    kept_index: dict[int, int] = {}  # ledger call -> index in the cut graph
    names: list[tuple[str, int]] = []
    out_bytes: list[int] = []
    cost_ms: list[float] = []
    reads: list[tuple[int, ...]] = []
    needed: set[int] = set()
    keepable: set[int] = set()
    for call, (name, index, call_reads, meta) in enumerate(ledger.calls):
        op: OpRecord | None = None  # ``detach`` (no name): runs, reads, costs nothing
        if name is not None:
            ops = calls.get(name, [])
            if counts[name] > len(ops):
                return None  # the tracker missed a call (it sees more: the block run's loss)
            if redone is not None and index >= redone.get(name, 0):
                continue  # early stop: recompute never reaches it
            op = ops[index]
        node = len(names)
        kept_index[call] = node
        reads.append(tuple(kept_index[p] for p in call_reads if p in kept_index))
        used = call in ledger.packed or call in ledger.escaped or not ledger.read[call]
        if used or op is None or (meta is None and call not in ledger.views):
            needed.add(node)
        names.append((name or "", index))
        out_bytes.append(0 if op is None else op.write_bytes)
        cost_ms.append(0.0 if op is None else op_roofline_ms(op, device))
        if (op is not None and op.write_bytes > 0 and op.read_bytes > 0
                and not name.endswith("_") and call not in ledger.views):
            keepable.add(node)
    return CutGraph(tuple(names), tuple(out_bytes), tuple(cost_ms), tuple(reads),
                    frozenset(needed), frozenset(keepable))


def cut_save_sets(graph: OpGraph, forward_ops: Sequence[OpRecord], device: DeviceSpec, *,
                  recomputed: Sequence[OpRecord] | None = None,
                  max_sets: int = 6) -> list[frozenset[str]]:
    """Save sets on the lower convex hull of kept bytes vs recompute ms.

    Args:
        graph: the region's op graph (``BlockContext.graphs``).
        forward_ops: the region's forward ops without checkpointing, in order.
        device: the cost device (roofline ms per call).
        recomputed: the ops the region's full checkpoint recomputes (calls beyond them are
            never reached). Default: ``None`` (every call is).
        max_sets: at most this many sets, spread over the hull. Default: 6.

    Returns:
        Sets of ``"aten.op#i"`` entries, fewest kept bytes first; none that keeps nothing
        or recomputes nothing. Empty when the graph does not line up with the ops.

    Example:
        >>> cut_save_sets(graph, prof.ops_in("forward"), get_device("h100-80gb"))[0]
        frozenset({'aten.mm#0', 'aten.mm#1', 'aten.mm#2', ...})
    """
    cut = cut_graph(graph, forward_ops, device, recomputed)
    return [] if cut is None else _hull_sets(cut, max_sets)


#: Hull vertices always offered from the cheap end (most kept bytes, least recompute per
#: byte freed; NOTE [ Save sets as minimum cuts ], item 4).
_CHEAP_END = 2


def _hull_sets(cut: CutGraph, max_sets: int) -> list[frozenset[str]]:
    """Up to ``max_sets`` hull vertices that keep something and recompute something, as
    save sets, fewest kept bytes first: the ``_CHEAP_END`` that keep the most, then the
    others spread evenly, the one keeping the least included (item 4 of the NOTE); and
    the first step of the cheap end besides (item 5)."""
    hull = cut.hull()
    useful = [(kept, nbytes, ms) for kept, nbytes, ms in hull if kept and ms > 0]
    if len(useful) > max_sets:
        head = max(min(_CHEAP_END, max_sets - 2), 0)  # room for both ends first
        slots, span = max_sets - head, len(useful) - 1 - head  # spread over useful[head:]
        picks = set(range(head)) | {
            head + (round(i * span / (slots - 1)) if slots > 1 else span) for i in range(slots)}
        useful = [useful[i] for i in sorted(picks)]
    step = _first_step(cut, hull)
    if step is not None and step not in useful:
        useful.insert(0, step)
    return [frozenset(call_entry(*cut.names[o]) for o in kept) for kept, _, _ in useful[::-1]]


def _first_step(cut: CutGraph, hull: list[tuple[frozenset[int], int, float]]
                ) -> tuple[frozenset[int], int, float] | None:
    """The point of ``hull``'s first edge one drop away from the top vertex that frees the
    fewest bytes, where one lies strictly between the edge's ends and recomputes something
    (item 5 of NOTE [ Save sets as minimum cuts ]); else None."""
    if len(hull) < 2:
        return None
    (top, top_bytes, top_ms), (_, next_bytes, next_ms) = hull[0], hull[1]
    if top_bytes <= next_bytes:
        return None
    slope = (next_ms - top_ms) / (top_bytes - next_bytes)
    steps: list[tuple[frozenset[int], int, float]] = []
    for o in top:
        kept = top - {o}
        nbytes, ms = cut.price(kept)
        freed = top_bytes - nbytes
        if kept and 0 < freed < top_bytes - next_bytes \
                and top_ms < ms <= top_ms + slope * freed * (1 + 1e-6):
            steps.append((kept, nbytes, ms))
    return max(steps, key=lambda step: (step[1], -step[2]), default=None)  # fewest freed


_Solution = tuple[float, frozenset[int], int, float]  # lam, kept, kept bytes, recompute ms


def _hull(cut: CutGraph, left: _Solution, right: _Solution, depth: int = 0
          ) -> list[tuple[frozenset[int], int, float]]:
    """Every vertex of the hull between two solutions (Eisner-Severance): solve where
    their lines cross; a new vertex lies below both, else there is none between."""
    _, kept_l, bytes_l, ms_l = left
    _, kept_r, bytes_r, ms_r = right
    ends = [(kept_l, bytes_l, ms_l), (kept_r, bytes_r, ms_r)]
    if kept_l == kept_r:
        return ends[:1]
    if bytes_l <= bytes_r or depth > 32:
        return ends
    lam = (ms_r - ms_l) / (bytes_l - bytes_r)
    middle = (lam, *cut.solve(lam))
    if middle[1] in (kept_l, kept_r) or (
            lam * middle[2] + middle[3] >= lam * bytes_l + ms_l - 1e-12 * (1 + ms_l)):
        return ends
    return _hull(cut, left, middle, depth + 1) + _hull(cut, middle, right, depth + 1)[1:]


def _calls(cut: CutGraph, entries: frozenset[str]) -> frozenset[int]:
    """The calls a save set caches (an op name caches every call of the op)."""
    names, calls = split_entries(entries)
    return frozenset(o for o, (name, index) in enumerate(cut.names)
                     if name in names or (name, index) in calls)


def with_cut_sets(graph: OpGraph | None, forward_ops: Sequence[OpRecord], device: DeviceSpec,
                  chain: Sequence[frozenset[str]], *,
                  recomputed: Sequence[OpRecord] | None = None,
                  max_sets: int = 6) -> list[frozenset[str]]:
    """``chain`` plus the region's minimum-cut sets, less any set another beats under the
    model: no more kept bytes, no more recompute, one of them less (same calls: the
    first). Each set the planner offers is a block run, so the losers are not measured.

    Args:
        graph: the region's op graph; ``None`` returns ``chain`` as it is.
        forward_ops, device, recomputed, max_sets: as for :func:`cut_save_sets`.
        chain: the save-set chain (:func:`remat.strategies.builtin.ops.save_set_chain`).
    """
    cut = None if graph is None else cut_graph(graph, forward_ops, device, recomputed)
    if cut is None:
        return list(chain)
    sets = list(chain) + _hull_sets(cut, max_sets)
    priced: list[tuple[frozenset[str], frozenset[int], tuple[int, float]]] = []
    for entries in sets:
        kept = _calls(cut, entries)
        if all(kept != k for _, k, _ in priced):
            priced.append((entries, kept, cut.price(kept)))

    def beats(a: tuple[int, float], b: tuple[int, float]) -> bool:
        tol = 1e-9 * (1.0 + b[1])
        return a[0] <= b[0] and a[1] <= b[1] + tol and (a[0] < b[0] or a[1] < b[1] - tol)

    return [entries for entries, _, price in priced
            if not any(beats(other, price) for _, _, other in priced)]
