"""Per-block candidates, each measured: what it keeps, its working set, and what it recomputes.

For every distinct kind of block (same class, parameter shapes and input shapes)
one representative is run on its own, on fake tensors, once per candidate
decision: its forward and backward are tracked by
:class:`~remat.measure.tracker.MemoryTracker` and cut into windows (see NOTE
[ Memory windows ] in ``_sim.py``). Blocks of the same kind reuse the
representative's numbers; the closed loop in ``planner.py`` checks the result on
the whole model.

NOTE [ Candidate decisions ]
    1. ``none`` (keep everything) and ``full`` (checkpoint the block).
    2. ``attn`` / ``mlp``: checkpoint that sub-layer only (when the block has one).
    3. ``ops`` with save sets of increasing size: the entries of the block's
       forward (each call of a compute-heavy op that runs more than once, e.g.
       ``aten.mm#2``; other ops by name) are ranked by how much recompute time a
       byte of their output saves (roofline ms / output bytes); attention kernels
       rank first (they are dropped from the save set last), then the other
       compute-heavy ops (matmuls, cheapest per byte last), then pointwise ops
       and norms. Save set k keeps the outputs of the first k entries and
       recomputes everything else, so the first sets recompute pointwise ops and
       norms, the last recompute almost nothing. The set holding all heavy ops
       is the ``"ops"`` strategy's.
    4. ``offload`` when the model is on a device with separate host memory
       (CUDA); never on CPU, where it is a no-op.
    5. Decisions on the attention and MLP sub-layers together (e.g. attention
       with save set {qkv matmul}, MLP fully checkpointed): op names are far
       more specific inside one sub-layer than across the block, so these reach
       memory levels block-wide save sets cannot. Each sub-layer's options
       (``full`` and its own save-set chain) are measured alone; the pairs whose
       summed numbers lie on the bytes/cost frontier are then measured together.
       The plan applies them by the sub-layers' qualified names.
    Candidates no better than another in every measured number are dropped.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from remat.blocks import find_sublayer
from remat.errors import BlocksNotFound, RematWarning
from remat.measure.roofline import op_roofline_ms
from remat.measure.tracker import MemoryTracker, OpRecord
from remat.plan._sim import FakeSetup, WindowRecorder, first_tensor, quiet
from remat.plan.plans import NamedBlocks
from remat.simulate.devices import DeviceSpec
from remat.strategies import COMPUTE_HEAVY_OPS, BlockDecision, apply_decisions, remove
from remat.strategies.ops import call_entry, parse_entry

__all__ = [
    "BlockGroup",
    "Candidate",
    "apply_parts",
    "capture_inputs",
    "fresh_inputs",
    "measure_groups",
    "prune_candidates",
    "save_set_chain",
]

_MAX_LIGHT_OPS = 4  # pointwise op names added one by one to a sub-layer's save-set chain
_MAX_LIGHT_OPS_BLOCK = 2  # ... to a whole block's (block-wide pointwise sets rarely pay off)
_EXHAUSTIVE = 3  # sub-layers with at most this many op names try every save set


Part = tuple[str, BlockDecision]
"""``(path, decision)``: ``""`` for the block itself, else a sub-layer's path in the block."""


@dataclass(frozen=True)
class Candidate:
    """One way to checkpoint one kind of block, measured.

    Args:
        parts: the decisions, ``()`` for none (keep everything), ``(("", d),)`` for a
            block-level decision ``d``, or ``(("attn", d1), ("mlp", d2))`` for decisions on
            the block's sub-layers (paths relative to the block).
        saved_bytes: bytes the block's forward leaves alive for backward (its output
            included: the next block keeps it either way).
        forward_peak_bytes: the block forward's high-water mark above its start.
        backward_peak_bytes: the block backward's high-water mark above the memory just
            before it, plus ``saved_bytes``: the recompute working set, gradients and
            temporaries of the block being recomputed.
        recompute_flops: FLOPs recomputed in backward.
        recompute_ms: cost of the decision per step, ms: roofline time of the recomputed
            ops on the cost device (offload: exposed transfer time).
        recompute_bytes: bytes read and written by the recomputed ops.
    """

    parts: tuple[Part, ...]
    saved_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    recompute_flops: int
    recompute_ms: float
    recompute_bytes: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple((p, d) for p, d in self.parts
                                                if d.kind != "none"))
        for name in ("saved_bytes", "forward_peak_bytes", "backward_peak_bytes",
                     "recompute_flops", "recompute_bytes"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"Candidate({self.label()}): {name} must be >= 0, got {value}")
        if not self.recompute_ms >= 0:
            raise ValueError(f"Candidate({self.label()}): recompute_ms must be >= 0, "
                             f"got {self.recompute_ms}")

    @property
    def is_none(self) -> bool:
        """True for the candidate that keeps everything."""
        return not self.parts

    @property
    def offloads(self) -> bool:
        """True when a part offloads (its cost is transfer time, not recompute)."""
        return any(d.kind == "offload" for _, d in self.parts)

    def label(self) -> str:
        """``none``, a decision's label (``full``, ``ops[aten.mm]``), or ``attn=...; mlp=...``."""
        return parts_label(self.parts)

    def decisions_for(self, block_name: str) -> dict[str, BlockDecision]:
        """The decisions to apply, keyed by qualified module name, for block ``block_name``."""
        return {f"{block_name}.{path}" if path else block_name: d for path, d in self.parts}

    def dominates(self, other: Candidate) -> bool:
        """At most ``other`` in every number (ties count as dominating)."""
        return (self.saved_bytes <= other.saved_bytes
                and self.forward_peak_bytes <= other.forward_peak_bytes
                and self.backward_peak_bytes <= other.backward_peak_bytes
                and self.recompute_ms <= other.recompute_ms)


def parts_label(parts: Sequence[Part]) -> str:
    """Label of a candidate's parts (see :meth:`Candidate.label`)."""
    live = [(p, d) for p, d in parts if d.kind != "none"]
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
    """

    names: tuple[str, ...]
    candidates: tuple[Candidate, ...]


# ---- capturing block inputs ---------------------------------------------------------------

class _Captured(Exception):
    """Stops the capture forward once every wanted block has been reached."""


def _shape_key(value: Any) -> Any:
    if isinstance(value, Tensor):
        return ("T", tuple(value.shape), str(value.dtype), value.requires_grad)
    if isinstance(value, (tuple, list)):
        return tuple(_shape_key(v) for v in value)
    if isinstance(value, Mapping):
        return tuple((k, _shape_key(v)) for k, v in sorted(value.items()))
    return type(value).__name__


def capture_inputs(model: nn.Module, batch: Any, blocks: Sequence[tuple[str, nn.Module]], *,
                   mode: Any = None) -> dict[str, tuple[tuple[Any, ...], dict[str, Any]]]:
    """Arguments each of ``blocks`` is called with, from a forward stopped after the last one.

    Args:
        model: the model (fake or real).
        batch: its batch.
        blocks: the ``(name, module)`` pairs whose arguments are wanted, in forward order.
        mode: a context entered around the forward (the fake mode). Default: none.
    """
    from remat.measure.step import call_model

    captured: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    last = blocks[-1][0]

    def hook_for(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if name not in captured:
                captured[name] = (tuple(args), dict(kwargs))
            if name == last:
                raise _Captured
        return hook

    handles = [m.register_forward_pre_hook(hook_for(n), with_kwargs=True) for n, m in blocks]
    try:
        with mode if mode is not None else contextlib.nullcontext(), torch.enable_grad():
            try:
                call_model(model, batch, api="remat.plan")
            except _Captured:
                pass
    finally:
        for h in handles:
            h.remove()
    missing = [n for n, _ in blocks if n not in captured]
    if missing:
        raise BlocksNotFound(
            f"remat.plan: blocks {missing[:4]} were not called in the model's forward, so they "
            "cannot be planned; pass blocks= selecting the modules the forward runs"
        )
    return captured


def _group_key(block: nn.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
    params = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad)
                   for n, p in block.named_parameters())
    buffers = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in block.named_buffers())
    return (type(block), params, buffers, _shape_key(inputs[0]), _shape_key(inputs[1]))


# ---- one candidate, measured --------------------------------------------------------------

@dataclass(frozen=True)
class _Run:
    saved_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    ops: tuple[OpRecord, ...]


def _tensors_in(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors_in(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors_in(v)]
    return []


def apply_parts(model: nn.Module, name: str, parts: Sequence[Part],
                block_names: Sequence[str]) -> None:
    """Apply a candidate's ``parts`` to block ``name`` of ``model`` (undo with ``remove``)."""
    decisions = {f"{name}.{path}" if path else name: d for path, d in parts if d.kind != "none"}
    if any(key != name for key in decisions):
        spec = NamedBlocks(tuple(decisions))
    else:
        spec = NamedBlocks(tuple(block_names))
    with quiet():
        apply_decisions(model, decisions, blocks=spec)


def fresh_inputs(name: str, inputs: tuple[tuple[Any, ...], dict[str, Any]],
                 ) -> tuple[tuple[tuple[Any, ...], dict[str, Any]], Tensor]:
    """A block's arguments cut from the graph that made them, and its hidden-state input.

    Every tensor becomes a new leaf with the same ``requires_grad`` (the same tensor
    twice stays one leaf), so a block can run forward and backward again and again
    without reaching into the forward that captured its arguments: an encoder-decoder's
    ``encoder_hidden_states`` or T5's shared ``position_bias`` come from other blocks.
    The hidden state is the first tensor argument, the one activations hang from.

    Raises:
        ValueError: the block takes no tensor argument.
    """
    leaves: dict[int, Tensor] = {}

    def cut(value: Any) -> Any:
        if isinstance(value, Tensor):
            if id(value) not in leaves:
                grad = value.requires_grad and value.is_floating_point()
                leaves[id(value)] = value.detach().requires_grad_(grad)
            return leaves[id(value)]
        if isinstance(value, (tuple, list)):
            return type(value)(cut(v) for v in value)
        if isinstance(value, dict):
            return {k: cut(v) for k, v in value.items()}
        return value

    args, kwargs = inputs
    new_args, new_kwargs = tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}
    hidden = first_tensor(new_args) if new_args else first_tensor(new_kwargs)
    if hidden is None:
        raise ValueError(f"remat.plan: block {name!r} takes no tensor argument to plan around")
    return (new_args, new_kwargs), hidden


# NOTE [ Gradient of the block output ]
#   In the whole step, the gradient of a block's output is made by the next block's
#   backward and freed by autograd as soon as this block's backward has used it. Passing
#   a gradient tensor to ``backward()`` would keep it alive through the whole backward,
#   over-counting the working set of candidates whose peak comes late. So the block's
#   output is reduced to a scalar through a fixed weight instead: autograd makes the
#   output's gradient itself and frees it as it would in the step. That gradient is
#   counted in this window rather than the previous one, the same for every candidate,
#   and the peak model's calibration (peak.py) absorbs the constant.


def _run_block(setup: FakeSetup, name: str, block: nn.Module,
               inputs: tuple[tuple[Any, ...], dict[str, Any]], parts: Sequence[Part],
               attribution: Sequence[tuple[str, nn.Module]] = ()) -> _Run:
    """Forward and backward of one block under ``parts``, tracked (see module docstring)."""
    apply_parts(setup.model, name, parts, [n for n, _ in setup.blocks])
    try:
        with setup.mode:
            (args, kwargs), x = fresh_inputs(name, inputs)
        for p in block.parameters():
            p.grad = None
        tracker = MemoryTracker(device=setup.device, blocks=list(attribution) or [(name, block)])
        tracker.register_model(block)
        tracker.register([x, *_tensors_in(args), *_tensors_in(kwargs)], "other")
        windows = WindowRecorder(tracker)
        weights: list[Tensor] = []
        with setup.mode, tracker, windows, torch.enable_grad():
            windows.open("fwd")
            out = block(*args, **kwargs)
            windows.open("saved")
            y = first_tensor(out)
            if y is None or not y.requires_grad:
                raise ValueError(
                    f"remat.plan: block {name!r} returned no tensor that requires grad, so "
                    "there is nothing to checkpoint in it"
                )
            # See NOTE [ Gradient of the block output ].
            with torch.no_grad():
                weights.append(torch.ones_like(y))
            tracker.register(weights, "other")
            loss = (y * weights[0]).sum()
            del out, y
            tracker.set_phase("backward")
            windows.open("bwd")
            loss.backward()
            del loss
        saved = windows.starts["saved"] - windows.starts["fwd"]
        return _Run(
            saved_bytes=saved,
            forward_peak_bytes=windows.peaks["fwd"] - windows.starts["fwd"],
            backward_peak_bytes=windows.peaks["bwd"] - windows.starts["bwd"] + saved,
            ops=tracker.ops,
        )
    finally:
        remove(setup.model)
        for p in block.parameters():
            p.grad = None


# ---- the save-set chain -------------------------------------------------------------------

def _is_attention(op_name: str) -> bool:
    return "attention" in op_name


def save_set_chain(forward_ops: Sequence[OpRecord], device: DeviceSpec, *,
                   max_light_ops: int = _MAX_LIGHT_OPS,
                   exhaustive_up_to: int = 0) -> list[frozenset[str]]:
    """Save sets of increasing size for op-level checkpointing (NOTE [ Candidate decisions ], 3).

    Compute-heavy ops (matmuls, attention) called more than once in the region enter
    the sets call by call (``"aten.mm#2"``, see ``remat.strategies.ops``), so the
    cheapest matmuls per byte can be recomputed while the others are kept; pointwise
    ops enter by name. A set holding every call of an op names the op instead.

    Args:
        forward_ops: the region's forward ops without checkpointing, in order.
        device: the cost device (ranks entries by roofline time per output byte).
        max_light_ops: at most this many pointwise op names are added. Default: 4.
        exhaustive_up_to: with at most this many entries, every proper subset follows
            the chain. Default: 0 (the chain only).

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
    out_bytes: dict[str, int] = {}
    cost_ms: dict[str, float] = {}
    entries_of: dict[str, list[str]] = {}
    for name, ops in calls.items():
        if name in excluded:
            continue
        per_call = len(ops) > 1 and (name in COMPUTE_HEAVY_OPS or _is_attention(name))
        entries = [call_entry(name, i) for i in range(len(ops))] if per_call else [name]
        groups = [[op] for op in ops] if per_call else [ops]
        for entry, group in zip(entries, groups, strict=True):
            written = sum(op.write_bytes for op in group)
            cost = sum(op_roofline_ms(op, device) for op in group)
            if written > 0 and cost > 0:
                out_bytes[entry], cost_ms[entry] = written, cost
                entries_of.setdefault(name, []).append(entry)
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


# ---- all candidates of all groups ---------------------------------------------------------

def _candidate(parts: Sequence[Part], run: _Run, device: DeviceSpec,
               base: _Run | None = None) -> Candidate:
    recompute = [op for op in run.ops if op.phase == "recompute"]
    ms = sum(op_roofline_ms(op, device) for op in recompute)
    if base is not None and any(d.kind == "offload" for _, d in parts):
        ms += _offload_exposed_ms(run, base, device)
    return Candidate(
        parts=tuple(parts),
        saved_bytes=run.saved_bytes,
        forward_peak_bytes=run.forward_peak_bytes,
        backward_peak_bytes=run.backward_peak_bytes,
        recompute_flops=sum(op.flops for op in recompute),
        recompute_ms=ms,
        recompute_bytes=sum(op.bytes_moved for op in recompute),
    )


def _offload_exposed_ms(run: _Run, base: _Run, device: DeviceSpec) -> float:
    """Transfer time not hidden behind the block's compute (copies out in forward, in in
    backward, each overlapping that pass's kernels)."""
    moved = max(base.saved_bytes - run.saved_bytes, 0)
    transfer_ms = moved / device.host_link_bytes_per_s * 1e3
    fwd_ms = sum(op_roofline_ms(op, device) for op in base.ops if op.phase == "forward")
    bwd_ms = sum(op_roofline_ms(op, device) for op in base.ops if op.phase == "backward")
    return max(transfer_ms - fwd_ms, 0.0) + max(transfer_ms - bwd_ms, 0.0)


def prune_candidates(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Drop candidates another one matches or beats in every number (``none`` stays)."""
    kept: list[Candidate] = []
    for i, c in enumerate(candidates):
        dominated = not c.is_none and any(
            other.dominates(c) and (not c.dominates(other) or j < i)
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


def _sublayers(block: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    found: dict[str, tuple[str, nn.Module]] = {}
    for kind in ("attn", "mlp"):
        try:
            found[kind] = find_sublayer(block, kind)  # type: ignore[arg-type]
        except BlocksNotFound:
            continue
    return found


def _ops_of(run: _Run, module_name: str) -> list[OpRecord]:
    return [op for op in run.ops if op.phase == "forward" and op.block == module_name]


def _measure_kind(setup: FakeSetup, rep: str, block: nn.Module,
                  inputs: tuple[tuple[Any, ...], dict[str, Any]], device: DeviceSpec,
                  max_composites: int) -> list[Candidate]:
    """Every candidate of one kind of block (NOTE [ Candidate decisions ])."""
    subs = _sublayers(block)
    attribution = [(rep, block), *((f"{rep}.{path}", m) for path, m in subs.values())]
    none_run = _run_block(setup, rep, block, inputs, (), attribution)
    measured: dict[tuple[Part, ...], Candidate] = {(): _candidate((), none_run, device)}

    def measure(parts: tuple[Part, ...]) -> _Run:
        run = _run_block(setup, rep, block, inputs, parts)
        measured[parts] = _candidate(parts, run, device, base=none_run)
        return run

    def measure_offload() -> None:
        try:
            measure((("", BlockDecision("offload")),))
        except (RuntimeError, NotImplementedError) as exc:  # e.g. pinned memory when faked
            warnings.warn(f"remat.plan: could not measure offloading {rep!r} ({exc}); "
                          "planning without offload", RematWarning, stacklevel=3)

    # 1., 3. and 4.: block-level decisions.
    block_ops = [op for op in none_run.ops if op.phase == "forward"]
    block_level = [BlockDecision("full"),
                   *(BlockDecision("ops", s) for s in save_set_chain(
                       block_ops, device, max_light_ops=_MAX_LIGHT_OPS_BLOCK))]
    for decision in block_level:
        measure((("", decision),))
    if setup.device.type == "cuda":
        measure_offload()
    # 2. and 5.: each sub-layer on its own, then the promising pairs.
    singles: dict[str, list[tuple[Part, _Run]]] = {}
    for kind, (path, _) in subs.items():
        sub_ops = _ops_of(none_run, f"{rep}.{path}")
        options: list[Part] = [("", BlockDecision(kind))]  # type: ignore[arg-type]
        options += [(path, BlockDecision("ops", s))
                    for s in save_set_chain(sub_ops, device, exhaustive_up_to=_EXHAUSTIVE)]
        singles[kind] = [((path, BlockDecision("none")), none_run)]
        for part in options:
            run = measure((part,))
            singles[kind].append(((path, BlockDecision("full")) if part[0] == "" else part,
                                  run))
    if len(singles) == 2:
        base_saved = none_run.saved_bytes
        estimates: list[tuple[int, float, Any]] = []
        for part_a, run_a in singles["attn"][1:]:
            for part_m, run_m in singles["mlp"][1:]:
                cost = (_candidate((), run_a, device).recompute_ms
                        + _candidate((), run_m, device).recompute_ms)
                saved = run_a.saved_bytes + run_m.saved_bytes - base_saved
                estimates.append((saved, cost, (part_a, part_m)))
        known = [(c.saved_bytes, c.recompute_ms, None) for c in measured.values()]
        for pair in _pareto(estimates + known, max_composites + len(known)):
            if pair is not None:
                measure(tuple(pair))
    return list(measured.values())


def measure_groups(setup: FakeSetup, device: DeviceSpec, *, prune: bool = True,
                   max_composites: int = 8) -> list[BlockGroup]:
    """Measure every candidate of every kind of block in ``setup``'s model.

    Args:
        setup: the fake model, batch and blocks (see ``_sim.fake_setup``).
        device: the cost device (roofline figures).
        prune: drop candidates another candidate beats in every number. Default: True.
        max_composites: at most this many attention+MLP pairs are measured per kind of
            block (the most promising by their parts' numbers). Default: 8.

    Returns:
        One :class:`BlockGroup` per kind of block, in order of first appearance.
    """
    inputs = capture_inputs(setup.model, setup.batch, setup.blocks, mode=setup.mode)
    groups: dict[Any, list[str]] = {}
    for name, block in setup.blocks:
        groups.setdefault(_group_key(block, inputs[name]), []).append(name)
    modules = dict(setup.blocks)
    result: list[BlockGroup] = []
    for names in groups.values():
        rep = names[0]
        candidates = _measure_kind(setup, rep, modules[rep], inputs[rep], device,
                                   max_composites)
        if prune:
            candidates = prune_candidates(candidates)
        result.append(BlockGroup(tuple(names), tuple(candidates)))
    return result
