"""What a strategy is: a frozen config that installs itself and offers planner candidates.

Every strategy remat knows is a subclass of :class:`Strategy` registered by name in
:mod:`remat.strategies.registry` (``"full"``, ``"every:2"``, ...). A strategy *instance*
is a frozen dataclass whose fields are its config (``EveryN(n=2)``,
``SelectiveOps(save_ops=frozenset({"aten.mm"}))``), and that instance is the one value
that travels: ``remat.apply`` installs it, a Plan holds it per module, a plan file stores
it as ``{"name": ..., "fields": {...}}`` and reads it back. Nothing turns an instance into
a name and back, so no field is lost on the way. A strategy says

- how it is written (``name``, an optional ``argument`` such as ``N`` in ``every:N``),
- which strategy each block gets (:meth:`Strategy.decisions`) or, for strategies whose
  regions span blocks, how it installs on the model (:meth:`Strategy.install`),
- which of its instances belong in ``remat compare``, ``remat simulate`` and the
  frontier's manual points (:meth:`Strategy.examples`),
- which candidates it offers the planner (:meth:`Strategy.offers`),

and, for *block-level* strategies (:class:`BlockStrategy`: what a Plan holds per module),
how it installs on one module (:meth:`BlockStrategy.install_block`). Adding a strategy is
one module: subclass, decorate with :func:`remat.register_strategy`, done
(docs/extending.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from torch import nn

from remat.blocks import BlockMethod
from remat.core.op_record import OpRecord
from remat.devices import DeviceSpec
from remat.errors import StrategyError, message

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


class Strategy(ABC):
    """A whole-model checkpointing strategy, written as ``name`` or ``name:argument``.

    Subclasses are frozen dataclasses (their fields are the config) with class
    attributes describing them; register them with :func:`remat.register_strategy`.

    Class attributes:
        name: the registered name, e.g. ``"every"``.
        summary: one line for help texts.
        argument: the argument's placeholder (``"N"`` for ``every:N``), or ``None``.
        purposes: where the strategy's :meth:`examples` are listed by default
            (``"compare"``, ``"simulate"``, ``"frontier"``).
        spans_blocks: its regions span several blocks, so they cannot be compiled or
            sharded block by block (``sqrt``).
    """

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    argument: ClassVar[str | None] = None
    purposes: ClassVar[frozenset[str]] = frozenset({"compare", "simulate", "frontier"})
    spans_blocks: ClassVar[bool] = False

    @classmethod
    def parse(cls, argument: str | None) -> Strategy:
        """The strategy for ``name`` (``argument`` is ``None``) or ``name:argument``.

        Raises:
            StrategyError: the argument is missing, unexpected or unreadable. The message
                (``remat.errors.message("", ...)``) names no call:
                :func:`~remat.strategies.registry.parse_strategy` adds its caller's.
        """
        if argument is not None:
            raise StrategyError(message(
                "", f"strategy {cls.name!r} takes no argument",
                {"found": f"{cls.name}:{argument}"}, fix=f"write {cls.name!r} alone"))
        return cls()

    @classmethod
    def spelling(cls) -> str:
        """How the strategy is written in help texts: ``"full"``, ``"every:N"``."""
        return f"{cls.name}:{cls.argument}" if cls.argument else cls.name

    @classmethod
    def examples(cls, num_blocks: int, purpose: Purpose) -> list[Strategy]:
        """Instances shown by default for ``purpose`` on a model of ``num_blocks`` blocks."""
        return [cls.parse(None)] if purpose in cls.purposes else []

    def __str__(self) -> str:
        return self.name

    @abstractmethod
    def decisions(self, blocks: Sequence[tuple[str, nn.Module]]
                  ) -> dict[str, BlockStrategy] | None:
        """What each module gets: qualified name (a block, or a module inside one) ->
        block-level strategy; modules left out get nothing. ``None`` when the strategy is
        not per block (it then overrides :meth:`install`).

        Args:
            blocks: the model's blocks, ``(qualified name, module)``, in model order.
        """

    def install(self, blocks: Sequence[tuple[str, nn.Module]]) -> list[nn.Module] | None:
        """Install on the model's blocks itself; return the modules made regions.

        Default: ``None``, meaning "install :meth:`decisions` block by block" (what every
        per-block strategy wants). Strategies whose regions span blocks override it.
        """
        return None

    def offers(self, context: BlockContext) -> list[Offer]:
        """Candidates for the planner on a kind of block. Default: none."""
        return []


class BlockStrategy(Strategy):
    """A strategy installed on one module at a time: what a Plan holds per module.

    The instance is the decision: its fields are what :meth:`install_block` reads, what
    a plan file stores (:meth:`fields_dict`) and what :meth:`label` shows. Fields must be
    JSON values, or frozensets/tuples of them (stored as lists, which ``__post_init__``
    turns back into the field's type).

    Class attributes:
        moves_to_host: it costs host transfers rather than recompute (``offload``), or
            besides recompute (``full_offload``).
        offloads_inputs: it checkpoints like ``full`` and moves only what ``full`` keeps
            (the region's inputs), copied back one region ahead (``full_offload``): the
            planner prices its transfers against ``full``'s saved bytes.
        without_host: what it amounts to on a model with no separate host memory (the
            CPU), for the notice :func:`remat.apply` gives there. Default: ``""``.
        on_head: it installs on the whole model's output head and loss, decided under the
            key ``"<head>"`` rather than per block (``chunked_head``).
    """

    moves_to_host: ClassVar[bool] = False
    offloads_inputs: ClassVar[bool] = False
    without_host: ClassVar[str] = ""
    on_head: ClassVar[bool] = False

    def decisions(self, blocks: Sequence[tuple[str, nn.Module]]) -> dict[str, BlockStrategy]:
        return {name: self for name, _ in blocks}

    @abstractmethod
    def install_block(self, block: nn.Module) -> list[nn.Module]:
        """Install this strategy on ``block`` (a block, or a module inside one); return the
        modules made regions."""

    def install_method(self, method: BlockMethod) -> list[nn.Module]:
        """Install this strategy on a sub-layer written as a method (a decision keyed
        ``"layers.3._attention_forward"``; NOTE [ Method regions ] in regions.py); return
        the modules holding regions.

        Default: refused; ``full``, ``ops`` and ``offload`` override it.

        Raises:
            StrategyError: the strategy installs on modules only.
        """
        raise StrategyError(message(
            "remat.apply", f"strategy {self.label()!r} cannot be installed on a method",
            {"method": f"{type(method.owner).__name__}.{method.name}",
             "why": f"{type(self).__name__} installs on modules only (install_block)"},
            fix="decide on the method with full, ops or offload, or decide on the block"))

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
