"""Plans, frontiers and throughput tables for people: rich, plain text, markdown, and a plot.

Units are formatted by :mod:`remat.report` helpers (the one place that formats
them); this module only lays plans out.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from remat.plan.frontier import Frontier
from remat.plan.plans import Plan
from remat.report._format import format_bytes, format_flops, format_ms, format_pct, mib
from remat.report.tables import markdown_table

__all__ = [
    "FRONTIER_COLUMNS",
    "THROUGHPUT_COLUMNS",
    "decision_runs",
    "frontier_markdown",
    "frontier_table",
    "plan_renderable",
    "plan_text",
    "plot_frontier",
    "throughput_markdown",
    "throughput_table",
]

FRONTIER_COLUMNS = ("Strategy", "Peak memory", "Fits", "Recompute", "Recompute overhead",
                    "Recompute FLOPs")
THROUGHPUT_COLUMNS = ("Batch", "Fits", "Best plan", "Peak memory", "Recompute",
                      "Step time", "Samples/s")


def decision_runs(plan: Plan) -> list[tuple[str, str]]:
    """Consecutive blocks with the same decision, as ``(blocks, decision)`` pairs.

    Example:
        >>> decision_runs(plan)
        [('blocks.0 .. blocks.3', 'none'), ('blocks.4 .. blocks.5', 'full')]
    """
    runs: list[tuple[list[str], str]] = []
    for name in plan.block_names:
        label = plan.label_of(name)
        if runs and runs[-1][1] == label:
            runs[-1][0].append(name)
        else:
            runs.append(([name], label))
    return [(names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}", label)
            for names, label in runs]


def _summary_cells(plan: Plan) -> list[tuple[str, str]]:
    cells = [("Budget", format_bytes(plan.budget_bytes))]
    if plan.no_checkpoint_peak_bytes is not None:
        cells.append(("Peak without checkpointing", format_bytes(plan.no_checkpoint_peak_bytes)))
    cells += [
        ("Predicted peak", format_bytes(plan.predicted_peak_bytes)),
        ("Measured peak", "not measured" if plan.measured_peak_bytes is None
         else format_bytes(plan.measured_peak_bytes)),
        ("Recompute FLOPs", format_flops(plan.recompute_flops)),
    ]
    if plan.cost_source == "measured":
        cells += [(f"Recompute time (measured, {plan.timed_on})", format_ms(plan.recompute_ms)),
                  (f"Step time (measured, {plan.timed_on})", format_ms(plan.predicted_step_ms))]
    else:
        cells += [(f"Recompute time ({plan.cost_device} roofline)", format_ms(plan.recompute_ms)),
                  (f"Predicted step time ({plan.cost_device})", format_ms(plan.predicted_step_ms))]
    if plan.batch_size is not None:
        cells.append(("Batch size", str(plan.batch_size)))
    return cells


def plan_text(plan: Plan) -> str:
    """A plain-text summary of ``plan`` (what :meth:`Plan.summary` returns)."""
    title = "Empty plan (no checkpointing needed)" if plan.is_empty else "Checkpointing plan"
    lines = [title]
    cells = _summary_cells(plan)
    width = max(len(k) for k, _ in cells)
    lines += [f"  {k.ljust(width)}  {v}" for k, v in cells]
    lines.append("  Decisions:")
    runs = decision_runs(plan)
    name_width = max(len(n) for n, _ in runs) if runs else 0
    lines += [f"    {n.ljust(name_width)}  {label}" for n, label in runs]
    if plan.throughput:
        lines.append("  Throughput search:")
        lines += ["    " + "  ".join(row) for row in _throughput_rows(plan)]
    return "\n".join(lines)


def plan_renderable(plan: Plan) -> Any:
    """Rich renderables for ``plan``: a summary table and the decisions per block."""
    summary = Table(title="Empty plan (no checkpointing needed)" if plan.is_empty
                    else "Checkpointing plan", show_header=False)
    summary.add_column("What")
    summary.add_column("Value", justify="right")
    for key, value in _summary_cells(plan):
        summary.add_row(Text(key), Text(value))
    decisions = Table(title="Decision per block")
    decisions.add_column("Blocks", no_wrap=True)
    decisions.add_column("Decision")
    for names, label in decision_runs(plan):
        decisions.add_row(names, Text(label, style="dim" if label == "none" else "bold"))
    parts: list[Any] = [summary, decisions]
    if plan.throughput:
        parts.append(throughput_table(plan))
    return Group(*parts)


# ---- frontier -----------------------------------------------------------------------------

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

def _throughput_rows(plan: Plan) -> list[list[str]]:
    rows = []
    for r in plan.throughput:
        best = " (best)" if r.batch_size == plan.batch_size else ""
        rows.append([f"{r.batch_size}{best}", "yes" if r.fits else "no",
                     r.decisions if r.fits else "-",
                     format_bytes(r.peak_bytes) + ("" if r.fits else " (smallest reachable)"),
                     format_ms(r.recompute_ms) if r.fits else "-",
                     format_ms(r.step_ms) if r.fits else "-",
                     f"{r.samples_per_s:,.0f}" if r.fits else "-"])
    return rows


def throughput_table(plan: Plan) -> Table:
    """The throughput search as a rich table (batch size vs best plan, peak, step time)."""
    source = f"timed on {plan.timed_on}" if plan.cost_source == "measured" \
        else f"{plan.cost_device} step-time model"
    table = Table(title=f"Throughput search (budget {format_bytes(plan.budget_bytes)}, {source})")
    for column in THROUGHPUT_COLUMNS:
        table.add_column(column, justify="left" if column in ("Batch", "Best plan")
                         else "right")
    for cells, row in zip(_throughput_rows(plan), plan.throughput, strict=True):
        table.add_row(*(Text(c) for c in cells),
                      style="bold green" if row.batch_size == plan.batch_size
                      else ("" if row.fits else "dim"))
    return table


def throughput_markdown(plan: Plan) -> str:
    """The throughput search as a markdown table."""
    return markdown_table(THROUGHPUT_COLUMNS, _throughput_rows(plan))


# ---- plot ---------------------------------------------------------------------------------

def plot_frontier(fronts: Frontier | Sequence[Frontier], path: str | Path, *,
                  title: str | None = None, dpi: int = 150) -> Path:
    """Draw peak memory against recompute overhead, the budget as a line.

    One panel per frontier. Manual strategies are grey points (hollow when over
    budget), the plan a green star; the horizontal line is the budget.

    Args:
        fronts: one :class:`~remat.plan.frontier.Frontier` or several (one panel each).
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
        raise ValueError("remat.plan.plot_frontier: no frontier to plot")
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
