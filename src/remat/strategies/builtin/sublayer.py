"""``attn`` / ``mlp``: checkpoint only one sub-layer of each block."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from remat.blocks import find_sublayer
from remat.strategies.base import BlockContext, BlockStrategy, Offer
from remat.strategies.decision import BlockDecision
from remat.strategies.regions import install_checkpoint

__all__ = ["Attention", "Mlp", "SublayerStrategy"]


class SublayerStrategy(BlockStrategy):
    """Checkpoint the block's sub-layer of kind ``name`` (found by :func:`find_sublayer`)."""

    def install_block(self, block: nn.Module, decision: BlockDecision) -> list[nn.Module]:
        _, sub = find_sublayer(block, self.name)  # type: ignore[arg-type]
        install_checkpoint(sub, label=decision.label())
        return [sub]

    def offers(self, context: BlockContext) -> list[Offer]:
        if self.name not in context.sublayers:
            return []
        path, _ = context.sublayers[self.name]
        return [Offer((("", BlockDecision(self.name)),), sublayer=self.name,
                      pair_part=(path, BlockDecision("full")))]


@dataclass(frozen=True)
class Attention(SublayerStrategy):
    """Checkpoint each block's attention sub-layer only.

    Example:
        >>> remat.apply(model, "attn")
    """

    name: ClassVar[str] = "attn"
    summary: ClassVar[str] = "checkpoint each block's attention"


@dataclass(frozen=True)
class Mlp(SublayerStrategy):
    """Checkpoint each block's MLP sub-layer only.

    Example:
        >>> remat.apply(model, "mlp")
    """

    name: ClassVar[str] = "mlp"
    summary: ClassVar[str] = "checkpoint each block's MLP"
