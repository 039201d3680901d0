"""``none``: keep every activation (the baseline every comparison starts from)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from remat.strategies.base import BlockStrategy
from remat.strategies.handler import BlockHandler


@dataclass(frozen=True)
class NoCheckpoint(BlockStrategy):
    """Keep every activation: no recompute, the most memory.

    Example:
        >>> remat.apply(model, "none")  # same as remat.remove(model)
    """

    name: ClassVar[str] = "none"


class NoCheckpointHandler(BlockHandler[NoCheckpoint]):
    """Installs nothing."""

    summary: ClassVar[str] = "keep every activation (baseline)"

    def install_block(self, config: NoCheckpoint, block: nn.Module) -> list[nn.Module]:
        return []
