"""``full``: checkpoint each block (keep its input, recompute the rest in backward)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from remat.blocks import BlockMethod
from remat.strategies.base import BlockContext, BlockStrategy, Offer
from remat.strategies.regions import install_checkpoint


@dataclass(frozen=True)
class Full(BlockStrategy):
    """Checkpoint the whole block: about one extra forward of it in backward.

    Example:
        >>> remat.apply(model, "full")
    """

    name: ClassVar[str] = "full"
    summary: ClassVar[str] = "checkpoint each block"

    def install_block(self, block: nn.Module) -> list[nn.Module]:
        install_checkpoint(block, label=self.label())
        return [block]

    def install_method(self, method: BlockMethod) -> list[nn.Module]:
        install_checkpoint(method.owner, label=self.label(), method=method.name)
        return [method.owner]

    def offers(self, context: BlockContext) -> list[Offer]:
        return [Offer((("", self),))]
