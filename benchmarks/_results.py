"""Shared by the benchmark scripts: RESULTS.md sections and where a run happened."""

from __future__ import annotations

import datetime as dt
import os
import platform
import shlex
import time
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def replace_section(text: str, name: str, body: str) -> str:
    """Replace (or append) the ``<!-- name:start -->...<!-- name:end -->`` section of ``text``.

    Each benchmark script owns one section of RESULTS.md and rewrites only that one.
    """
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.strip()}\n{end}"
    if start in text and end in text and text.index(start) < text.index(end):
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        return head + block + tail
    if start in text or end in text:
        raise ValueError(f"{RESULTS}: found only one of {start!r} / {end!r}; fix the file by hand")
    prefix = text.rstrip() + "\n\n" if text.strip() else "# Benchmark results\n\n"
    return prefix + block + "\n"


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, else platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_header(title: str, script: str, argv: Sequence[str], started: float) -> str:
    """A section's title, the command that produced it and where and when it ran.

    ``started`` is the run's ``time.time()`` at its start.
    """
    import torch

    command = f"PYTHONPATH=src .venv/bin/python benchmarks/{script} " + shlex.join(argv)
    return (f"## {title}\n\n"
            f"Command: `{command.strip()}`  \n"
            f"Machine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads; run "
            f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {time.time() - started:.0f} s.\n\n")
