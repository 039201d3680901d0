"""Field checks and small conversions shared by the records of both backends.

A record (a plan, a throughput row, a JAX plan) checks its fields when it is built
and when it is read back from JSON; these helpers give every such check the same
message: the record (``owner``) first, then the field and what was wrong with it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from remat.errors import message


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
