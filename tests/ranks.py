"""Gloo ranks for the distributed tests: forked copies of the test process.

NOTE [ Forked ranks ]
    A rank started with ``spawn`` is a fresh interpreter that imports torch, transformers
    and remat again and unpickles its function by module name (so the repository root
    must be on its path): seconds of start-up per rank, on the two cores the whole suite
    shares. A forked rank inherits the test process's imports and runs at once; its
    function needs no import path. The test process has initialized no process group
    when it forks (each rank joins its own through a file store), runs one intra-op
    thread (tests/conftest.py), and every rank ends with ``os._exit`` (or the fork
    start method's own ``os._exit``), so no state of the test process is finalized twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.multiprocessing import start_processes


def run_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """Run ``fn(rank, *args)`` on ``nprocs`` forked ranks and wait for all of them.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback).
        torch.multiprocessing.ProcessExitedException: a rank exited with a non-zero code.
    """
    start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="fork")
