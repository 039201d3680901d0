"""A process-wide on/off setting that a ``with`` block turns off and restores.

Measuring code keeps a few such settings (count probed kernel scratch, record the RNG
state of kept random ops); a real copy standing in for a fake one turns them off so that
it measures what the fake copy would. One small class instead of one flag and one context
manager per setting.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class Switch:
    """A boolean setting, on unless a :meth:`turned_off` block is running.

    The trade-off: process-wide, not per thread (the steps that read it run on the
    calling thread; a second thread measuring at the same time would see the other's
    setting).

    Example:
        >>> counted = Switch()
        >>> with counted.turned_off():
        ...     counted.on
        False
        >>> counted.on
        True
    """

    def __init__(self) -> None:
        self.on = True

    @contextmanager
    def turned_off(self) -> Iterator[None]:
        """Off inside the block; as before after it (nested blocks included)."""
        before, self.on = self.on, False
        try:
            yield
        finally:
            self.on = before
