"""``attn`` / ``mlp``: checkpoint only one sub-layer of each block."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from remat.blocks import BlockMethod, find_sublayer
from remat.errors import BlocksNotFound, RematWarning, message
from remat.strategies.base import BlockContext, BlockStrategy, Offer
from remat.strategies.builtin.full import Full
from remat.strategies.handler import BlockHandler
from remat.strategies.regions import install_checkpoint


class SublayerStrategy(BlockStrategy):
    """The config of a strategy that checkpoints the block's sub-layer of kind ``name``
    (``attn``, ``mlp``); its handler is :class:`SublayerHandler`."""


class SublayerHandler(BlockHandler[SublayerStrategy]):
    """Checkpoint the block's sub-layer of kind ``name`` (found by :func:`find_sublayer`).

    On a stack that mixes kinds of blocks (attention and Mamba layers in one list), the
    blocks without that sub-layer are left alone and a warning names them; a model none
    of whose blocks has one is refused (:class:`~remat.errors.BlocksNotFound`). A
    sub-layer written as a method of the block (``_attention_forward``) is checkpointed
    as a method (NOTE [ Method sub-layers ] in remat/blocks.py). The planner offers the
    sub-layer as a region of its own: ``full`` on the sub-layer's path (``"self_attn"``,
    or the method's name ``"_attention_forward"``), the one spelling plans use for a
    decision on a sub-layer.
    """

    def decisions(self, config: SublayerStrategy, blocks: Sequence[tuple[str, nn.Module]]
                  ) -> dict[str, BlockStrategy]:
        chosen: dict[str, BlockStrategy] = {}
        skipped: list[str] = []
        first_error: BlocksNotFound | None = None
        for name, block in blocks:
            try:
                find_sublayer(block, self.name)  # type: ignore[arg-type]
            except BlocksNotFound as exc:
                skipped.append(name)
                first_error = first_error or exc
                continue
            chosen[name] = config
        if first_error is not None and not chosen:
            raise first_error
        if skipped:
            shown = ", ".join(skipped[:4]) + (f" and {len(skipped) - 4} more"
                                              if len(skipped) > 4 else "")
            warnings.warn(message(
                "remat.apply", f"strategy {self.name!r} left {len(skipped)} of {len(blocks)} "
                "blocks alone", {f"no {self.name} sub-layer": shown},
                fix="to checkpoint those blocks too, use a plan (remat.plan), which picks "
                    "a strategy per block"), RematWarning, stacklevel=4)
        return chosen

    def install_block(self, config: SublayerStrategy, block: nn.Module) -> list[nn.Module]:
        _, sub = find_sublayer(block, config.name)  # type: ignore[arg-type]
        if isinstance(sub, BlockMethod):  # NOTE [ Method regions ] in regions.py
            install_checkpoint(sub.owner, label=config.label(), method=sub.name)
            return [sub.owner]
        install_checkpoint(sub, label=config.label())
        return [sub]

    def offers(self, config: SublayerStrategy, context: BlockContext) -> list[Offer]:
        if self.name not in context.sublayers:
            return []
        path, _ = context.sublayers[self.name]
        return [Offer(((path, Full()),), sublayer=self.name)]


@dataclass(frozen=True)
class Attention(SublayerStrategy):
    """Checkpoint each block's attention sub-layer only.

    Example:
        >>> remat.apply(model, "attn")
    """

    name: ClassVar[str] = "attn"


class AttentionHandler(SublayerHandler):
    """The attention sub-layer's handler."""

    summary: ClassVar[str] = "checkpoint each block's attention"


@dataclass(frozen=True)
class Mlp(SublayerStrategy):
    """Checkpoint each block's MLP sub-layer only.

    Example:
        >>> remat.apply(model, "mlp")
    """

    name: ClassVar[str] = "mlp"


class MlpHandler(SublayerHandler):
    """The MLP sub-layer's handler."""

    summary: ClassVar[str] = "checkpoint each block's MLP"
