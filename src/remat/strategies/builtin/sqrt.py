"""``sqrt``: consecutive blocks in ~sqrt(L) segments, one checkpointed region each."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from remat.strategies.base import BlockStrategy, Strategy
from remat.strategies.handler import Handler
from remat.strategies.regions import install_segment


def sqrt_segments(num_blocks: int) -> list[range]:
    """Split ``num_blocks`` consecutive blocks into about sqrt(L) segments.

    Segment length is ceil(sqrt(L)) (Chen et al. 2016, "Training Deep Nets with
    Sublinear Memory Cost", Sec. 4.1); the last segment takes the remainder and is
    checkpointed too. Never one segment over a whole stack of several blocks (only
    ``L = 2`` would get one): its recompute, at the start of backward, holds every
    activation ``none`` holds then, plus the RNG state checkpoint forks for it, so
    that moment is ``none``'s or above (4 KB above on a 2-block GPT at micro-batch
    1, on CPU), while one segment per block (``full``) recomputes the same FLOPs
    with one block's activations alive at a time.

    Example:
        >>> [list(r) for r in sqrt_segments(5)]
        [[0, 1, 2], [3, 4]]
    """
    if num_blocks <= 0:
        return []
    size = max(1, math.ceil(math.sqrt(num_blocks)))
    if size >= num_blocks > 1:
        size = 1
    return [range(start, min(start + size, num_blocks)) for start in range(0, num_blocks, size)]


def _stacks(named: Sequence[tuple[str, nn.Module]]) -> list[list[nn.Module]]:
    """Group blocks by the container that holds them, keeping forward order."""
    stacks: dict[str, list[nn.Module]] = {}
    for name, block in named:
        stacks.setdefault(name.rpartition(".")[0], []).append(block)
    return list(stacks.values())


@dataclass(frozen=True)
class SqrtSegments(Strategy):
    """Checkpoint ~sqrt(L) segments of consecutive blocks per stack (Chen et al. 2016).

    Only each segment's input is kept; its blocks are recomputed together in
    backward. Segments never cross stacks (encoder | decoder). The regions span
    several blocks, so they cannot be compiled or sharded block by block
    (``spans_blocks``).

    Example:
        >>> remat.apply(model, "sqrt")  # 9 blocks -> segments [0-2], [3-5], [6-8]
    """

    name: ClassVar[str] = "sqrt"


class SqrtSegmentsHandler(Handler[SqrtSegments]):
    """Installs its segments itself: not decided block by block."""

    summary: ClassVar[str] = "~sqrt(L) segments of consecutive blocks"
    spans_blocks: ClassVar[bool] = True

    def decisions(self, config: SqrtSegments, blocks: Sequence[tuple[str, nn.Module]]
                  ) -> dict[str, BlockStrategy] | None:
        return None

    def install(self, config: SqrtSegments, blocks: Sequence[tuple[str, nn.Module]]
                ) -> list[nn.Module]:
        regions: list[nn.Module] = []
        for stack in _stacks(blocks):
            for segment in sqrt_segments(len(stack)):
                members = [stack[i] for i in segment]
                install_segment(members, label=config.name)
                regions += members
        return regions
