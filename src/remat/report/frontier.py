"""The frontier on screen and on disk: manual strategies and plans, peak against recompute."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.table import Table
from rich.text import Text

from remat.compare.frontier import Frontier
from remat.errors import message
from remat.units import format_bytes, format_flops, format_ms, format_pct, markdown_table, mib

__all__ = ["FRONTIER_COLUMNS", "frontier_markdown", "frontier_table", "plot_frontier"]

FRONTIER_COLUMNS = ("Strategy", "Peak memory", "Fits", "Recompute", "Recompute overhead",
                    "Recompute FLOPs")


def _frontier_rows(front: Frontier) -> list[list[str]]:
    best = front.best_manual()
    rows = []
    for p in front.points:
        name = p.name + (" (best manual)" if best is not None and p.name == best.name else "")
        rows.append([name, format_bytes(p.peak_bytes), "yes" if p.fits else "no",
                     format_ms(p.recompute_ms), format_pct(p.overhead_pct),
                     format_flops(p.recompute_flops)])
    return rows


def _frontier_caption(front: Frontier) -> str:
    if front.cost_source == "measured":
        return (f"Recompute: timed step minus the un-checkpointed timed step on "
                f"{front.cost_device} (medians); overhead: share of the latter "
                f"({format_ms(front.step_ms)}).")
    return (f"Recompute: roofline time of the recomputed ops on {front.cost_device}; "
            f"overhead: share of the un-checkpointed step's roofline time "
            f"({format_ms(front.step_ms)}).")


def frontier_table(front: Frontier) -> Table:
    """The frontier as a rich table: one row per strategy, the plan last."""
    table = Table(
        title=f"Frontier{': ' + front.label if front.label else ''} "
              f"(budget {format_bytes(front.budget_bytes)})",
        caption=_frontier_caption(front),
        caption_justify="left",
    )
    for column in FRONTIER_COLUMNS:
        table.add_column(column, justify="left" if column == "Strategy" else "right",
                         no_wrap=True)
    for cells, point in zip(_frontier_rows(front), front.points, strict=True):
        style = "bold green" if point.name == "plan" else ("" if point.fits else "dim")
        table.add_row(*(Text(c) for c in cells), style=style)  # Text: "[...]" is not markup
    return table


def frontier_markdown(front: Frontier) -> str:
    """The frontier as a markdown table."""
    return markdown_table(FRONTIER_COLUMNS, _frontier_rows(front))


# ---- throughput ---------------------------------------------------------------------------

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

    panels = [fronts] if isinstance(fronts, Frontier) else list(fronts)
    if not panels:
        raise ValueError(message("remat.compare.frontier.plot_frontier", "no frontier to plot",
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
