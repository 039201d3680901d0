"""Strategy names and per-block decisions.

A *strategy* is a whole-model recipe named by a string (``"full"``, ``"every:2"``,
...). A :class:`BlockDecision` is what one block gets; a strategy expands to one
decision per block (see :func:`expand_strategy`), and a planner's Plan is a
mapping from block names to decisions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from remat.errors import StrategyError
from remat.strategies.ops import parse_entry

__all__ = [
    "DECISION_KINDS",
    "STRATEGIES",
    "BlockDecision",
    "StrategySpec",
    "expand_strategy",
    "parse_strategy",
]

#: The strategy names :func:`remat.apply` accepts (``every:N`` takes an integer N >= 1).
STRATEGIES: tuple[str, ...] = ("none", "full", "every:N", "sqrt", "attn", "mlp", "ops", "offload")

DecisionKind = Literal["none", "full", "attn", "mlp", "ops", "offload"]
DECISION_KINDS: tuple[str, ...] = ("none", "full", "attn", "mlp", "ops", "offload")


@dataclass(frozen=True)
class BlockDecision:
    """What one block gets.

    Args:
        kind: ``"none"`` (keep every activation), ``"full"`` (checkpoint the block),
            ``"attn"`` / ``"mlp"`` (checkpoint only that sub-layer), ``"ops"``
            (op-level selective checkpointing: save the outputs of ``save_ops``,
            recompute the rest) or ``"offload"`` (keep saved activations in host memory).
        save_ops: for ``"ops"``: aten overload-packet names whose outputs are kept,
            e.g. ``frozenset({"aten.mm", "aten.addmm"})``, or single calls of one
            (``"aten.mm#2"``: the third ``aten.mm`` of the region's forward). ``None``
            means the default set (:func:`remat.strategies.ops.default_save_ops`). Must be
            ``None`` for other kinds.

    Example:
        >>> BlockDecision("ops", frozenset({"aten.mm"})).kind
        'ops'
    """

    kind: DecisionKind
    save_ops: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if self.kind not in DECISION_KINDS:
            raise ValueError(
                f"BlockDecision: unknown kind {self.kind!r}; expected one of {DECISION_KINDS}"
            )
        if self.save_ops is not None:
            if self.kind != "ops":
                raise ValueError(
                    f"BlockDecision: save_ops is only meaningful for kind 'ops', got kind "
                    f"{self.kind!r} with save_ops={sorted(self.save_ops)}"
                )
            object.__setattr__(self, "save_ops", frozenset(self.save_ops))
            for entry in self.save_ops:
                try:
                    parse_entry(entry)
                except ValueError as exc:
                    raise ValueError(f"BlockDecision: {exc}") from None

    def label(self) -> str:
        """Short human-readable form, e.g. ``ops[aten.mm,aten.addmm]``."""
        if self.kind == "ops" and self.save_ops is not None:
            return "ops[" + ",".join(sorted(self.save_ops)) + "]"
        return self.kind


@dataclass(frozen=True)
class StrategySpec:
    """A parsed strategy string.

    Args:
        name: the canonical name (``"every"`` for ``every:N``).
        every_n: N for ``every:N``, else ``None``.
    """

    name: str
    every_n: int | None = None

    def __post_init__(self) -> None:
        if self.name == "every":
            if self.every_n is None or self.every_n < 1:
                raise ValueError(f"StrategySpec: every:N needs N >= 1, got {self.every_n!r}")
        elif self.every_n is not None:
            raise ValueError(f"StrategySpec: every_n is only for 'every', got {self.name!r}")

    def __str__(self) -> str:
        return f"every:{self.every_n}" if self.name == "every" else self.name


def parse_strategy(strategy: str) -> StrategySpec:
    """Parse ``"full"``, ``"every:3"``, ... into a :class:`StrategySpec`.

    Raises:
        StrategyError: unknown name or a bad ``every:N``; the message lists the valid ones.

    Example:
        >>> parse_strategy("every:3").every_n
        3
    """
    if not isinstance(strategy, str):
        raise StrategyError(
            f"remat.apply: strategy must be a string or a Plan, got {type(strategy).__name__}. "
            f"Valid strategies: {', '.join(STRATEGIES)}"
        )
    text = strategy.strip().lower()
    if text.startswith("every"):
        _, sep, count = text.partition(":")
        if sep and count.strip().isdigit() and int(count) >= 1:
            return StrategySpec("every", int(count))
        raise StrategyError(
            f"remat.apply: cannot read {strategy!r}; write every:N with an integer N >= 1, "
            "e.g. every:2 checkpoints blocks 0, 2, 4, ..."
        )
    if text in STRATEGIES:
        return StrategySpec(text)
    raise StrategyError(
        f"remat.apply: unknown strategy {strategy!r}. Valid strategies: {', '.join(STRATEGIES)}"
    )


def sqrt_segments(num_blocks: int) -> list[range]:
    """Split ``num_blocks`` consecutive blocks into about sqrt(L) segments.

    Segment length is ceil(sqrt(L)) (Chen et al. 2016, "Training Deep Nets with
    Sublinear Memory Cost", Sec. 4.1); the last segment takes the remainder and is
    checkpointed too.
    """
    if num_blocks <= 0:
        return []
    size = max(1, math.ceil(math.sqrt(num_blocks)))
    return [range(start, min(start + size, num_blocks)) for start in range(0, num_blocks, size)]


def expand_strategy(spec: StrategySpec, num_blocks: int) -> list[BlockDecision]:
    """Per-block decisions of a strategy (``"sqrt"`` expands to ``"full"``; see apply)."""
    if spec.name == "every":
        n = spec.every_n or 1
        return [BlockDecision("full" if i % n == 0 else "none") for i in range(num_blocks)]
    kind = {"sqrt": "full"}.get(spec.name, spec.name)
    return [BlockDecision(kind) for _ in range(num_blocks)]  # type: ignore[arg-type]
