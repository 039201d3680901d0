"""Lower bounds on the recompute any plan needs to fit a budget (benchmarks/planner.py).

:func:`forward_graph` records one forward (loss included) as a graph over storages;
:func:`knapsack_bound_ms` and :func:`lp_bound_ms` bound the recompute cost of every plan that
frees a given number of bytes (NOTE [ Lower bound ] in benchmarks/planner.py);
:func:`integer_bound_ms` solves the same program in integers, to measure the LP's
integrality gap.

NOTE [ Forward graph over storages ]
    A node is a storage the forward creates (views share their base's node), with its bytes.
    A group is the set of ops that write a storage: the op that created it, every op that
    later writes it in place (a dropout mask's ``bernoulli_``, a mixture of experts'
    ``index_add_``), merged transitively, and every output of those ops. Recomputing any
    output of a group means re-running all of the group's ops (a storage's content is the
    result of all its writes), and re-running them once yields all their outputs, so the
    group, not the op, carries the cost and one LP variable. A group's inputs are the
    storages its ops read, less its own outputs. Parameters, buffers, the batch and every
    storage made outside the recording (no producer seen) are free: always available, no
    node. Inputs an op reads only for their shape (``empty_like``, ``new_zeros``, ...) are
    not inputs. Every output is held until the recording ends, so no address is reused and
    a storage's address identifies it.

    The loss (every op after the output head returns) costs what its ops cost, in a plan
    without a chunked head as anywhere else: freeing a storage of the loss means running
    its ops again. A chunked head re-runs the head's projection and the whole loss, slice
    by slice, in backward: its program (NOTE [ A chunked head in the bound ]) pays them
    once (``loss_ms``, the head's groups forced) and prices the loss's groups at 0
    (``ForwardGraph.chunked_cost_ms``).

NOTE [ A chunked head in the bound ]
    NOTE [ Lower bound ]'s premise counts only saved storages as what a plan can free, the
    rest of the un-checkpointed peak staying. A chunked head frees more: the loss's
    backward never holds the whole logits' gradient, so where the step peaks in the loss's
    backward the backward temporaries there shrink as well (a plan of OLMo 2 at 25% fitted
    with less recompute than the saved-storage program asked for). So the bound is the
    cheaper of two programs: the one above, and one with the head's groups re-run and the
    loss's cost added (a chunked head re-runs the whole projection and the loss, slice by
    slice, in backward) and ``head_freed_bytes`` fewer bytes to free. The second rests on
    the end of forward, where any plan holds at least the bytes alive before the step and
    what it kept, within the budget: it frees at least ``start + saved - budget``, which is
    ``need`` less ``head_freed_bytes = peak - start - saved`` (what benchmarks/planner.py
    passes: whatever the un-checkpointed peak holds besides those, temporaries and
    gradients alike). Each program bounds the plans of its kind, so their minimum bounds
    every plan. The greedy bound splits the same way, the head's groups already paid in
    the second.

    A second moment binds a chunked plan too: the end of the head's backward, before the
    first backward of the rest of the model. Nothing the rest of the model kept has been
    released by then (its backward needs the gradient the head's produces, so it cannot
    have started), and the head's backward has made its parameters' gradients and its
    input's gradient (``ForwardGraph.head_grad_bytes``: the whole of each, summed over
    every slice), which stay alive past that moment. What the head's and the loss's
    backward may release is left out: the storages their ops wrote or read (the tail
    storages). So a chunked plan also holds ``start + kept outside the tail + head
    gradients`` within the budget: the second program gets that row as well, with
    ``head_grad_bytes`` more to free than at the end of forward, outside the tail. Where
    even freeing all of them is not enough, no chunked plan fits and that program is
    infeasible (its bound infinite). Gradients of the rest of the model, and the head's
    backward temporaries, are not asked for: they are not alive at that moment in every
    plan, or not known to be.

NOTE [ Moments of backward in the bound ]
    Both programs above ask the plan to fit at one or two moments. Every moment of
    backward binds it as well. The recording's backward (of the un-checkpointed step)
    notes, for each saved storage, when its first unpack came (the first backward node to
    read it), and the bytes of the storages backward's ops had made and not yet released
    by then: parameter and activation gradients, and whatever else backward holds
    (``_BackwardBytes``; views of parameters or of the forward's storages are not new),
    and the same just after each op of backward. A plan runs the same backward nodes in
    the same order on the same gradients (checkpointing adds recompute before a node, it
    does not reorder or change them), so
    just before the k-th first unpack it holds those bytes too, and a storage it kept from
    the end of forward whose first unpack comes at or after k is still alive: its holders
    in the plan are some of the nodes that packed it in the recording (or a checkpoint
    that releases its region's inputs only after the region's nodes ran), none of which
    has run backward yet; the storage being unpacked is alive too, kept or just
    recomputed, as its node reads it. So each moment gives a row ``sum of b_t s_t over the
    storages unpacked later <= budget - start - bytes backward made - the unpacked
    storage's bytes``, where ``budget - start`` is ``saved - need + head_freed_bytes``. A
    node's own peak comes while it runs (its gradients made, its inputs not yet
    released), so the moment just after each op of backward gives a row too, over the
    storages not unpacked yet, less the bytes backward made then. A moment whose storages
    are among an earlier one's and whose bytes are no more is implied by it and left
    out. A chunked plan's head runs its backward otherwise, so its program takes only the
    moments where the storage last unpacked lies outside the tail, each row over storages
    outside the tail (by then the head's backward is done in the plan as
    in the recording, and holds what it left: its parameters' and its input's gradients).
    A row no plan can meet makes its program infeasible, its bound infinite. Where the
    un-checkpointed step itself would break a row (the recording counted bytes the step
    does not hold) the bound refuses to run; without ``head_freed_bytes`` the bytes alive
    before the step are unknown and no moment is used.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch
from scipy.optimize import Bounds, LinearConstraint, linprog, milp
from scipy.sparse import coo_matrix, csr_matrix
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from remat.core.op_record import OpRecord
from remat.devices import get_device
from remat.measure.flops import op_flops, op_traffic
from remat.measure.roofline import op_roofline_ms

_aten = torch.ops.aten
#: Ops whose output depends on their tensor inputs' shape only.
_SHAPE_ONLY = frozenset({
    _aten.empty_like, _aten.zeros_like, _aten.ones_like, _aten.full_like, _aten.rand_like,
    _aten.randn_like, _aten.randint_like, _aten.new_empty, _aten.new_zeros, _aten.new_ones,
    _aten.new_full, _aten.new_empty_strided})


@dataclass(frozen=True)
class ForwardGraph:
    """One forward as groups of ops over storages (NOTE [ Forward graph over storages ]).

    Attributes:
        nbytes: bytes of each storage node.
        group_of: the group that writes each storage node.
        cost_ms: roofline cost of each group (all its ops, the loss's included), ms.
        inputs: the storage nodes each group reads (not its own outputs).
        saved: the storage nodes autograd saves for backward.
        ops: the op names of each group, for tests and diagnosis.
        head_groups: the groups of the output head's ops (its projection), empty when no
            head was given (NOTE [ A chunked head in the bound ]).
        loss_ms: roofline cost of the ops after the head (the loss), ms.
        tail_groups: the groups of the head's ops and every op after it (the loss).
        head_grad_bytes: bytes of the gradients the head's backward leaves alive: those
            of its parameters that require one, and its input's.
        unpacks: per saved storage read in backward, in the order of their first unpack,
            ``(storage node, bytes of the storages backward made that are alive then)``
            (NOTE [ Moments of backward in the bound ]).
        op_moments: per op of backward, ``(how many of unpacks came before it, bytes of the
            storages backward made that are alive just after it)``.
    """

    nbytes: tuple[int, ...]
    group_of: tuple[int, ...]
    cost_ms: tuple[float, ...]
    inputs: tuple[tuple[int, ...], ...]
    saved: frozenset[int]
    ops: tuple[tuple[str, ...], ...]
    head_groups: frozenset[int] = frozenset()
    loss_ms: float = 0.0
    tail_groups: frozenset[int] = frozenset()
    head_grad_bytes: int = 0
    unpacks: tuple[tuple[int, int], ...] = ()
    op_moments: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if len(self.nbytes) != len(self.group_of):
            raise ValueError("ForwardGraph: nbytes and group_of differ in length")
        if len(self.cost_ms) != len(self.inputs) or len(self.ops) != len(self.cost_ms):
            raise ValueError("ForwardGraph: cost_ms, inputs and ops differ in length")

    @property
    def saved_bytes(self) -> int:
        """Bytes of the saved storage nodes (what ``none`` keeps for backward)."""
        return sum(self.nbytes[t] for t in self.saved)

    @property
    def chunked_cost_ms(self) -> tuple[float, ...]:
        """``cost_ms`` as a chunked head's program prices it: the loss's groups at 0 (it pays
        ``loss_ms`` for them; NOTE [ Forward graph over storages ])."""
        loss = self.tail_groups - self.head_groups
        return tuple(0.0 if g in loss else c for g, c in enumerate(self.cost_ms))

    @property
    def tail_storages(self) -> frozenset[int]:
        """Storage nodes the head's and the loss's backward may release: those their ops
        wrote and those they read (NOTE [ A chunked head in the bound ])."""
        tail = self.tail_groups
        return frozenset(t for t, g in enumerate(self.group_of) if g in tail) \
            | frozenset(u for g in tail for u in self.inputs[g])


class _BackwardBytes(TorchDispatchMode):
    """Bytes of the storages backward's ops made that are alive now (``live_bytes``):
    gradients and temporaries, not the forward's storages or ``forward`` addresses."""

    def __init__(self, forward: set[int], on_op: Callable[[], None]) -> None:
        super().__init__()
        self.forward = forward
        self.on_op = on_op  # called after each op, its outputs counted
        self.live_bytes = 0
        self._alive: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def _freed(self, key: int, nbytes: int, _: object) -> None:
        self.live_bytes -= nbytes
        self._alive.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)  # NOTE [ Storage identity and frees ] in remat/measure/ledger.py
            if key in self._alive or storage.data_ptr() in self.forward:
                continue
            self.live_bytes += storage.nbytes()
            self._alive[key] = weakref.ref(storage, partial(self._freed, key, storage.nbytes()))
        self.on_op()
        return out


class _Recorder(TorchDispatchMode):
    """Records ops, the storages they create, read and write (``forward_graph``)."""

    def __init__(self, device: str, free: set[int]) -> None:
        super().__init__()
        self.spec = get_device(device)
        self.free = free
        self.node: dict[int, int] = {}  # address -> storage node
        self.nbytes: list[int] = []
        self.creator: list[int] = []  # storage node -> op index
        self.op_ms: list[float] = []
        self.op_name: list[str] = []
        self.reads: list[set[int]] = []
        self.writes: list[set[int]] = []  # storages written in place
        self.held: list[torch.Tensor] = []
        self.after_head = False  # the loss
        self.in_head = False
        self.head_ops: list[int] = []
        self.tail_ops: list[int] = []  # the head's and the loss's
        self.loss_ms = 0.0

    def _nodes(self, tensors: Iterable[torch.Tensor]) -> set[int]:
        keys = (t.untyped_storage().data_ptr() for t in tensors)
        return {self.node[k] for k in keys if k in self.node}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        in_keys = {t.untyped_storage().data_ptr() for t in ins}
        aliases = bool(outs) and all(t.untyped_storage().data_ptr() in in_keys for t in outs)
        written = [t for i, a in enumerate(func._schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write
                   for t in tree_leaves(args[i] if i < len(args) else kwargs.get(a.name))
                   if isinstance(t, torch.Tensor)]
        fresh = []
        for t in outs:
            key = t.untyped_storage().data_ptr()
            if key and key not in in_keys and key not in self.free and key not in self.node:
                fresh.append(t)
        writes = self._nodes(written)
        if not fresh and not writes:
            return out  # a view, or an op that writes only free storages
        read, write, dtype_bytes = op_traffic(func, ins, outs, aliases_only=aliases)
        flops = op_flops(func.overloadpacket, args, kwargs, out)
        index = len(self.op_ms)
        if self.in_head:
            self.head_ops.append(index)
        if self.in_head or self.after_head:
            self.tail_ops.append(index)
        ms = op_roofline_ms(OpRecord(str(func.overloadpacket), "forward", flops, read, write,
                                     None, dtype_bytes), self.spec)
        self.op_ms.append(ms)
        self.loss_ms += ms if self.after_head else 0.0
        self.op_name.append(str(func.overloadpacket))
        self.reads.append(set() if func.overloadpacket in _SHAPE_ONLY else self._nodes(ins))
        self.writes.append(writes)
        for t in fresh:
            storage = t.untyped_storage()
            if storage.data_ptr() in self.node:
                continue  # two outputs on one storage
            self.node[storage.data_ptr()] = len(self.nbytes)
            self.nbytes.append(storage.nbytes())
            self.creator.append(index)
            self.held.append(t)
        return out


def _find(parent: list[int], i: int) -> int:
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i


def forward_graph(run: Callable[[], torch.Tensor], free: Iterable[torch.Tensor],
                  device: str = "h100-80gb", head: torch.nn.Module | None = None
                  ) -> ForwardGraph:
    """Record ``run()`` (a forward returning the loss) and its backward's saved storages.

    Runs the forward under a dispatch mode and saved-tensor hooks, then the backward (the
    caller clears gradients). Holds every storage the forward creates until it returns.

    Args:
        run: the forward, returning a scalar loss.
        free: tensors always available (parameters, buffers, the batch).
        device: the roofline's device figures (``remat.devices``).
        head: the output projection; the ops after it returns (the loss) cost 0. Default:
            None (every op costs its roofline time).

    Example::

        graph = forward_graph(lambda: default_loss(call_model(model, batch)),
                              [*model.parameters(), *model.buffers(), *batch.values()])
    """
    free_tensors = list(free)
    free_keys = {t.untyped_storage().data_ptr() for t in free_tensors}
    recorder = _Recorder(device, free_keys)
    saved: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key in recorder.node:
            saved.add(recorder.node[key])
        return t

    head_grad_bytes = 0

    def enter(module: torch.nn.Module, args: tuple[object, ...]) -> None:
        nonlocal head_grad_bytes
        recorder.in_head = True
        grads: list[torch.Tensor] = [p for p in module.parameters() if p.requires_grad]
        grads += [t for t in args[:1] if isinstance(t, torch.Tensor) and t.requires_grad]
        head_grad_bytes = sum(t.numel() * t.element_size() for t in grads)

    def done(*_: object) -> None:
        recorder.in_head = False
        recorder.after_head = True

    # NOTE [ Moments of backward in the bound ]: first unpacks, bytes backward made
    unpacks: list[tuple[int, int]] = []
    ops: list[tuple[int, int]] = []  # (first unpacks before it, bytes made) per backward op
    unpacked: set[int] = set()

    def unpack(t: torch.Tensor) -> torch.Tensor:  # in backward, ``made`` counting

        node = recorder.node.get(t.untyped_storage().data_ptr())
        if node is not None and node not in unpacked:
            unpacked.add(node)
            unpacks.append((node, made.live_bytes))
        return t

    hooks = [] if head is None else [head.register_forward_pre_hook(enter),
                                     head.register_forward_hook(done)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), recorder:
            loss = run()
    finally:
        for hook in hooks:
            hook.remove()
    made = _BackwardBytes(set(recorder.node) | free_keys,
                          lambda: ops.append((len(unpacks), made.live_bytes)))
    with made:
        loss.backward()
    kept = [i for i, (t, _) in enumerate(unpacks) if t in saved and recorder.nbytes[t] > 0]
    before, kept_set = [0], set(kept)  # before[n]: the unpacks kept among the first n
    for i in range(len(unpacks)):
        before.append(before[-1] + (i in kept_set))
    n_ops = len(recorder.op_ms)
    parent = list(range(n_ops))
    for op, writes in enumerate(recorder.writes):
        for t in writes:
            a, b = _find(parent, op), _find(parent, recorder.creator[t])
            parent[max(a, b)] = min(a, b)
    roots = sorted({_find(parent, op) for op in range(n_ops)})
    group = {root: g for g, root in enumerate(roots)}
    of_op = [group[_find(parent, op)] for op in range(n_ops)]
    group_of = tuple(of_op[op] for op in recorder.creator)
    cost = [0.0] * len(roots)
    reads: list[set[int]] = [set() for _ in roots]
    names: list[list[str]] = [[] for _ in roots]
    for op in range(n_ops):
        cost[of_op[op]] += recorder.op_ms[op]
        reads[of_op[op]] |= recorder.reads[op]
        names[of_op[op]].append(recorder.op_name[op])
    inputs = tuple(tuple(sorted(u for u in r if group_of[u] != g)) for g, r in enumerate(reads))
    graph = ForwardGraph(tuple(recorder.nbytes), group_of, tuple(cost), inputs,
                         frozenset(t for t in saved if recorder.nbytes[t] > 0),
                         tuple(tuple(n) for n in names),
                         frozenset(of_op[op] for op in recorder.head_ops), recorder.loss_ms,
                         frozenset(of_op[op] for op in recorder.tail_ops), head_grad_bytes,
                         tuple(unpacks[i] for i in kept), tuple((before[n], b) for n, b in ops))
    recorder.held.clear()
    return graph


def knapsack_bound_ms(graph: ForwardGraph, need_bytes: int, head_freed_bytes: int | None = None
                      ) -> float:
    """Fractional knapsack over groups: the least cost that frees ``need_bytes`` of saved
    storages, re-running a group freeing all its saved outputs, chains ignored; with
    ``head_freed_bytes``, the cheaper of that and a chunked head (NOTE [ A chunked head in
    the bound ]); each moment of backward bounds both (NOTE [ Moments of backward in the
    bound ]). Each row on its own relaxes the program with all of them: the largest
    holds."""

    def bound(program: Program) -> float:
        paid = [0.0 if g in program.forced else c for g, c in enumerate(program.cost_ms)]
        bounds = [_knapsack(graph, program.need_bytes, paid)]
        for storages, room in program.rows:
            kept = [t for t in storages if t in graph.saved]
            bounds.append(_knapsack(graph, sum(graph.nbytes[t] for t in kept) - room, paid,
                                    kept))
        return program.paid_ms(graph) + max(bounds)

    return min(bound(p) for p in programs(graph, need_bytes, head_freed_bytes))


Row = tuple[Sequence[int], int]
"""Storage nodes and the bytes of them a plan may keep at one moment."""


@dataclass(frozen=True)
class Program:
    """The bound's program for one kind of plan (NOTEs [ Lower bound ] in
    benchmarks/planner.py, [ A chunked head in the bound ], [ Moments of backward in the
    bound ]).

    Attributes:
        label: ``"saved storages"`` (plans without a chunked head) or ``"chunked head"``.
        need_bytes: bytes of saved storages to free (at the peak, or the end of forward).
        rows: the moments the plan must fit at besides.
        forced: groups every plan of this kind re-runs (the head's projection).
        cost_ms: each group's cost, ms.
        extra_ms: what such a plan pays besides its groups (the loss, slice by slice), ms.
    """

    label: str
    need_bytes: int
    rows: tuple[Row, ...]
    forced: frozenset[int]
    cost_ms: tuple[float, ...]
    extra_ms: float

    def paid_ms(self, graph: ForwardGraph) -> float:
        """What every plan of this kind pays whatever it frees: ``extra_ms`` and the forced
        groups."""
        return self.extra_ms + sum(self.cost_ms[g] for g in self.forced)


def programs(graph: ForwardGraph, need_bytes: int, head_freed_bytes: int | None
             ) -> list[Program]:
    """The program for plans without a chunked head and, where a chunked head frees bytes,
    the one for plans with one (``need_bytes`` less ``head_freed_bytes`` to free at the end
    of forward, the end of the head's backward and the later moments besides). Without
    ``head_freed_bytes`` the bytes alive before the step are unknown: the saved-storage
    program alone, without moments."""
    plain = Program("saved storages", need_bytes, (), frozenset(), graph.cost_ms, 0.0)
    if head_freed_bytes is None:  # the bytes before the step unknown: no moment
        return [plain]
    room = graph.saved_bytes - need_bytes + head_freed_bytes  # budget - start
    moments = _moments(graph, room, frozenset())
    for storages, left in moments:  # the un-checkpointed step keeps all, within its peak
        held = sum(graph.nbytes[t] for t in storages)
        if held > left + need_bytes:
            raise RuntimeError(
                f"programs: a moment of backward holds {held - left - need_bytes} B more "
                "than the un-checkpointed peak allows: the recording counts bytes the step "
                "does not hold")
    found = [replace(plain, rows=tuple(moments))]
    if head_freed_bytes > 0 and graph.head_groups:
        tail = graph.tail_storages
        after_head = ([t for t, b in enumerate(graph.nbytes) if b > 0 and t not in tail],
                      room - graph.head_grad_bytes)
        found.append(Program("chunked head", need_bytes - head_freed_bytes,
                             (after_head, *_moments(graph, room, tail)), graph.head_groups,
                             graph.chunked_cost_ms, graph.loss_ms))
    return found


def _moments(graph: ForwardGraph, room: int, tail: frozenset[int]) -> list[Row]:
    """The rows of NOTE [ Moments of backward in the bound ]: at each first unpack, the
    storages unpacked later within ``room`` less the bytes backward made and the unpacked
    storage itself (kept or just recomputed, it is alive as its node reads it); just after
    each op of backward, the storages not unpacked yet within ``room`` less the bytes
    backward made. A moment whose storages are among an earlier one's and whose bytes are
    no more is implied by it and left out; so are storages in ``tail`` and the moments
    while the last storage unpacked is one of them (the head's backward, which a chunked
    head runs otherwise)."""
    events = graph.unpacks
    seen = {t for t, _ in events}
    never = [t for t in graph.saved if t not in seen and t not in tail]  # alive throughout
    moments = [(i, 0, made + graph.nbytes[t]) for i, (t, made) in enumerate(events)
               if t not in tail]
    moments += [(n - 1, 1, made) for n, made in graph.op_moments
                if (n > 0 and events[n - 1][0] not in tail) or (n == 0 and not tail)]
    rows: list[Row] = []
    last = -1
    for i, _, held in sorted(moments):  # storages unpacked after event i stay alive
        if held > last:
            rows.append(([t for t, _ in events[i + 1:] if t not in tail] + never,
                         room - held))
            last = held
    return rows


def _knapsack(graph: ForwardGraph, need_bytes: int, cost_ms: Sequence[float],
              storages: Iterable[int] | None = None) -> float:
    """The least cost, fractionally, to free ``need_bytes`` of ``storages`` (default: every
    saved storage); infinite where they hold fewer bytes than that."""
    freed = [0] * len(cost_ms)
    for t in graph.saved if storages is None else storages:
        freed[graph.group_of[t]] += graph.nbytes[t]
    if need_bytes > sum(freed):
        if storages is not None:
            return math.inf
        need_bytes = sum(freed)  # clipped: free everything
    total = 0.0
    items = sorted((c / b, b, c) for b, c in zip(freed, cost_ms, strict=True) if b > 0)
    for _, nbytes, ms in items:
        if need_bytes <= 0:
            break
        take = min(nbytes, need_bytes)
        total += ms * take / nbytes
        need_bytes -= take
    return total


def _program(graph: ForwardGraph, program: Program
             ) -> tuple[np.ndarray, csr_matrix, np.ndarray]:
    """``(objective in us, A_ub, b_ub)`` of NOTE [ Lower bound ]'s program over
    ``[s_0 .. s_n, y_0 .. y_g]`` for ``program``: its forced groups re-run (``y_g = 1``), its
    rows (storages, bytes) bounding the bytes kept of those storages (NOTEs [ A chunked head
    in the bound ], [ Moments of backward in the bound ]), its groups at its costs; bytes in
    MB keep HiGHS's tolerances meaningful."""
    n_s, n_g = len(graph.nbytes), len(graph.cost_ms)
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    rhs: list[float] = []

    def row(entries: list[tuple[int, float]], bound: float) -> None:
        r = len(rhs)
        for col, val in entries:
            rows.append(r)
            cols.append(col)
            vals.append(val)
        rhs.append(bound)

    for t in sorted(graph.saved):  # kept or recomputed: -s_t - y_g <= -1
        row([(t, -1.0), (n_s + graph.group_of[t], -1.0)], -1.0)
    for g, inputs in enumerate(graph.inputs):  # y_g <= s_u + y_prod(u)
        for u in inputs:
            row([(n_s + g, 1.0), (u, -1.0), (n_s + graph.group_of[u], -1.0)], 0.0)
    for g in sorted(program.forced):  # -y_g <= -1
        row([(n_s + g, -1.0)], -1.0)
    mb = 1e-6
    saved_bytes = graph.saved_bytes
    row([(t, b * mb) for t, b in enumerate(graph.nbytes) if b > 0],
        (saved_bytes - min(max(program.need_bytes, 0), saved_bytes)) * mb)
    for storages, room in program.rows:
        row([(t, graph.nbytes[t] * mb) for t in storages if graph.nbytes[t] > 0], room * mb)
    matrix = coo_matrix((vals, (rows, cols)), shape=(len(rhs), n_s + n_g)).tocsr()
    objective = np.concatenate([np.zeros(n_s), np.asarray(program.cost_ms) * 1e3])
    return objective, matrix, np.asarray(rhs)


def _lp(graph: ForwardGraph, program: Program) -> float:
    objective, matrix, rhs = _program(graph, program)
    result = linprog(objective, A_ub=matrix, b_ub=rhs, bounds=(0.0, 1.0), method="highs")
    if result.status == 2:
        return math.inf  # no plan of this kind fits (NOTE [ Moments of backward in the bound ])
    if result.status != 0:
        raise RuntimeError(f"lp_bound_ms: HiGHS did not solve the LP: {result.message}")
    return float(result.fun) / 1e3


def lp_bound_ms(graph: ForwardGraph, need_bytes: int, head_freed_bytes: int | None = None
                ) -> float:
    """The LP relaxation's optimum: the least cost of re-running groups (fractionally) so
    that ``need_bytes`` of saved storages are freed and every re-run group's inputs are
    kept or re-run too (NOTE [ Lower bound ] in benchmarks/planner.py), the plan fitting
    every moment of backward as well (NOTE [ Moments of backward in the bound ]); with
    ``head_freed_bytes``, the cheaper of that and a chunked head: the head re-run,
    ``head_freed_bytes`` fewer to free at the end of forward, the end of the head's backward
    and the later moments bounded too (NOTE [ A chunked head in the bound ]).

    ``need_bytes`` above the saved bytes is clipped to them (free everything).
    """
    if need_bytes <= 0 or not graph.saved:
        return 0.0
    return min(program_lp_ms(graph, p) for p in programs(graph, need_bytes, head_freed_bytes))


def program_lp_ms(graph: ForwardGraph, program: Program) -> float:
    """One program's LP optimum, ms (infinite where no plan of its kind fits)."""
    return program.extra_ms + _lp(graph, program)


def integer_bound_ms(graph: ForwardGraph, need_bytes: int, head_freed_bytes: int | None = None,
                     time_limit_s: float = 30.0) -> float:
    """The same program with every variable 0 or 1 (what a plan is): HiGHS's dual bound,
    so still a lower bound when the time limit stops it; for diagnosing the LP's
    integrality gap. ``head_freed_bytes`` as for :func:`lp_bound_ms`."""
    if need_bytes <= 0 or not graph.saved:
        return 0.0
    return min(p.extra_ms + _milp(graph, p, time_limit_s)
               for p in programs(graph, need_bytes, head_freed_bytes))


def _milp(graph: ForwardGraph, program: Program, time_limit_s: float) -> float:
    objective, matrix, rhs = _program(graph, program)
    result = milp(objective, constraints=LinearConstraint(matrix, -np.inf, rhs),
                  integrality=np.ones(len(objective)), bounds=Bounds(0.0, 1.0),
                  options={"time_limit": time_limit_s})
    if result.status == 2:
        return math.inf  # no plan of this kind fits (NOTE [ Moments of backward in the bound ])
    bound = getattr(result, "mip_dual_bound", None)
    if bound is None:
        raise RuntimeError(f"integer_bound_ms: HiGHS found no bound: {result.message}")
    return float(bound) / 1e3
