"""The small values a Plan is made of: named blocks, throughput rows, labels, and checks."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from remat.blocks import BlocksSpec
from remat.errors import message
from remat.planning.fingerprint import BlockPrint
from remat.strategies import BlockStrategy

__all__ = ["NamedBlocks", "ThroughputRow", "apply_spec", "check_float", "check_int",
           "decisions_label", "opt_float", "opt_int", "owner_block", "print_from_dict"]


@dataclass(frozen=True)
class NamedBlocks:
    """A ``blocks=`` predicate selecting modules by qualified name.

    Args:
        names: qualified module names, e.g. ``("encoder.layer.0", "encoder.layer.1")``.

    Example:
        >>> NamedBlocks(("blocks.0",))("blocks.0", None)
        True
    """

    names: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError(message("NamedBlocks", "names must not be empty",
                                     fix="pass the qualified names of the blocks"))
        object.__setattr__(self, "names", tuple(self.names))

    def __call__(self, name: str, module: nn.Module | None) -> bool:
        return name in self.names


def check_int(owner: str, name: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(message(owner, f"{name} must be an int >= 0", {"found": repr(value)},
                                 fix=f"pass {name} as an int >= 0"))


def check_float(owner: str, name: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        math.isfinite(value) and value >= 0
    ):
        raise ValueError(message(owner, f"{name} must be a finite number >= 0",
                                 {"found": repr(value)},
                                 fix=f"pass {name} as a finite number >= 0"))


@dataclass(frozen=True)
class ThroughputRow:
    """One batch size tried by the throughput search (``maximize="throughput"``).

    Args:
        batch_size: samples per step.
        fits: whether some plan fits the budget at this batch size.
        decisions: short description of the best plan, e.g. ``"4 none, 2 ops[aten.mm]"``;
            ``""`` when nothing fits.
        peak_bytes: the plan's peak (measured when known, else predicted); for a batch size
            that does not fit, the smallest reachable peak.
        recompute_ms: the plan's recompute cost (roofline), ms.
        step_ms: predicted step time, ms.
        samples_per_s: ``batch_size / step_ms * 1000``; 0 when nothing fits.
    """

    batch_size: int
    fits: bool
    decisions: str
    peak_bytes: int
    recompute_ms: float
    step_ms: float
    samples_per_s: float

    def __post_init__(self) -> None:
        owner = f"ThroughputRow(batch_size={self.batch_size})"
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) \
                or self.batch_size < 1:
            raise ValueError(message("ThroughputRow", "batch_size must be an int >= 1",
                                     {"found": repr(self.batch_size)},
                                     fix="pass batch_size >= 1"))
        check_int(owner, "peak_bytes", self.peak_bytes)
        for name in ("recompute_ms", "step_ms", "samples_per_s"):
            check_float(owner, name, getattr(self, name))


def opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def decisions_label(labels: Iterable[str]) -> str:
    """``"4 none, 2 full"`` from per-block labels (in order of first use)."""
    counts: dict[str, int] = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{n} {key}" for key, n in counts.items())


def owner_block(name: str, blocks: Sequence[str]) -> str | None:
    """The block ``name`` is, or lies inside; None if neither."""
    for block in blocks:
        if name == block or name.startswith(block + "."):
            return block
    return None


def apply_spec(decisions: Mapping[str, BlockStrategy], block_names: Sequence[str],
               blocks: BlocksSpec) -> BlocksSpec:
    """The ``blocks=`` that makes ``remat.apply`` find every module ``decisions`` names.

    Decisions on blocks need the blocks spec the plan was made with; decisions on
    sub-layers name modules inside blocks, selected by name (:class:`NamedBlocks`).
    """
    names = set(block_names)
    if all(n in names for n in decisions):
        return blocks
    return NamedBlocks(tuple(decisions))


# ---- JSON pieces of a Plan (NOTE [ Plan JSON format ] in plans.py) ---------------------------


def print_from_dict(data: Any) -> BlockPrint:
    if not isinstance(data, Mapping):
        raise TypeError(message("", "fingerprint entries must be objects",
                                {"found": repr(data)},
                                fix='write {"name": ..., "class": ..., "params": ...}'))
    return BlockPrint(str(data["name"]), str(data["class"]), str(data["params"]),
                      int(data.get("siblings", 1)))
