"""Per-block candidates, each measured: what it keeps, its working set, and what it recomputes.

For every distinct kind of block (same class, parameter shapes and input shapes)
one representative is run on its own, on fake tensors, once per candidate
decision: its forward and backward are tracked by
:class:`~remat.measure.tracker.MemoryTracker` and cut into windows (see NOTE
[ Memory windows ] in measure/windows.py). Blocks of the same kind reuse the
representative's numbers; the closed loop (``loop.py``) checks the result on the
whole model.

NOTE [ Candidate decisions ]
    1. ``none`` (keep everything) and ``full`` (checkpoint the block).
    2. ``attn`` / ``mlp``: checkpoint that sub-layer only (when the block has one: a
       module, or a method of the block, NOTE [ Method sub-layers ] in remat/blocks.py).
    3. ``ops`` with save sets of increasing size: the entries of the block's
       forward (each call of a compute-heavy op that runs more than once, e.g.
       ``aten.mm#2``; other ops by name) are ranked by how much recompute time a
       byte of their output saves (roofline ms / output bytes); attention kernels
       rank first (they are dropped from the save set last), then the other
       compute-heavy ops (matmuls, cheapest per byte last), then pointwise ops
       and norms. Save set k keeps the outputs of the first k entries and
       recomputes everything else, so the first sets recompute pointwise ops and
       norms, the last recompute almost nothing. The set holding all heavy ops
       is the ``"ops"`` strategy's. Each region (the block, each sub-layer) is
       first measured fully checkpointed: recomputation stops once every
       tensor backward needs is back, so a region's last ops (an MLP's down
       projection) are never recomputed, and keeping their outputs would cost
       bytes for nothing. Only the calls that run are ranked, by the recompute
       time a byte of their output saves (``BlockContext.recomputed``): their own
       time plus that of the calls caching them frees, which the recompute skips
       (NOTE [ Dead ops in recompute ]: caching gelu_new's tanh frees the pow,
       mul, add, mul before it; ``BlockContext.graphs``, one recorded forward).
       Next to each chain, the minimum-cut save sets (NOTE [ Save sets as minimum
       cuts ]: the hull of kept bytes vs recompute, call by call); sets another
       beats in both numbers under that model are not offered. The chain never
       keeps everything but the cheapest outputs (its sets keep a prefix of the
       ranking, pointwise ops last); the hull's two vertices that keep the most do
       (a norm's output the next matmul saves anyway, a router's ``topk``/``sort``,
       an activation), and are always offered (item 4 of that NOTE). Every save set
       of a region also recomputes what SAC cannot cache (in-place ops: the masks
       of a dropout decomposed into ``bernoulli_``/``div_``, as on CPU), so a
       region's cheapest set costs at least that.
    4. ``offload`` when the model is on a device with separate host memory
       (CUDA); never on CPU, where it is a no-op.
    5. Decisions on the attention and MLP sub-layers together (e.g. attention
       with save set {qkv matmul}, MLP fully checkpointed): op names are far
       more specific inside one sub-layer than across the block, so these reach
       memory levels block-wide save sets cannot. Each sub-layer's options
       (``full`` and its own save-set chain) are measured alone; the pairs whose
       summed numbers lie on the bytes/cost frontier are then measured together.
       The plan applies them by the sub-layers' qualified names (a method's: the block's
       name and the method's, ``"layers.3._attention_forward"``).
    Candidates no better than another in every measured number are dropped.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from remat.blocks import Sublayer, find_sublayer
from remat.core.op_record import OpRecord
from remat.devices import DeviceSpec
from remat.errors import BlocksNotFound, RematWarning, message
from remat.measure.roofline import op_roofline_ms
from remat.measure.windows import FakeSetup
from remat.planning.block_run import BlockRun, record_graphs, run_block
from remat.planning.capture import BlockInputs, capture_inputs, group_key, in_call_order
from remat.planning.manual import builtin_parts
from remat.progress import report
from remat.strategies import (
    BlockContext,
    BlockStrategy,
    Handler,
    Offer,
    Part,
    block_handler_of,
    handler_of,
    registered,
)
from remat.strategies.builtin import Full, NoCheckpoint


@dataclass(frozen=True)
class Candidate:
    """One way to checkpoint one kind of block, measured.

    Args:
        parts: what each module of the block gets, ``()`` for none (keep everything),
            ``(("", s),)`` for a block-level strategy ``s`` on the block, or
            ``(("attn", s1), ("mlp", s2))`` for strategies on the block's sub-layers (paths
            relative to the block).
        saved_bytes: bytes the block's forward leaves alive for backward: its input or
            output only if its own graph keeps them (NOTE [ Who keeps a hidden state ] in
            block_run.py).
        forward_peak_bytes: the block forward's high-water mark above its start.
        backward_peak_bytes: the block backward's high-water mark above the memory just
            before it, plus ``saved_bytes``: the recompute working set, gradients and
            temporaries of the block being recomputed.
        recompute_flops: FLOPs recomputed in backward.
        recompute_ms: cost of the decision per step, ms: roofline time of the recomputed
            ops on the cost device, plus ``transfer_ms``.
        recompute_bytes: bytes read and written by the recomputed ops.
        backward_peak_phase: the phase at the backward's high-water mark (``"backward"``
            or ``"recompute"``).
        transfer_ms: the part of ``recompute_ms`` that is exposed host-link time, ms
            (``offload``, ``full_offload``; NOTE [ Offload copies in the step time ]).
            Default: 0.
    """

    parts: tuple[Part, ...]
    saved_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    recompute_flops: int
    recompute_ms: float
    recompute_bytes: int = 0
    backward_peak_phase: str = "backward"
    transfer_ms: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple((p, d) for p, d in self.parts
                                                if not isinstance(d, NoCheckpoint)))
        for name in ("saved_bytes", "forward_peak_bytes", "backward_peak_bytes",
                     "recompute_flops", "recompute_bytes"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(message(f"Candidate({self.label()})", f"{name} must be >= 0",
                                         {"found": value}, fix=f"pass {name} >= 0"))
        for name in ("recompute_ms", "transfer_ms"):
            if not getattr(self, name) >= 0:
                raise ValueError(message(f"Candidate({self.label()})", f"{name} must be >= 0",
                                         {"found": getattr(self, name)},
                                         fix=f"pass {name} >= 0"))

    @property
    def is_none(self) -> bool:
        """True for the candidate that keeps everything."""
        return not self.parts

    @property
    def offloads(self) -> bool:
        """True when a part moves activations to the host (its cost is transfer time, not
        recompute)."""
        return _moves_to_host(self.parts)

    def label(self) -> str:
        """``none``, a decision's label (``full``, ``ops[aten.mm]``), or ``attn=...; mlp=...``."""
        return parts_label(self.parts)

    def decisions_for(self, block_name: str) -> dict[str, BlockStrategy]:
        """What to install, keyed by qualified module name, for block ``block_name``."""
        return {f"{block_name}.{path}" if path else block_name: d for path, d in self.parts}

    def dominates(self, other: Candidate) -> bool:
        """At most ``other`` in every number (ties count as dominating)."""
        return (self.saved_bytes <= other.saved_bytes
                and self.forward_peak_bytes <= other.forward_peak_bytes
                and self.backward_peak_bytes <= other.backward_peak_bytes
                and self.recompute_ms <= other.recompute_ms)


def _moves_to_host(parts: Sequence[Part]) -> bool:
    return any(block_handler_of(d).moves_to_host for _, d in parts)


def parts_label(parts: Sequence[Part]) -> str:
    """Label of a candidate's parts (see :meth:`Candidate.label`)."""
    live = [(p, d) for p, d in parts if not isinstance(d, NoCheckpoint)]
    if not live:
        return "none"
    if len(live) == 1 and live[0][0] == "":
        return live[0][1].label()
    return "; ".join(f"{p or 'block'}={d.label()}" for p, d in live)


@dataclass(frozen=True)
class BlockGroup:
    """Blocks that behave alike (same class, parameter shapes, input shapes).

    Args:
        names: qualified names of the member blocks, in forward order.
        candidates: the measured candidates, ``none`` first.
        builtin: each built-in strategy's decision on the kind of block, measured like a
            candidate whether or not it is one (NOTE [ Never worse than manual ] in
            manual.py); the solver never reads them. Default: ``()``.
    """

    names: tuple[str, ...]
    candidates: tuple[Candidate, ...]
    builtin: tuple[Candidate, ...] = ()


#: How a candidate's block run is obtained: :func:`~remat.planning.block_run.run_block`, or
#: (simulate/plan_fast.py) interpolated from runs at two other batch sizes.
RunBlock = Callable[..., BlockRun]

# ---- all candidates of all groups ---------------------------------------------------------

def measured_candidate(parts: Sequence[Part], run: BlockRun, device: DeviceSpec,
                       base: BlockRun | None = None, kept: BlockRun | None = None) -> Candidate:
    """The candidate of decisions ``parts`` from its block ``run`` (``base``: the block's
    ``none`` run, for what offloading moves). ``kept``: the run of
    :func:`on_device_parts` of ``parts`` (the same decisions with what they copy to the
    host kept on the device), when measured."""
    recompute = [op for op in run.ops if op.phase == "recompute"]
    ms = sum(op_roofline_ms(op, device) for op in recompute)
    transfer_ms = 0.0
    if base is not None and _moves_to_host(parts):
        prefetched = kept is not None and any(block_handler_of(d).offloads_inputs for _, d in parts)
        transfer_ms = _offload_exposed_ms(run, kept if kept is not None and prefetched
                                          else base, device, base=base, prefetched=prefetched)
    return Candidate(
        parts=tuple(parts),
        saved_bytes=run.saved_bytes,
        forward_peak_bytes=run.forward_peak_bytes,
        backward_peak_bytes=run.backward_peak_bytes,
        recompute_flops=sum(op.flops for op in recompute),
        recompute_ms=ms + transfer_ms,
        recompute_bytes=sum(op.bytes_moved for op in recompute),
        backward_peak_phase=run.backward_peak_phase,
        transfer_ms=transfer_ms,
    )


def on_device_parts(parts: Sequence[Part]) -> tuple[Part, ...]:
    """``parts`` with each decision that offloads a checkpoint's inputs replaced by ``full``
    (the run whose saved bytes, less the candidate's, are what it copies)."""
    return tuple((p, Full() if block_handler_of(d).offloads_inputs else d) for p, d in parts)


def _offload_exposed_ms(run: BlockRun, kept: BlockRun, device: DeviceSpec, *,
                        base: BlockRun | None = None, prefetched: bool = False) -> float:
    """Time the block's offload copies add to a step: the bytes ``kept`` keeps on the
    device and ``run`` does not, out beyond the forward of ``base`` (default ``kept``),
    back beyond ``run``'s recompute and backward when ``prefetched``, else in full.

    NOTE [ Offload copies in the step time ]
        The ``offload`` strategy (NOTE [ Asynchronous offload ] in strategies/offload.py)
        copies a block's saved tensors out on a side stream while the block's forward
        kernels run, and waits for them at the block's end: what the forward kernels do
        not cover is exposed. It copies them back at the block's first unpack in
        backward, with the compute stream waiting: all exposed. Transformer blocks move
        far more bytes than their forward kernels can hide, so most of the copy time is
        in the step (measured by ``benchmarks/gpu.py``; figures in
        benchmarks/gpu_h100.json).

        ``full_offload`` (NOTE [ Offloaded checkpoints ] in strategies/offload.py) moves
        what ``full`` keeps and it does not (the block's input: ``full``'s saved bytes
        less its own), out during the block's forward, back during the next block's
        recompute and backward (prefetched one block ahead); blocks of one kind take
        alike, so this block's own recompute and backward stand for that window. The
        one copy back a step that is not prefetched (the last block's: one hidden
        state) is left out.
    """
    moved = max(kept.saved_bytes - run.saved_bytes, 0)
    fwd_ms = sum(op_roofline_ms(op, device) for op in (base or kept).ops
                 if op.phase == "forward")
    back_ms = sum(op_roofline_ms(op, device) for op in run.ops
                  if op.phase in ("recompute", "backward")) if prefetched else 0.0
    return offload_exposed_ms(moved, fwd_ms, device, backward_ms=back_ms)


def offload_exposed_ms(moved_bytes: int, forward_ms: float, device: DeviceSpec, *,
                       backward_ms: float = 0.0) -> float:
    """Step time that offloading ``moved_bytes`` adds (NOTE [ Offload copies in the step
    time ]): the copy out beyond ``forward_ms`` of forward kernels, plus the copy back
    beyond ``backward_ms`` of kernels it overlaps (0, the default: not prefetched).

    Example:
        >>> offload_exposed_ms(2**30, 5.0, get_device("h100-80gb"))  # 19.5 ms each way
        34.04...
    """
    transfer_ms = moved_bytes / device.host_link_bytes_per_s * 1e3
    return max(transfer_ms - forward_ms, 0.0) + max(transfer_ms - backward_ms, 0.0)


def prune_candidates(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Drop candidates another one matches or beats in every number (``none`` stays).

    Of candidates equal in every number, one on sub-layers only is kept rather than one
    with a region around the whole block (a block-wide save set that recomputes just
    what a sub-layer's does: the same bytes and cost, a region over more ops whose
    bookkeeping runs every step), then the first."""
    def rank(i: int) -> tuple[bool, int]:
        return any(path == "" for path, _ in candidates[i].parts), i

    kept: list[Candidate] = []
    for i, c in enumerate(candidates):
        dominated = not c.is_none and any(
            other.dominates(c) and (not c.dominates(other) or rank(j) < rank(i))
            for j, other in enumerate(candidates) if j != i
        )
        if not dominated:
            kept.append(c)
    return kept


def _pareto(points: Sequence[tuple[int, float, Any]], limit: int) -> list[Any]:
    """Items on the (bytes, cost) lower-left frontier, at most ``limit`` spread along it."""
    front: list[tuple[int, float, Any]] = []
    for saved, cost, item in sorted(points, key=lambda p: (p[0], p[1])):
        if not front or cost < front[-1][1]:
            front.append((saved, cost, item))
    if limit <= 1:
        return [item for _, _, item in front[:limit]]
    if len(front) > limit:
        step = (len(front) - 1) / (limit - 1)
        front = [front[round(k * step)] for k in range(limit)]
    return [item for _, _, item in front]


def _sublayers(block: nn.Module) -> dict[str, tuple[str, Sublayer]]:
    """Per kind, the block's sub-layer: a module, or a method whose ops the measurements
    attribute through a wrapper on the instance (``hook_calls`` in measure/attribution.py)."""
    found: dict[str, tuple[str, Sublayer]] = {}
    for kind in ("attn", "mlp"):
        try:
            found[kind] = find_sublayer(block, kind)  # type: ignore[arg-type]
        except BlocksNotFound:
            continue
    return found


def _ops_of(run: BlockRun, module_name: str) -> tuple[OpRecord, ...]:
    return tuple(op for op in run.ops if op.phase == "forward" and op.block == module_name)


def collect_offers(context: BlockContext) -> list[Offer]:
    """Every registered block-level strategy's offers, in candidate order: whole-block
    offers first, then each sub-layer's (NOTE [ Candidate decisions ]); within each, by
    registration order."""
    offers: list[tuple[tuple[int, int, int], int, Offer]] = []
    kinds = list(context.sublayers)
    for rank, cls in enumerate(registered()):
        handler = handler_of(cls)
        if type(handler).offers is Handler.offers:  # offers nothing (may need an argument)
            continue
        for offer in handler.offers(handler.parse(None), context):
            group = (0, 0) if offer.sublayer is None else (1, kinds.index(offer.sublayer))
            offers.append(((*group, rank), len(offers), offer))
    return [offer for _, _, offer in sorted(offers, key=lambda item: (item[0], item[1]))]


def _pairs(singles: dict[str, list[tuple[Part, BlockRun]]], none_run: BlockRun,
           known: list[Candidate], device: DeviceSpec, limit: int) -> list[tuple[Part, ...]]:
    """The attention + MLP pairs worth measuring (item 5 of NOTE [ Candidate decisions ])."""
    if len(singles) != 2:
        return []
    first, second = singles.values()
    base_saved = none_run.saved_bytes
    estimates: list[tuple[int, float, Any]] = []
    for part_a, run_a in first[1:]:
        for part_m, run_m in second[1:]:
            cost = (measured_candidate((), run_a, device).recompute_ms
                    + measured_candidate((), run_m, device).recompute_ms)
            saved = run_a.saved_bytes + run_m.saved_bytes - base_saved
            estimates.append((saved, cost, (part_a, part_m)))
    points = [(c.saved_bytes, c.recompute_ms, None) for c in known]
    return [tuple(pair) for pair in _pareto(estimates + points, limit + len(points))
            if pair is not None]


def _measure_kind(setup: FakeSetup, rep: str, block: nn.Module, inputs: BlockInputs,
                  device: DeviceSpec, max_composites: int,
                  run_block: RunBlock = run_block, model_blocks: int = 0,
                  builtin: bool = False) -> tuple[list[Candidate], list[Candidate]]:
    """Every candidate of one kind of block (NOTE [ Candidate decisions ]), and with
    ``builtin`` each built-in strategy's decision on it, measured (``BlockGroup.builtin``)."""
    subs = _sublayers(block)
    attribution = [(rep, block), *((f"{rep}.{path}", m) for path, m in subs.values())]
    none_run = run_block(setup, rep, block, inputs, (), attribution)
    measured: dict[tuple[Part, ...], Candidate] = {(): measured_candidate((), none_run, device)}
    # Each region fully checkpointed: which of its ops backward recomputes.
    full = Full()
    probes: dict[str, tuple[Part, ...]] = {
        "": (("", full),), **{kind: ((path, full),) for kind, (path, _) in subs.items()}}
    runs = {parts: run_block(setup, rep, block, inputs, parts) for parts in probes.values()}
    context = BlockContext(
        forward_ops=tuple(op for op in none_run.ops if op.phase == "forward"),
        sublayers={kind: (path, _ops_of(none_run, f"{rep}.{path}"))
                   for kind, (path, _) in subs.items()},
        cost_device=device, runs_on=setup.device.type,
        recomputed={region: tuple(op for op in runs[parts].ops if op.phase == "recompute")
                    for region, parts in probes.items()},
        graphs=record_graphs(setup, rep, block, inputs,
                             {kind: module for kind, (_, module) in subs.items()}),
        model_blocks=model_blocks,
    )
    singles: dict[str, list[tuple[Part, BlockRun]]] = {
        kind: [((path, NoCheckpoint()), none_run)] for kind, (path, _) in subs.items()}
    offers = collect_offers(context)
    for done, offer in enumerate(offers):
        report(f"{rep}: {parts_label(offer.parts)}", done, len(offers))
        try:
            known = runs.get(offer.parts)
            run = known if known is not None else \
                run_block(setup, rep, block, inputs, offer.parts)
        except (RuntimeError, NotImplementedError) as exc:
            if not offer.optional:
                raise
            warnings.warn(message("remat.plan", f"could not measure {parts_label(offer.parts)} "
                                  f"on {rep!r}", {"error": exc, "so": "planning without it"},
                                  fix="nothing to do; the plan uses the other candidates"),
                          RematWarning, stacklevel=3)
            continue
        measured[offer.parts] = measured_candidate(offer.parts, run, device, base=none_run,
                                                   kept=runs.get(on_device_parts(offer.parts)))
        if offer.sublayer in singles:
            singles[offer.sublayer].append((offer.parts[0], run))
    for pair in _pairs(singles, none_run, list(measured.values()), device, max_composites):
        run = run_block(setup, rep, block, inputs, pair)
        measured[pair] = measured_candidate(pair, run, device, base=none_run)
    extra: list[Candidate] = []
    for parts in builtin_parts(rep, block) if builtin else ():
        if parts in measured:
            extra.append(measured[parts])
            continue
        try:
            run = run_block(setup, rep, block, inputs, parts)
            extra.append(measured_candidate(parts, run, device, base=none_run))
        except (RuntimeError, NotImplementedError):
            continue  # the closed loop measures that strategy on the whole step instead
    return list(measured.values()), extra


def measure_groups(setup: FakeSetup, device: DeviceSpec, *, prune: bool = True,
                   max_composites: int = 8, share: bool = True,
                   run: RunBlock = run_block,
                   model_blocks: int | None = None, builtin: bool = False,
                   inputs: Mapping[str, BlockInputs] | None = None) -> list[BlockGroup]:
    """Measure every candidate of every kind of block in ``setup``'s model.

    Args:
        setup: the fake model, batch and blocks (see ``_sim.fake_setup``).
        device: the cost device (roofline figures).
        prune: drop candidates another candidate beats in every number. Default: True.
        max_composites: at most this many attention+MLP pairs are measured per kind of
            block (the most promising by their parts' numbers). Default: 8.
        share: measure one block per kind (same class, parameter and buffer shapes, input
            shapes; ``capture.group_key``) and give the others its candidates. ``False``
            measures every block on its own inputs: the exact path the shared one is
            tested against (a 32-layer stack then costs 32 times the block runs).
            Default: True.
        run: how each candidate's block run is obtained (same arguments as
            :func:`~remat.planning.block_run.run_block`). Default: ``run_block``.
        model_blocks: how many blocks the model has (``BlockContext.model_blocks``),
            for a caller measuring on a copy cut shorter. Default: ``setup``'s blocks.
        builtin: also measure each built-in strategy's decision on each kind of block
            (``BlockGroup.builtin``). Default: False.
        inputs: each block's arguments, captured on ``setup`` already
            (:func:`~remat.planning.capture.capture_inputs`). Default: captured here.

    Returns:
        One :class:`BlockGroup` per kind of block (per block without ``share``), in order
        of first appearance.
    """
    if inputs is None:
        report("block inputs", 1, 3)
        inputs = capture_inputs(setup.model, setup.batch, setup.blocks,
                                mode=None if setup.real else setup.mode)
    setup.blocks[:] = in_call_order(setup.blocks, inputs)  # the peak model counts in this order
    groups: dict[Any, list[str]] = {}
    for name, block in setup.blocks:
        groups.setdefault(group_key(block, inputs[name]) if share else name, []).append(name)
    modules = dict(setup.blocks)
    result: list[BlockGroup] = []
    for names in groups.values():
        rep = names[0]
        candidates, extra = _measure_kind(
            setup, rep, modules[rep], inputs[rep], device, max_composites, run,
            len(setup.blocks) if model_blocks is None else model_blocks, builtin)
        if prune:
            candidates = prune_candidates(candidates)
        result.append(BlockGroup(tuple(names), tuple(candidates), tuple(extra)))
    return result
