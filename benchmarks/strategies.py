"""Compare every checkpointing strategy on two built-in models; write RESULTS.md and a plot.

Runs :func:`remat.compare.compare_preset` on gpt-small and llama-small (batch 8,
their full sequence length), then replaces the section between
``<!-- strategies:start -->`` and ``<!-- strategies:end -->`` in
``benchmarks/RESULTS.md`` (other benchmark scripts own the other sections; the
file is created when missing) and draws ``benchmarks/compare.png``.

Usage::

    .venv/bin/python benchmarks/strategies.py            # or: make bench
    .venv/bin/python benchmarks/strategies.py --repeats 9 --device cpu

Takes about a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from remat.compare.runner import ComparisonResult, compare_preset
from remat.report.plots import plot_comparison
from remat.report.tables import comparison_markdown

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import cpu_name, replace_section  # noqa: E402 (benchmarks/ is on sys.path)

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
PLOT = HERE / "compare.png"
SECTION = "strategies"
RUNS: tuple[tuple[str, int], ...] = (("gpt-small", 8), ("llama-small", 8))




def machine_lines(device: torch.device) -> list[str]:
    """Markdown bullet lines describing where the benchmark ran."""
    accel = (f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda"
             else "cpu")
    return [
        f"- Platform: {platform.platform()}, Python {platform.python_version()}",
        f"- CPU: {cpu_name()} ({os.cpu_count()} logical cores visible, "
        f"torch threads: {torch.get_num_threads()})",
        f"- torch {torch.__version__}; device: {accel}",
    ]


def _load_average() -> str:
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def command_line() -> str:
    """The command that reproduces this run, relative to the repository root."""
    root = HERE.parent
    python = Path(sys.executable)
    try:
        shown = str(python.relative_to(root)) if python.is_relative_to(root) else "python"
    except ValueError:
        shown = "python"
    script = Path(sys.argv[0]).resolve()
    script_text = str(script.relative_to(root)) if script.is_relative_to(root) else str(script)
    return shlex.join([shown, script_text, *sys.argv[1:]])


def render(results: list[ComparisonResult], device: torch.device, elapsed_s: float,
           command: str, load_before: str) -> str:
    """The markdown body of the strategies section."""
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    repeats = results[0].repeats
    lines = [
        "## Checkpointing strategies side by side",
        "",
        f"Command: `{command}` (run from the repository root; {elapsed_s:.0f} s in total).",
        f"Date: {now}.",
        "",
        *machine_lines(device),
        f"- Load average (1, 5, 15 min) when the run started: {load_before}",
        "",
        "Each strategy runs on a fresh model with identical weights (seed 0). Memory is "
        "exact, from remat's storage-level tracker over one training step (forward, loss, "
        "backward; no optimizer). Recompute FLOPs are the FLOPs of recompute passes as a "
        "share of the `none` step's FLOPs. Step time is the median of "
        f"{repeats} forward+backward steps per strategy, interleaved across strategies, "
        "relative to `none`. Gradient check: worst relative error of the loss and every "
        "parameter gradient against the un-checkpointed model (dropout on).",
        "",
    ]
    for result in results:
        lines += [f"### {result.label}", "", comparison_markdown(result), ""]
    lines += [f"![peak memory vs recompute overhead]({PLOT.name})", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per strategy")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice); 1 gives steadier "
                             "timings on a machine shared with other jobs")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_before = _load_average()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") \
        if args.device == "auto" else torch.device(args.device)

    console = Console(stderr=True)
    started = time.perf_counter()
    results: list[ComparisonResult] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        for preset, batch_size in RUNS:
            task = bar.add_task(preset, total=None)

            def update(step: str, done: int, total: int, task: TaskID = task,
                       preset: str = preset) -> None:
                bar.update(task, description=f"{preset}: {step}", completed=done, total=total)

            results.append(compare_preset(preset, batch_size, device=device,
                                          repeats=args.repeats, progress=update))
    elapsed_s = time.perf_counter() - started

    body = render(results, device, elapsed_s, command_line(), load_before)
    old = RESULTS.read_text() if RESULTS.exists() else ""
    RESULTS.write_text(replace_section(old, SECTION, body))
    plot_comparison(results, PLOT, title=f"Peak memory vs recompute overhead ({device})")
    console.print(f"Wrote {RESULTS} and {PLOT} in {elapsed_s:.0f} s")
    failed = [f"{r.label}: {row.strategy}" for r in results for row in r.rows
              if row.grad_passed is False]
    if failed:
        console.print(f"[bold red]Gradient check failed: {'; '.join(failed)}[/]")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
