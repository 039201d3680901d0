"""``none``: keep every activation (the baseline every comparison starts from)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from remat.strategies.base import BlockStrategy


@dataclass(frozen=True)
class NoCheckpoint(BlockStrategy):
    """Keep every activation: no recompute, the most memory.

    Example:
        >>> remat.apply(model, "none")  # same as remat.remove(model)
    """

    name: ClassVar[str] = "none"
    summary: ClassVar[str] = "keep every activation (baseline)"

    def install_block(self, block: nn.Module) -> list[nn.Module]:
        return []
