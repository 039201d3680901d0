"""``full``: checkpoint each block (keep its input, recompute the rest in backward)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from remat.blocks import BlockMethod
from remat.strategies.base import BlockContext, BlockStrategy, Offer
from remat.strategies.handler import BlockHandler
from remat.strategies.regions import install_checkpoint


@dataclass(frozen=True)
class Full(BlockStrategy):
    """Checkpoint the whole block: about one extra forward of it in backward.

    Example:
        >>> remat.apply(model, "full")
    """

    name: ClassVar[str] = "full"


class FullHandler(BlockHandler[Full]):
    """One checkpointed region per decided module or method; offered on every block."""

    summary: ClassVar[str] = "checkpoint each block"

    def install_block(self, config: Full, block: nn.Module) -> list[nn.Module]:
        install_checkpoint(block, label=config.label())
        return [block]

    def install_method(self, config: Full, method: BlockMethod) -> list[nn.Module]:
        install_checkpoint(method.owner, label=config.label(), method=method.name)
        return [method.owner]

    def offers(self, config: Full, context: BlockContext) -> list[Offer]:
        return [Offer((("", config),))]
