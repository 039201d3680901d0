"""Progress of long work, reported to whoever is listening (the CLI's progress bars).

Library code calls :func:`report` at each unit of long work (a candidate measured, a
closed-loop round, a batch size planned); it costs a context-variable lookup when nobody
listens. The command line wraps its calls in :func:`reporting` with a rich progress bar.

Example::

    >>> with reporting(lambda step, done, total: print(step, done, total)):
    ...     plan = remat.plan(model, batch, budget="60%")   # prints as it goes
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

__all__ = ["Reporter", "report", "reporting"]

Reporter = Callable[[str, int, int], None]
"""``reporter(step, done, total)``: ``done`` of ``total`` units; ``step`` says what runs."""

_current: ContextVar[Reporter | None] = ContextVar("remat_progress", default=None)


@contextlib.contextmanager
def reporting(reporter: Reporter) -> Iterator[None]:
    """Send every :func:`report` made inside the block to ``reporter`` (nestable)."""
    token = _current.set(reporter)
    try:
        yield
    finally:
        _current.reset(token)


def report(step: str, done: int, total: int) -> None:
    """Report progress: ``done`` of ``total`` units of the current stage, now at ``step``."""
    reporter = _current.get()
    if reporter is not None:
        reporter(step, done, total)
