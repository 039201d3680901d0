"""``full_offload``: checkpoint each block and keep its input in pinned host memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from remat.blocks import BlockMethod
from remat.strategies.base import BlockContext, BlockStrategy, Offer
from remat.strategies.handler import BlockHandler
from remat.strategies.regions import install_offloaded_checkpoint


@dataclass(frozen=True)
class FullOffload(BlockStrategy):
    """Checkpoint the whole block as ``full`` does, and keep its input on the host.

    ``full`` keeps one hidden state per block on the device; at long context those inputs
    dominate what is left. ``full_offload`` copies each block's input to pinned host
    memory on a side stream while the block's forward runs, frees the device copy at the
    block's end, and in backward brings block i-1's input back while block i recomputes
    (NOTE [ Offloaded checkpoints ] in strategies/offload.py). The trade-off against
    ``full``: the same recompute, plus a copy of one hidden state each way per block,
    hidden behind the block's kernels unless the host link is slower than them; against
    ``offload``: a recompute, but far fewer bytes over the link. The name reads "``full``,
    its kept inputs offloaded". Offered to the planner only on CUDA; on the CPU (no
    separate host memory) it runs as ``full``.

    Example:
        >>> remat.apply(model, "full_offload")
    """

    name: ClassVar[str] = "full_offload"


class FullOffloadHandler(BlockHandler[FullOffload]):
    """``full``'s region, its kept input copied to pinned host memory; offered on CUDA."""

    summary: ClassVar[str] = "checkpoint each block, its input in pinned host memory (GPU)"
    purposes: ClassVar[frozenset[str]] = frozenset({"compare"})
    moves_to_host: ClassVar[bool] = True
    offloads_inputs: ClassVar[bool] = True
    without_host: ClassVar[str] = "the same as full"

    def install_block(self, config: FullOffload, block: nn.Module) -> list[nn.Module]:
        install_offloaded_checkpoint(block, label=config.label())
        return [block]

    def install_method(self, config: FullOffload, method: BlockMethod) -> list[nn.Module]:
        install_offloaded_checkpoint(method.owner, label=config.label(), method=method.name)
        return [method.owner]

    def offers(self, config: FullOffload, context: BlockContext) -> list[Offer]:
        if context.runs_on != "cuda":
            return []
        return [Offer((("", config),), optional=True)]
