"""A process-wide marker for "remat is recomputing a checkpointed region right now".

Measurement uses it to attribute FLOPs and bytes to recomputation; every region
that remat checkpoints enters :func:`recomputing` around its recompute pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["is_recomputing", "recomputing"]

_depth = 0


@contextmanager
def recomputing() -> Iterator[None]:
    """Mark the enclosed code as a recompute pass (nestable)."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def is_recomputing() -> bool:
    """Whether a remat recompute pass is running (on any thread)."""
    return _depth > 0
