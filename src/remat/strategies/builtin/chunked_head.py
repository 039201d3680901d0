"""``chunked_head:N``: the output head and the loss over N token slices, each slice's
logits recomputed in backward (NOTE [ Chunked head ] in remat/strategies/head.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from remat.errors import StrategyError, message
from remat.strategies.base import BlockStrategy
from remat.strategies.handler import BlockHandler
from remat.strategies.head import HEAD_KEY, install_head


@dataclass(frozen=True)
class ChunkedHead(BlockStrategy):
    """Compute the output projection and the next-token loss in ``chunks`` token slices.

    The logits of a causal LM are ``tokens x vocab`` (2 GiB in bf16 at 8192 tokens and a
    128k vocabulary, twice that upcast to float32 for the loss, and again for their
    gradient); no block strategy touches them. Here at most one slice's logits exist at a
    time, in forward and in backward, for one extra output projection in backward (``2 *
    tokens * d_model * vocab`` FLOPs). The model's output then has ``logits=None``; without
    ``labels`` the model runs as before. A whole-model decision, keyed ``"<head>"`` in a
    plan's decisions; it composes with block strategies: ``"full+chunked_head:8"``.

    Args:
        chunks: token slices (of ``batch * seq`` tokens), >= 1. Default: 8.

    Example:
        >>> remat.apply(model, "chunked_head:8")
        >>> remat.apply(model, "full+chunked_head:8")  # and each block checkpointed
    """

    name: ClassVar[str] = "chunked_head"

    chunks: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) \
                or self.chunks < 1:
            raise ValueError(message("ChunkedHead", "chunks must be an int >= 1",
                                     {"found": repr(self.chunks)},
                                     fix="pass an int >= 1, e.g. ChunkedHead(chunks=8)"))

    def __str__(self) -> str:
        return f"{self.name}:{self.chunks}"


class ChunkedHeadHandler(BlockHandler[ChunkedHead]):
    """Installs on the model's head, decided under ``"<head>"``; listed nowhere by default."""

    summary: ClassVar[str] = "output head and loss in N token slices, recomputed in backward"
    argument: ClassVar[str | None] = "N"
    purposes: ClassVar[frozenset[str]] = frozenset()
    on_head: ClassVar[bool] = True

    def parse(self, argument: str | None) -> ChunkedHead:
        if argument is None:
            return ChunkedHead()
        text = argument.strip()
        if not text.isdigit() or int(text) < 1:
            raise StrategyError(message(
                "", f"cannot read strategy '{self.name}:{argument}'",
                fix="write chunked_head:N with an integer N >= 1, e.g. chunked_head:8"))
        return ChunkedHead(int(text))

    def decisions(self, config: ChunkedHead, blocks: Sequence[tuple[str, nn.Module]]
                  ) -> dict[str, BlockStrategy]:
        return {HEAD_KEY: config}

    def install_block(self, config: ChunkedHead, block: nn.Module) -> list[nn.Module]:
        """Install on the model (``block`` is the whole model: the ``"<head>"`` decision)."""
        install_head(block, chunks=config.chunks, label=str(config))
        return []
