"""The memory-vs-batch chart practitioners use to pick a micro-batch size.

Two panels from a :class:`~remat.simulate.run.SimulationResult`: peak memory per rank
against micro-batch size, one line per strategy, with the device memory as a
horizontal line (where a line crosses it, that strategy stops fitting); and
throughput against micro-batch size, solid where the batch fits and hollow
markers where it does not. Drawn on an Agg canvas (no pyplot, no GUI).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from remat.simulate.result import SimulationResult


_GIB = 1024**3
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h")


def plot_simulation(result: SimulationResult, path: str | Path, *, title: str | None = None,
                    dpi: int = 150) -> Path:
    """Draw peak memory and throughput against micro-batch size, per strategy.

    Args:
        result: a simulation result.
        path: output file (``.png``, ``.svg``, ``.pdf``); parent directories are created.
        title: figure title. Default: model, sequence length, precision and device.
        dpi: resolution for raster formats. Default: ``150``.

    Returns:
        The path written.

    Example:
        >>> plot_simulation(simulate("llama-7b", seq_len=2048), "out/sim.png")  # doctest: +SKIP
        PosixPath('out/sim.png')
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(12.0, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    mem_ax, thr_ax = fig.subplots(1, 2)
    for index, strategy in enumerate(result.strategies):
        rows = result.rows_for(strategy)
        if not rows:
            continue
        marker = _MARKERS[index % len(_MARKERS)]
        xs = [r.batch_size for r in rows]
        (line,) = mem_ax.plot(xs, [r.peak_bytes / _GIB for r in rows], marker=marker,
                              label=strategy)
        color = line.get_color()
        thr_ax.plot(xs, [r.tokens_per_s for r in rows], color=color, alpha=0.35)
        fit = [r for r in rows if r.fits]
        over = [r for r in rows if not r.fits]
        thr_ax.plot([r.batch_size for r in fit], [r.tokens_per_s for r in fit],
                    linestyle="none", marker=marker, color=color, label=strategy)
        thr_ax.plot([r.batch_size for r in over], [r.tokens_per_s for r in over],
                    linestyle="none", marker=marker, markerfacecolor="none", color=color)
    limit = result.device_memory_bytes / _GIB
    mem_ax.axhline(limit, color="black", linestyle="--", linewidth=1.2)
    mem_ax.annotate(f"{result.device} ({limit:.0f} GiB)", (0.01, limit), xycoords=("axes fraction",
                    "data"), xytext=(0, 4), textcoords="offset points", fontsize=8)
    for ax in (mem_ax, thr_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(result.batch_sizes))
        ax.set_xticklabels([str(b) for b in result.batch_sizes])
        ax.set_xlabel("Micro-batch size (sequences per rank)")
        ax.grid(True, alpha=0.3)
    # Keep the region around the device limit readable: lines far above it leave the chart.
    highest = max((r.peak_bytes for r in result.rows), default=0) / _GIB
    mem_ax.set_ylim(0, max(min(highest, 2.5 * limit), limit) * 1.08)
    mem_ax.set_ylabel("Peak memory per rank (GiB)")
    mem_ax.set_title("Peak memory (dashed: device memory)", fontsize=10)
    mem_ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, 0.93))
    thr_ax.set_ylabel("Throughput (tokens/s, all ranks)")
    thr_ax.set_title("Predicted throughput (hollow: does not fit)", fontsize=10)
    thr_ax.legend(fontsize=8, loc="best")
    if title is None:
        ranks = (f", {result.sharding} x{result.world_size}" if result.sharding != "none"
                 else "")
        title = (f"{result.model}, seq {result.seq_len}, {result.precision} + "
                 f"{result.optimizer}, {result.device}{ranks} (simulated)")
    fig.suptitle(title, fontsize=11)
    fig.savefig(out, dpi=dpi)
    return out
