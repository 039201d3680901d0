"""``offload``: keep saved activations in pinned host memory (a no-op on CPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from remat.blocks import BlockMethod
from remat.strategies.base import BlockContext, BlockStrategy, Offer
from remat.strategies.handler import BlockHandler
from remat.strategies.regions import install_offload


@dataclass(frozen=True)
class Offload(BlockStrategy):
    """Move what each block saves for backward to host memory and back (no recompute).

    Costs a copy each way over the host link: out on a side stream, overlapping the
    block's forward, and back at the block's backward, not hidden (NOTE [ Asynchronous
    offload ] in strategies/offload.py). The bytes leave the device when the block's
    forward ends; weights stay. Offered to the planner only on CUDA; on CPU there is no
    separate host memory.

    Example:
        >>> remat.apply(model, "offload")
    """

    name: ClassVar[str] = "offload"


class OffloadHandler(BlockHandler[Offload]):
    """Saved tensors to pinned host memory and back; offered on CUDA."""

    summary: ClassVar[str] = "saved activations in pinned host memory (GPU only)"
    purposes: ClassVar[frozenset[str]] = frozenset({"compare"})
    moves_to_host: ClassVar[bool] = True
    without_host: ClassVar[str] = "a no-op"

    def install_block(self, config: Offload, block: nn.Module) -> list[nn.Module]:
        install_offload(block, label=config.label())
        return []

    def install_method(self, config: Offload, method: BlockMethod) -> list[nn.Module]:
        install_offload(method.owner, label=config.label(), method=method.name)
        return []

    def offers(self, config: Offload, context: BlockContext) -> list[Offer]:
        if context.runs_on != "cuda":
            return []
        return [Offer((("", config),), optional=True)]
