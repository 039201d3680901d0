"""Plots written to files (PNG, SVG, PDF) with matplotlib's Agg canvas.

No pyplot: figures are built on :class:`matplotlib.figure.Figure` with an Agg
canvas, so plotting never touches a GUI backend or global pyplot state and works
on headless machines and inside tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from remat.errors import message
from remat.units import format_bytes, mib

if TYPE_CHECKING:
    from remat.compare.frontier import Frontier
    from remat.core.rows import ComparisonResult


_MARKERS = ("o", "s", "^", "D", "v", "P")


def plot_comparison(
    results: ComparisonResult | Sequence[ComparisonResult],
    path: str | Path,
    *,
    title: str | None = None,
    dpi: int = 150,
) -> Path:
    """Draw peak memory (MiB) against recompute overhead (%) per strategy.

    Each point is one strategy, labelled with its name; strategies that land on
    the same point share one label (e.g. ``none, offload`` on CPU). Several
    results (e.g. two model sizes) are drawn as separate series.

    Args:
        results: one :class:`~remat.core.rows.ComparisonResult` or several.
        path: output file; the format follows the suffix (``.png``, ``.svg``, ``.pdf``).
            Missing parent directories are created.
        title: figure title. Default: the result's label, or a generic title.
        dpi: resolution for raster formats. Default: ``150``.

    Returns:
        The path written.

    Example:
        >>> plot_comparison(result, "out/compare.png")  # doctest: +SKIP
        PosixPath('out/compare.png')
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = [results] if not isinstance(results, Sequence) else list(results)
    if not series:
        raise ValueError(message("remat.report.plot_comparison", "no results to plot",
                                 fix="pass a ComparisonResult or a non-empty list of them"))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)

    fig = Figure(figsize=(7.5, 5.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for index, result in enumerate(series):
        xs = [row.recompute_overhead_pct for row in result.rows]
        ys = [mib(row.peak_bytes) for row in result.rows]
        name = result.label or f"run {index + 1}"
        ax.scatter(xs, ys, marker=_MARKERS[index % len(_MARKERS)], s=50, zorder=3,
                   label=name if len(series) > 1 else None)
        # Group strategies that coincide so their labels do not overprint.
        groups: dict[tuple[float, float], list[str]] = {}
        for x, y, row in zip(xs, ys, result.rows, strict=True):
            groups.setdefault((round(x, 2), round(y, 3)), []).append(row.strategy)
        for (x, y), strategies in groups.items():
            ax.annotate(", ".join(strategies), (x, y), xytext=(6, 4),
                        textcoords="offset points", fontsize=8)
    ax.set_xlabel("Recompute overhead (% of baseline step FLOPs)")
    ax.set_ylabel("Peak memory (MiB)")
    ax.grid(True, alpha=0.3)
    ax.margins(x=0.15, y=0.1)
    if len(series) > 1:
        ax.legend(loc="best", fontsize=8)
    if title is None:
        title = (f"Peak memory vs recompute: {series[0].label} ({series[0].device})"
                 if len(series) == 1 and series[0].label else "Peak memory vs recompute")
    ax.set_title(title, fontsize=10)
    fig.savefig(out, dpi=dpi)
    return out


def plot_frontier(fronts: Frontier | Sequence[Frontier], path: str | Path, *,
                  title: str | None = None, dpi: int = 150) -> Path:
    """Draw peak memory against recompute overhead, the budget as a line.

    One panel per frontier. Manual strategies are grey points (hollow when over
    budget), the plan a green star; the horizontal line is the budget.

    Args:
        fronts: one :class:`~remat.compare.frontier.Frontier` or several (one panel each).
        path: output file (``.png``, ``.svg``, ``.pdf``); parent directories are created.
        title: figure title. Default: none for one panel's label.
        dpi: resolution for raster formats. Default: 150.

    Returns:
        The path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from remat.compare.frontier import Frontier

    panels = [fronts] if isinstance(fronts, Frontier) else list(fronts)
    if not panels:
        raise ValueError(message("remat.report.plot_frontier", "no frontier to plot",
                                 fix="pass a Frontier or a non-empty list of them"))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(6.5 * len(panels), 5.0), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, front in zip(axes, panels, strict=True):
        manual = [p for p in front.points if p.name != "plan"]
        for fits in (True, False):
            pts = [p for p in manual if p.fits == fits]
            ax.scatter([p.overhead_pct for p in pts], [mib(p.peak_bytes) for p in pts],
                       s=45, zorder=3, facecolors="tab:gray" if fits else "none",
                       edgecolors="tab:gray", label="manual (fits)" if fits else "manual (over)")
        groups: dict[tuple[float, float], list[str]] = {}
        for p in manual:
            groups.setdefault((round(p.overhead_pct, 2), round(mib(p.peak_bytes), 2)),
                              []).append(p.name)
        for (x, y), names in groups.items():
            ax.annotate(", ".join(names), (x, y), xytext=(5, 3), textcoords="offset points",
                        fontsize=7, color="0.3")
        for p in front.points:
            if p.name == "plan":
                ax.scatter([p.overhead_pct], [mib(p.peak_bytes)], marker="*", s=220,
                           color="tab:green", zorder=4, label="plan")
        ax.axhline(mib(front.budget_bytes), color="tab:red", linestyle="--", linewidth=1,
                   label=f"budget {format_bytes(front.budget_bytes)}")
        kind = "timed step" if front.cost_source == "measured" else "step roofline time"
        ax.set_xlabel(f"Recompute overhead (% of {kind}, {front.cost_device})")
        ax.set_ylabel("Peak memory (MiB)")
        ax.grid(True, alpha=0.3)
        ax.margins(x=0.12, y=0.08)
        ax.legend(loc="upper right", fontsize=8)
        ax.set_title(front.label or "Memory / recompute frontier", fontsize=10)
    if title is not None:
        fig.suptitle(title, fontsize=11)
    fig.savefig(out, dpi=dpi)
    return out
