"""What a strategy is: a frozen config that installs itself and offers planner candidates.

Every strategy remat knows is a subclass of :class:`Strategy` registered by name in
:mod:`remat.strategies.registry` (``"full"``, ``"every:2"``, ...). A strategy says

- how it is written (``name``, an optional ``argument`` such as ``N`` in ``every:N``),
- how it installs on a model (:meth:`Strategy.install`),
- which of its instances belong in ``remat compare``, ``remat simulate`` and the
  frontier's manual points (:meth:`Strategy.examples`),

and, for *block-level* strategies (:class:`BlockStrategy`: one decision per block,
the kinds a Plan can hold), how it installs on one block and which candidates it
offers the planner (:meth:`BlockStrategy.offers`). Adding a strategy is one module:
subclass, decorate with :func:`remat.register_strategy`, done (docs/extending.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

from torch import nn

from remat.devices import DeviceSpec
from remat.errors import StrategyError
from remat.measure.tracker import OpRecord
from remat.strategies.decision import BlockDecision

if TYPE_CHECKING:
    from remat.strategies.op_graph import OpGraph

__all__ = ["BlockContext", "BlockStrategy", "Offer", "Part", "Purpose", "Strategy"]

Part = tuple[str, BlockDecision]
"""``(path, decision)``: ``""`` for the block itself, else a sub-layer's path in the block."""

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
    """

    forward_ops: tuple[OpRecord, ...]
    sublayers: Mapping[str, tuple[str, tuple[OpRecord, ...]]]
    cost_device: DeviceSpec
    runs_on: str
    recomputed: Mapping[str, tuple[OpRecord, ...]] = field(default_factory=dict)
    graphs: Mapping[str, OpGraph] = field(default_factory=dict)


@dataclass(frozen=True)
class Offer:
    """One candidate a strategy asks the planner to measure on a kind of block.

    Args:
        parts: the decisions, e.g. ``(("", BlockDecision("full")),)`` for the block.
        sublayer: the sub-layer kind the offer is about (``"attn"``, ``"mlp"``), or
            ``None`` for the whole block. Sub-layer offers of two kinds are also
            combined in pairs (the planner measures the promising pairs).
        pair_part: what the offer contributes to such a pair. Default: ``parts[0]``.
        optional: measuring it may fail where nothing runs for real (pinned host memory
            under fake tensors); the planner then warns and plans without it.
            Default: ``False``.
    """

    parts: tuple[Part, ...]
    sublayer: str | None = None
    pair_part: Part | None = None
    optional: bool = False

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("Offer: parts must not be empty (the planner measures 'none' itself)")

    @property
    def paired(self) -> Part:
        """The part this offer contributes to an attention + MLP pair."""
        return self.pair_part if self.pair_part is not None else self.parts[0]


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
            StrategyError: the argument is missing, unexpected or unreadable.
        """
        if argument is not None:
            raise StrategyError(f"remat.apply: strategy {cls.name!r} takes no argument, got "
                                f"{cls.name}:{argument}")
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
    def decisions(self, names: Sequence[str]) -> dict[str, BlockDecision] | None:
        """One decision per block (by name), or ``None`` when the strategy is not per
        block (it then overrides :meth:`install`)."""

    def install(self, blocks: Sequence[tuple[str, nn.Module]]) -> list[nn.Module] | None:
        """Install on the model's blocks itself; return the modules made regions.

        Default: ``None``, meaning "install :meth:`decisions` block by block" (what every
        per-block strategy wants). Strategies whose regions span blocks override it.
        """
        return None


class BlockStrategy(Strategy):
    """A strategy that is one decision kind per block: the kinds a Plan holds.

    Class attributes:
        takes_save_ops: decisions of this kind may carry ``save_ops``.
        moves_to_host: it costs host transfers rather than recompute (``offload``).
    """

    takes_save_ops: ClassVar[bool] = False
    moves_to_host: ClassVar[bool] = False

    def decisions(self, names: Sequence[str]) -> dict[str, BlockDecision]:
        return {name: BlockDecision(self.name) for name in names}

    @abstractmethod
    def install_block(self, block: nn.Module, decision: BlockDecision) -> list[nn.Module]:
        """Install ``decision`` (of this kind) on ``block``; return the modules made regions."""

    def offers(self, context: BlockContext) -> list[Offer]:
        """Candidates for the planner on a kind of block. Default: none."""
        return []
