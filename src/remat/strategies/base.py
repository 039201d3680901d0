"""What a strategy is: a frozen config (plain data), apart from its handler (behaviour).

Every strategy remat knows is a config class, a subclass of :class:`Strategy`, registered
by name in :mod:`remat.strategies.registry` (``"full"``, ``"every:2"``, ...) together with
its handler (:mod:`remat.strategies.handler`), as torchao registers a handler per config
type. A config *instance* is a frozen dataclass whose fields are the strategy's settings
(``EveryN(n=2)``, ``SelectiveOps(save_ops=frozenset({"aten.mm"}))``), and that instance
is the one value that travels: ``remat.apply`` installs it, a Plan holds it per module, a
plan file stores it as ``{"name": ..., "fields": {...}}`` and reads it back. Nothing turns
an instance into a name and back, so no field is lost on the way. A config holds its
fields, validates them in ``__post_init__`` and says how it is shown (:meth:`label`);
everything it does (installing, the planner's offers, how the CLI spells and lists it) is
its handler's. Adding a strategy is one module: a config, a handler, and
:func:`remat.register_strategy` (docs/extending.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from remat.core.op_record import OpRecord
from remat.devices import DeviceSpec
from remat.errors import message

if TYPE_CHECKING:
    from remat.strategies.op_graph import OpGraph


Part = tuple[str, "BlockStrategy"]
"""``(path, strategy)``: ``""`` for the block itself, else a sub-layer's path in the block."""

Purpose = Literal["compare", "simulate", "frontier"]
"""Where a list of strategies is shown: ``remat compare``, ``remat simulate``, the frontier."""


@dataclass(frozen=True)
class BlockContext:
    """What a block-level strategy sees when it offers planner candidates.

    Args:
        forward_ops: the block's forward ops without checkpointing, in order.
        sublayers: per sub-layer kind found in the block (``"attn"``, ``"mlp"``), its
            path in the block and its forward ops.
        cost_device: the device whose roofline figures rank ops.
        runs_on: the device type the model runs on (``"cpu"``, ``"cuda"``, ...).
        recomputed: per region (``""`` for the block, else a sub-layer kind), the ops its
            backward recomputes when the region alone is fully checkpointed, in order.
            Checkpointing stops recomputing once every tensor backward needs is back, so
            a region's last ops may never be recomputed, and keeping their outputs
            saves nothing. Default: empty (not measured).
        graphs: per region, which calls each save-set entry frees from recompute
            (:class:`~remat.strategies.op_graph.OpGraph`). Default: empty (not recorded).
        model_blocks: how many blocks the model has, 0 when unknown: with few, each
            block's choice is a large step of the budget, and strategies may offer
            denser candidates (NOTE [ Dense hull for shallow models ] in
            strategies/builtin/ops.py). Default: 0.
    """

    forward_ops: tuple[OpRecord, ...]
    sublayers: Mapping[str, tuple[str, tuple[OpRecord, ...]]]
    cost_device: DeviceSpec
    runs_on: str
    recomputed: Mapping[str, tuple[OpRecord, ...]] = field(default_factory=dict)
    graphs: Mapping[str, OpGraph] = field(default_factory=dict)
    model_blocks: int = 0

    def __post_init__(self) -> None:
        if self.model_blocks < 0:
            raise ValueError(message("BlockContext", "model_blocks must be >= 0",
                                     {"found": self.model_blocks},
                                     fix="pass the model's block count, or 0 when unknown"))


@dataclass(frozen=True)
class Offer:
    """One candidate a strategy asks the planner to measure on a kind of block.

    Args:
        parts: what each module of the block gets, e.g. ``(("", Full()),)`` for the
            block, ``(("self_attn", Full()),)`` for its attention sub-layer.
        sublayer: the sub-layer kind the offer is about (``"attn"``, ``"mlp"``), or
            ``None`` for the whole block. Sub-layer offers of two kinds are also
            combined in pairs (the planner measures the promising pairs): a sub-layer
            offer has one part, the sub-layer's.
        optional: measuring it may fail where nothing runs for real (pinned host memory
            under fake tensors); the planner then warns and plans without it.
            Default: ``False``.
    """

    parts: tuple[Part, ...]
    sublayer: str | None = None
    optional: bool = False

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError(message(
                "Offer", "parts must not be empty",
                fix="offer at least one part (the planner measures 'none' itself)"))
        if self.sublayer is not None and len(self.parts) != 1:
            raise ValueError(message(
                "Offer", "a sub-layer offer has one part (the sub-layer's)",
                {"parts": len(self.parts)}, fix="offer the sub-layer's part alone"))


class Strategy:
    """A strategy's config: a frozen dataclass of settings, written ``name`` or ``name:N``.

    Data only: fields, their validation in ``__post_init__``, and how the value is shown.
    What the strategy does is its handler's
    (:class:`~remat.strategies.handler.Handler`, found with
    :func:`~remat.strategies.handler.handler_of`).

    Class attributes:
        name: the registered name, e.g. ``"every"``.
    """

    name: ClassVar[str]

    def __str__(self) -> str:
        return self.name


class BlockStrategy(Strategy):
    """A block-level strategy's config: what a Plan holds per module.

    The instance is the decision: its fields are what its handler's ``install_block``
    reads, what a plan file stores (:meth:`fields_dict`) and what :meth:`label` shows.
    Fields must be JSON values, or frozensets/tuples of them (stored as lists, which
    ``__post_init__`` turns back into the field's type).
    """

    def fields_dict(self) -> dict[str, Any]:
        """The fields that differ from their defaults, as JSON values (sets sorted)."""
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.default is not MISSING and value == f.default:
                continue
            if f.default_factory is not MISSING and value == f.default_factory():
                continue
            out[f.name] = sorted(value) if isinstance(value, (set, frozenset)) else \
                list(value) if isinstance(value, tuple) else value
        return out

    def label(self) -> str:
        """Short form for tables: ``"full"``, or ``"name(field=value, ...)"`` for the fields
        that differ from their defaults."""
        shown = self.fields_dict()
        if not shown:
            return self.name
        return f"{self.name}(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    def __str__(self) -> str:
        return self.label()
