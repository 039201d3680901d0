"""Silence what native libraries print straight to a file descriptor.

Some C++ libraries remat drives print lines the user cannot act on, bypassing Python's
streams: kineto's ``USDT ... profiler_start`` / ``profiler_stop`` lines on stderr when
``torch.profiler`` starts and stops, HiGHS's debug lines on stdout on large programs.
:func:`silenced` points the descriptor at /dev/null for the duration of a block.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def silenced(fd: int) -> Iterator[None]:
    """Send file descriptor ``fd`` (1: stdout, 2: stderr) to /dev/null inside the block.

    A no-op where the descriptor is not a real one (e.g. under pytest's capture of
    Python-level streams only). Python's own buffered output is flushed first, so nothing
    written before the block is lost.

    Example:
        >>> with silenced(2):
        ...     prof.__enter__()
    """
    stream = sys.__stdout__ if fd == 1 else sys.__stderr__
    try:
        if stream is not None:
            stream.flush()
        saved = os.dup(fd)
    except (OSError, ValueError):
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), fd)
            try:
                yield
            finally:
                os.dup2(saved, fd)
    finally:
        os.close(saved)
