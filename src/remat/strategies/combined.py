"""``a+b``: several per-block strategies at once, e.g. ``"full+chunked_head:8"``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from remat.errors import StrategyError, message
from remat.strategies.base import BlockStrategy, Strategy
from remat.strategies.handler import Handler, handler_of


@dataclass(frozen=True)
class Combined(Strategy):
    """The decisions of several strategies together, written ``"a+b"``.

    Meant for a block strategy plus a whole-model one (``"full+chunked_head:8"``: each
    block checkpointed and the output head chunked); two parts may not decide the same
    module. Parts whose regions span blocks (``sqrt``) do not combine.

    Args:
        parts: the strategies, two or more.

    Example:
        >>> remat.apply(model, "every:2+chunked_head:4")
    """

    name: ClassVar[str] = "combined"

    parts: tuple[Strategy, ...]

    def __post_init__(self) -> None:
        if len(self.parts) < 2 or not all(isinstance(p, Strategy) for p in self.parts):
            raise ValueError(message("Combined", "parts must be two or more strategies",
                                     {"found": repr(self.parts)},
                                     fix="combine strategies such as 'full+chunked_head:8'"))

    def __str__(self) -> str:
        return "+".join(str(p) for p in self.parts)



class CombinedHandler(Handler[Combined]):
    """The parts' decisions merged (no module decided twice)."""

    summary: ClassVar[str] = "several strategies at once: a+b"

    def decisions(self, config: Combined, blocks: Sequence[tuple[str, nn.Module]]
                  ) -> dict[str, BlockStrategy]:
        merged: dict[str, BlockStrategy] = {}
        for part in config.parts:
            decided = handler_of(part).decisions(part, blocks)
            if decided is None:
                raise StrategyError(message(
                    "", f"{part} does not combine with other strategies",
                    {"why": "its regions span blocks, so it is not decided block by block"},
                    fix=f"apply {part} alone, or combine per-block strategies "
                        "(full, every:N, attn, mlp, ops, offload, chunked_head:N)"))
            both = sorted(set(merged) & set(decided))
            if both:
                raise StrategyError(message(
                    "", f"{config} decides some modules twice", {"modules": both[:5]},
                    fix="combine strategies that decide different modules, such as a "
                        "block strategy and chunked_head:N"))
            merged.update(decided)
        return merged
