"""``every:N``: checkpoint blocks 0, N, 2N, ... (a memory/compute dial between none and full)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from remat.errors import StrategyError, message
from remat.strategies.base import BlockStrategy, Purpose, Strategy
from remat.strategies.builtin.full import Full
from remat.strategies.handler import Handler


@dataclass(frozen=True)
class EveryN(Strategy):
    """Checkpoint every N-th block, starting with the first.

    Args:
        n: the stride, >= 1 (``every:1`` is ``full``).

    Example:
        >>> remat.apply(model, "every:2")  # blocks 0, 2, 4, ...
    """

    name: ClassVar[str] = "every"

    n: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(message("EveryN", "n must be an int >= 1", {"found": repr(self.n)},
                                     fix="pass an int >= 1, e.g. EveryN(2)"))

    def __str__(self) -> str:
        return f"{self.name}:{self.n}"


class EveryNHandler(Handler[EveryN]):
    """``full`` on blocks 0, N, 2N, ...; the frontier lists ``every:2 .. every:L``."""

    summary: ClassVar[str] = "checkpoint blocks 0, N, 2N, ..."
    argument: ClassVar[str | None] = "N"

    def parse(self, argument: str | None) -> EveryN:
        text = (argument or "").strip()
        if not text.isdigit() or int(text) < 1:
            shown = self.name if argument is None else f"{self.name}:{argument}"
            raise StrategyError(message(
                "", f"cannot read strategy {shown!r}",
                fix="write every:N with an integer N >= 1, e.g. every:2 checkpoints "
                    "blocks 0, 2, 4, ..."))
        return EveryN(int(text))

    def examples(self, num_blocks: int, purpose: Purpose) -> list[Strategy]:
        if purpose == "frontier":
            return [EveryN(n) for n in range(2, num_blocks + 1)]
        return [EveryN(2)]

    def decisions(self, config: EveryN, blocks: Sequence[tuple[str, nn.Module]]
                  ) -> dict[str, BlockStrategy]:
        return {name: Full() for i, (name, _) in enumerate(blocks) if i % config.n == 0}
