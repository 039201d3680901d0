"""The :class:`Plan`: what each block gets, with its predicted and measured cost.

One concept, one module: the plan, its JSON, and the small values it is made of (the
named blocks its file selects, the throughput search's rows). A plan is what
:func:`remat.plan` returns and what :func:`remat.apply` applies (``apply`` reads
``plan.decisions`` and ``plan.blocks``). It is a
frozen value: measuring it again or searching batch sizes returns a new plan
(``dataclasses.replace``). Plans round-trip through JSON (:meth:`Plan.to_json`,
:meth:`Plan.from_json`) so a plan made once, on any machine, can be applied in a
training script.

NOTE [ Plan JSON format ]
    ``{"format": "remat.plan", "version": 2, "framework": "torch", ...}``: the envelope
    every plan file has (NOTE [ Plan file envelope ] in remat/core/plan_file.py). The
    version changes whenever a field changes meaning; :meth:`Plan.from_json` reads only
    versions it knows and says which it reads otherwise. Version 2 stores what each
    module gets as the strategy's name and fields, ``{"name": "ops", "fields":
    {"save_ops": [...]}}``, so a registered strategy's fields survive the file; version
    1 (remat 0.1) stored ``{"kind": ..., "save_ops": ...}`` and still reads. Custom
    ``blocks=`` specs (classes or predicates) are not serialisable, so the file stores
    the block names and reads back a :class:`NamedBlocks` selecting exactly those
    modules. Fields added later with a default that keeps the old meaning
    (``cost_source``, ``timed_on``, ``framework``, ``fingerprint``, ``compiled``,
    ``allocator_peak_bytes``, ``source``, ``accumulating``) do not
    change the version: an older file reads as before (a plan without a fingerprint is
    applied unchecked; one without ``compiled`` is for eager execution). A file whose
    ``framework`` is not ``"torch"`` is refused with the loader to use.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

from torch import nn

from remat.blocks import BlocksSpec, NamedBlocks
from remat.compiled.install import check_compiled
from remat.core.checks import check_float, check_int, decisions_label, opt_float, opt_int
from remat.core.cost import StepCost
from remat.core.plan_file import envelope, load_json, read_envelope
from remat.core.shapes import ShapeEnvelope, check_on_new_shape
from remat.errors import message, one_line
from remat.planning.fingerprint import BlockPrint, check_fingerprint
from remat.strategies import BlockStrategy, strategy_from_dict, strategy_to_dict
from remat.strategies.builtin import NoCheckpoint
from remat.strategies.head import HEAD_KEY

#: Version of the JSON written by :meth:`Plan.to_json` (see NOTE [ Plan JSON format ]).
PLAN_FORMAT_VERSION = 2
#: Versions :meth:`Plan.from_json` reads (1: remat 0.1's decisions as kind and save set).
_READS = (1, 2)
#: Where a plan's costs come from: op counts on a device spec, or timed runs.
COST_SOURCES: tuple[str, ...] = ("roofline", "measured")


@dataclass(frozen=True)
class Plan:
    """A checkpointing decision per block, and what it is predicted and measured to cost.

    Made by :func:`remat.plan` (cheapest recompute whose peak fits a budget) and
    applied with ``remat.apply(model, plan)``. Blocks not in ``decisions`` keep all
    their activations (``"none"``); a plan with no decision is the *empty plan*.

    Args:
        decisions: per qualified module name, the block-level strategy *instance* it
            gets (:class:`~remat.strategies.BlockStrategy`: ``Full()``,
            ``SelectiveOps(save_ops=...)``, ``Offload()``, or a registered strategy with
            its fields). Keys are blocks, or sub-layers inside a block when the plan
            decides on a sub-layer: a module's path (``"blocks.3.mlp"``) or a method's
            (``"blocks.3._ffn_forward"``), the one spelling remat writes for a sub-layer
            choice. ``"none"`` entries are dropped.
        block_names: every block of the model, in forward order.
        budget_bytes: the peak-memory budget the plan was made for, bytes.
        cost: the plan's predicted step, a :class:`~remat.core.cost.StepCost`:
            ``peak_bytes`` (the step's peak the peak model predicts, bytes),
            ``recompute_flops`` (FLOPs recomputed per step), ``recompute_ms`` (recompute
            cost per step, ms: with ``cost_source="roofline"`` the roofline time of the
            recomputed ops on ``cost_device``, plus exposed transfer time for offload;
            with ``"measured"`` the sum of each block's measured extra forward+backward
            time on ``timed_on``; ``None`` reads as 0.0) and ``step_ms`` (time of the
            whole step, ms: the step-time model on ``cost_device`` (``"roofline"``), or
            a timed step of the model with the plan applied (``"measured"``); ``None``
            when not known). ``predicted_peak_bytes``, ``recompute_flops``,
            ``recompute_ms`` and ``predicted_step_ms`` are read-only views of it.
        measured_peak_bytes: the step's peak measured with the plan applied
            (``remat.profile(...).peak_bytes``); ``None`` until measured.
        no_checkpoint_peak_bytes: the un-checkpointed step's peak, bytes (what ``"60%"``
            budgets are relative to). Default: ``None``.
        cost_device: the device whose figures the costs use. Default: ``"h100-80gb"``.
        cost_source: ``"roofline"`` (costs from op counts on ``cost_device``) or
            ``"measured"`` (timed on the model's device). Default: ``"roofline"``.
        timed_on: with ``"measured"``, the device the times come from, e.g.
            ``"cuda:0 (NVIDIA H100 80GB HBM3)"``. Default: ``None``.
        blocks: the ``blocks=`` spec ``remat.apply`` finds the blocks with: the spec the
            plan was made with (``None``: automatic), or a :class:`NamedBlocks` read from a
            plan file. Decisions on sub-layers are found under their blocks (NOTE
            [ Decision keys ] in remat/strategies/apply.py).
        batch_size: samples per step the plan is for, when known. Default: ``None``.
        throughput: the throughput search's table (:func:`remat.plan_throughput`), else ``()``.
        framework: the framework the plan is for; ``"torch"`` here (JAX plans are
            :class:`remat.jax` plans). Default: ``"torch"``.
        fingerprint: what the plan was made for, one :class:`BlockPrint` per block (class,
            parameter digest); ``remat.apply`` refuses a model that differs (NOTE
            [ Plan fingerprint ]). ``None``: not checked. Default: ``None``.

    Example:
        >>> plan = remat.plan(model, batch, budget="60%")
        >>> remat.apply(model, plan)
        >>> Plan.from_json(plan.to_json()) == plan
        True
        compiled: for compiled execution (:func:`remat.plan_compiled`): block name ->
            the compiler's activation memory budget that block is compiled with by
            ``remat.apply``, or ``{"": budget}``: the whole model compiled at one budget
            (the compiler's own setting won); ``None``: an eager plan. Default: ``None``.
        allocator_peak_bytes: the step's peak on the device's allocator with the plan
            applied (``Profile.allocator_peak_bytes``), which the closed loop checks
            against the budget when the step runs for real (NOTE [ Fits on the
            allocator ]); the higher of the first step after apply and a steady step
            (NOTE [ The first step ] in measure/profile.py); ``None`` when simulated.
            Default: ``None``.
        reserved_peak_bytes: the predicted reserved peak of the planned step under
            PyTorch's CUDA caching allocator, library workspaces included, which a
            ``budget="device"`` plan keeps within ``budget_bytes`` (the card's capacity
            less what lives outside the allocator: NOTE [ Fits on the card ] in
            card_fit.py); ``None`` for other budgets. Default: ``None``.
        source: what made the decisions: ``"planner"`` (the solver's choice), or the
            built-in strategy (``"every:2"``) the closed loop measured cheaper than the
            solver's choice, fitting the same budget (NOTE [ Never worse than manual ] in
            planning/manual.py). Default: ``"planner"``.
        source_note: why, when ``source`` is a built-in strategy (its executed recompute
            against the solver's choice's). Default: ``None``.
        accumulating: the step planned is a gradient-accumulation micro-step, which starts
            with the earlier micro-steps' gradients held (``remat.plan(...,
            accumulating=True)``); a replan from the shape guard plans such a step too.
            Default: ``False``.
    """

    decisions: Mapping[str, BlockStrategy]
    block_names: tuple[str, ...]
    budget_bytes: int
    cost: StepCost
    measured_peak_bytes: int | None = None
    no_checkpoint_peak_bytes: int | None = None
    cost_device: str = "h100-80gb"
    cost_source: str = "roofline"
    timed_on: str | None = None
    blocks: BlocksSpec = field(default=None, compare=False)
    batch_size: int | None = None
    throughput: tuple[ThroughputRow, ...] = ()
    framework: str = "torch"
    fingerprint: tuple[BlockPrint, ...] | None = None
    compiled: Mapping[str, float] | None = None
    allocator_peak_bytes: int | None = None
    reserved_peak_bytes: int | None = None
    source: str = "planner"
    source_note: str | None = None
    shape_envelope: ShapeEnvelope | None = None
    on_new_shape: str = "error"
    accumulating: bool = False

    def __post_init__(self) -> None:
        names = tuple(self.block_names)
        object.__setattr__(self, "block_names", names)
        if len(set(names)) != len(names):
            raise ValueError(message("Plan", "block_names has duplicates",
                                     {"block_names": sorted(names)}, fix="name each block once"))
        decisions: dict[str, BlockStrategy] = {}
        for name, decision in dict(self.decisions).items():
            if not isinstance(decision, BlockStrategy):
                raise ValueError(message(
                    "Plan", f"what {name!r} gets must be a block-level strategy",
                    {"found": f"{decision!r} ({type(decision).__name__})"},
                    fix="pass a remat.BlockStrategy, e.g. parse_strategy('full')"))
            if name != HEAD_KEY and owner_block(name, names) is None:
                raise ValueError(message(
                    "Plan", f"decision for {name!r}, which is neither a block nor inside one",
                    {"block_names": f"{', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"},
                    fix="key decisions by a name of block_names or a module inside one"))
            if not isinstance(decision, NoCheckpoint):
                decisions[name] = decision
        order = {n: i for i, n in enumerate(names)}
        order[HEAD_KEY] = len(names)  # the output head runs after the last block
        ordered = dict(sorted(decisions.items(), key=lambda kv: (
            order[HEAD_KEY if kv[0] == HEAD_KEY else owner_block(kv[0], names) or ""],
            kv[0])))
        object.__setattr__(self, "decisions", MappingProxyType(ordered))
        object.__setattr__(self, "throughput", tuple(self.throughput))
        check_int("Plan", "budget_bytes", self.budget_bytes)
        if not isinstance(self.cost, StepCost):
            raise ValueError(message("Plan", "cost must be a remat.StepCost (the predicted step)",
                                     {"found": repr(self.cost)},
                                     fix="build it with StepCost(peak_bytes=..., "
                                         "recompute_flops=..., recompute_ms=..., step_ms=...)"))
        if self.cost.recompute_ms is None:  # one spelling of "no recompute time": 0.0
            object.__setattr__(self, "cost", replace(self.cost, recompute_ms=0.0))
        check_int("Plan", "measured_peak_bytes", self.measured_peak_bytes, optional=True)
        check_int("Plan", "allocator_peak_bytes", self.allocator_peak_bytes, optional=True)
        check_int("Plan", "reserved_peak_bytes", self.reserved_peak_bytes, optional=True)
        check_int("Plan", "no_checkpoint_peak_bytes", self.no_checkpoint_peak_bytes,
                   optional=True)
        check_int("Plan", "batch_size", self.batch_size, optional=True)
        if not isinstance(self.accumulating, bool):
            raise ValueError(message("Plan", "accumulating must be True or False",
                                     {"found": repr(self.accumulating)},
                                     fix="pass accumulating=True for a gradient-accumulation "
                                         "micro-step's plan"))
        if self.framework != "torch":
            raise ValueError(message("Plan", f"framework must be 'torch', not {self.framework!r}",
                                     fix="use remat.jax.Plan for JAX plans"))
        if self.cost_source not in COST_SOURCES:
            raise ValueError(message("Plan", f"unknown cost_source {self.cost_source!r}",
                                     fix=f"pass one of {COST_SOURCES}"))
        if (self.timed_on is None) != (self.cost_source == "roofline"):
            raise ValueError(message(
                "Plan", "timed_on is set exactly when cost_source is 'measured'",
                {"cost_source": repr(self.cost_source), "timed_on": repr(self.timed_on)},
                fix="set timed_on to the device measured costs come from, and only then"))
        if self.fingerprint is not None:
            prints = tuple(self.fingerprint)
            object.__setattr__(self, "fingerprint", prints)
            if not all(isinstance(p, BlockPrint) for p in prints) or \
                    [p.name for p in prints] != list(names):
                raise ValueError(message(
                    "Plan", "fingerprint needs one BlockPrint per block of block_names, in order",
                    {"fingerprint": [getattr(p, 'name', p) for p in prints][:4],
                     "block_names": list(names)[:4]},
                    fix="let remat.plan fill it, or pass None"))
        if self.compiled is not None:
            object.__setattr__(self, "compiled", check_compiled(self.compiled, names, api="Plan"))
        if self.shape_envelope is not None and \
                not isinstance(self.shape_envelope, ShapeEnvelope):
            raise ValueError(message("Plan", "shape_envelope must be a remat.ShapeEnvelope",
                                     {"found": repr(self.shape_envelope)[:80]},
                                     fix="let remat.plan fill it, or pass None"))
        check_on_new_shape(self.on_new_shape, api="Plan")

    def check_model(self, model: nn.Module, *, api: str = "remat.apply") -> None:
        """Refuse a model the plan was not made for (NOTE [ Plan fingerprint ]).

        ``remat.apply(model, plan)`` calls it. A plan without a fingerprint passes.

        Raises:
            StrategyError: a block is missing or has another class or other parameters,
                or a block's container holds more or fewer blocks; the message says which.
        """
        if self.fingerprint is not None:
            check_fingerprint(self.fingerprint, model, api=api)

    # ---- reading -------------------------------------------------------------------------

    def decision(self, name: str) -> BlockStrategy:
        """The decision for module ``name`` (``"none"`` when the plan leaves it alone).

        ``name`` is a block, or a sub-layer the plan decides on (``"blocks.3.mlp"``);
        a block whose sub-layers are decided on has decision ``"none"`` itself (see
        :meth:`block_decisions`).

        Raises:
            KeyError: ``name`` is not a block of the plan nor inside one.
        """
        if name != HEAD_KEY and owner_block(name, self.block_names) is None:
            raise KeyError(one_line(message("Plan.decision", f"no block {name!r}",
                                            {"blocks": ", ".join(self.block_names[:6])},
                                            fix="pass a block name or a module inside one")))
        return self.decisions.get(name, NoCheckpoint())

    def block_decisions(self, block: str) -> dict[str, BlockStrategy]:
        """The decisions on ``block`` and on modules inside it, by qualified name."""
        if block not in self.block_names:
            raise KeyError(one_line(message("Plan.block_decisions", f"no block {block!r}",
                                            fix="pass one of the plan's block_names")))
        return {n: d for n, d in self.decisions.items() if owner_block(n, (block,)) == block}

    def label_of(self, block: str) -> str:
        """``"none"``, ``"full"``, ``"ops[aten.mm]"`` or ``"attn=...; mlp=..."`` for ``block``."""
        parts = self.block_decisions(block)
        if not parts:
            return "none"
        if list(parts) == [block]:
            return parts[block].label()
        return "; ".join(f"{n[len(block) + 1:] if n != block else 'block'}={d.label()}"
                         for n, d in parts.items())

    @property
    def is_empty(self) -> bool:
        """True when no block is checkpointed (the budget needs no checkpointing)."""
        return not self.decisions

    # ---- views of cost (read-only; the figures live in ``cost``) -------------------------

    @property
    def predicted_peak_bytes(self) -> int:
        """``cost.peak_bytes``: the step's peak the peak model predicts, bytes."""
        return self.cost.peak_bytes

    @property
    def recompute_flops(self) -> int:
        """``cost.recompute_flops``: FLOPs recomputed per step."""
        return self.cost.recompute_flops

    @property
    def recompute_ms(self) -> float:
        """``cost.recompute_ms``: recompute cost per step, ms."""
        return self.cost.recompute_ms or 0.0

    @property
    def predicted_step_ms(self) -> float | None:
        """``cost.step_ms``: time of the whole step, ms; ``None`` when not known."""
        return self.cost.step_ms

    @property
    def measured_or_predicted_peak_bytes(self) -> int:
        """``measured_peak_bytes`` when the plan was measured, else
        ``predicted_peak_bytes``: the best figure known of the step's peak, bytes. A plan
        has no plain ``peak_bytes``: read the one of the two you mean."""
        return self.measured_peak_bytes if self.measured_peak_bytes is not None \
            else self.predicted_peak_bytes

    def label(self) -> str:
        """Decision counts in block order of first use, e.g. ``"4 none, 2 ops[aten.mm]"``."""
        return decisions_label(self.label_of(name) for name in self.block_names)

    # ---- JSON ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (see NOTE [ Plan JSON format ])."""
        return {
            **envelope(self.framework, PLAN_FORMAT_VERSION),
            "block_names": list(self.block_names),
            "decisions": {n: strategy_to_dict(d) for n, d in self.decisions.items()},
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "allocator_peak_bytes": self.allocator_peak_bytes,
            "reserved_peak_bytes": self.reserved_peak_bytes,
            "recompute_flops": self.recompute_flops,
            "recompute_ms": self.recompute_ms,
            "predicted_step_ms": self.predicted_step_ms,
            "no_checkpoint_peak_bytes": self.no_checkpoint_peak_bytes,
            "cost_device": self.cost_device,
            "cost_source": self.cost_source,
            "timed_on": self.timed_on,
            "blocks": None if self.blocks is None else {"names": list(
                self.blocks.names if isinstance(self.blocks, NamedBlocks) else self.block_names
            )},
            "batch_size": self.batch_size,
            "throughput": [vars(row).copy() for row in self.throughput],
            "fingerprint": None if self.fingerprint is None else [
                {"name": p.name, "class": p.cls, "params": p.params, "siblings": p.siblings}
                for p in self.fingerprint
            ],
            "compiled": None if self.compiled is None else dict(self.compiled),
            "source": self.source,
            "source_note": self.source_note,
            "shape_envelope": None if self.shape_envelope is None
            else self.shape_envelope.to_dict(),
            "on_new_shape": self.on_new_shape,
            "accumulating": self.accumulating,
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        """The plan as JSON text; read it back with :meth:`Plan.from_json`."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Rebuild a plan written by :meth:`to_dict`.

        Raises:
            ValueError: not a plan, or a format version this remat does not read.
        """
        read_envelope(data, framework="torch", versions=_READS, api="remat.Plan.from_json",
                      make="remat.plan(...)")
        try:
            names = tuple(str(n) for n in data["block_names"])
            decisions = {str(n): strategy_from_dict(d, where=repr(n),
                                                    api="remat.Plan.from_json")
                         for n, d in dict(data.get("decisions") or {}).items()}
            blocks = data.get("blocks")
            return cls(
                decisions=decisions,
                block_names=names,
                budget_bytes=int(data["budget_bytes"]),
                cost=StepCost(peak_bytes=int(data["predicted_peak_bytes"]),
                              recompute_flops=int(data.get("recompute_flops", 0)),
                              recompute_ms=float(data.get("recompute_ms", 0.0)),
                              step_ms=opt_float(data.get("predicted_step_ms"))),
                measured_peak_bytes=opt_int(data.get("measured_peak_bytes")),
                allocator_peak_bytes=opt_int(data.get("allocator_peak_bytes")),
                reserved_peak_bytes=opt_int(data.get("reserved_peak_bytes")),
                no_checkpoint_peak_bytes=opt_int(data.get("no_checkpoint_peak_bytes")),
                cost_device=str(data.get("cost_device", "h100-80gb")),
                cost_source=str(data.get("cost_source", "roofline")),
                timed_on=None if data.get("timed_on") is None else str(data["timed_on"]),
                blocks=NamedBlocks(tuple(blocks["names"])) if blocks else None,
                batch_size=opt_int(data.get("batch_size")),
                throughput=tuple(ThroughputRow(**row) for row in data.get("throughput") or ()),
                fingerprint=None if data.get("fingerprint") is None else tuple(
                    print_from_dict(p) for p in data["fingerprint"]),
                compiled=data.get("compiled"),
                source=str(data.get("source", "planner")),
                source_note=None if data.get("source_note") is None
                else str(data["source_note"]),
                shape_envelope=None if data.get("shape_envelope") is None else
                ShapeEnvelope.from_dict(data["shape_envelope"]),
                on_new_shape=str(data.get("on_new_shape", "error")),
                accumulating=bool(data.get("accumulating", False)),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(message("remat.Plan.from_json", "malformed plan",
                                     {"error": f"{type(exc).__name__}: {exc}"},
                                     fix="write plans with plan.to_json()")) from None

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan written by :meth:`to_json`.

        Raises:
            ValueError: not JSON, not a plan, or an unsupported format version (the
                message names the version found and the one this remat reads).

        Example:
            >>> Plan.from_json(plan.to_json()).decisions == plan.decisions
            True
        """
        return cls.from_dict(load_json(text, api="remat.Plan.from_json"))

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        # The read-only decisions view cannot be pickled; rebuild from a plain dict.
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        state["decisions"] = dict(self.decisions)
        return _rebuild_plan, (state,)

    def with_measurement(self, measured_peak_bytes: int) -> Plan:
        """A copy with ``measured_peak_bytes`` set."""
        return replace(self, measured_peak_bytes=int(measured_peak_bytes))


def _rebuild_plan(state: dict[str, Any]) -> Plan:
    return Plan(**state)


# ---- the small values a Plan is made of ----------------------------------------------------


@dataclass(frozen=True)
class ThroughputRow:
    """One batch size tried by the throughput search (:func:`remat.plan_throughput`).

    Args:
        batch_size: samples per step.
        fits: whether some plan fits the budget at this batch size.
        decisions: short description of the best plan, e.g. ``"4 none, 2 ops[aten.mm]"``;
            ``""`` when nothing fits.
        peak_bytes: the plan's peak (measured when known, else predicted); for a batch size
            that does not fit, the smallest reachable peak.
        recompute_ms: the plan's recompute cost (roofline), ms.
        step_ms: predicted step time, ms.
        samples_per_s: ``batch_size / step_ms * 1000``; 0 when nothing fits.
    """

    batch_size: int
    fits: bool
    decisions: str
    peak_bytes: int
    recompute_ms: float
    step_ms: float
    samples_per_s: float

    def __post_init__(self) -> None:
        owner = f"ThroughputRow(batch_size={self.batch_size})"
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) \
                or self.batch_size < 1:
            raise ValueError(message("ThroughputRow", "batch_size must be an int >= 1",
                                     {"found": repr(self.batch_size)},
                                     fix="pass batch_size >= 1"))
        check_int(owner, "peak_bytes", self.peak_bytes)
        for name in ("recompute_ms", "step_ms", "samples_per_s"):
            check_float(owner, name, getattr(self, name))


def owner_block(name: str, blocks: Sequence[str]) -> str | None:
    """The block ``name`` is, or lies inside; None if neither."""
    for block in blocks:
        if name == block or name.startswith(block + "."):
            return block
    return None


def print_from_dict(data: Any) -> BlockPrint:
    if not isinstance(data, Mapping):
        raise TypeError(message("", "fingerprint entries must be objects",
                                {"found": repr(data)},
                                fix='write {"name": ..., "class": ..., "params": ...}'))
    return BlockPrint(str(data["name"]), str(data["class"]), str(data["params"]),
                      int(data.get("siblings", 1)))
