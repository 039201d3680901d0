"""Tables for the terminal (rich) and for RESULTS.md (markdown).

Each table is built from a result object (:class:`remat.core.rows.ComparisonResult`,
:class:`remat.measure.Profile`); nothing here measures anything. Row cells are
shared between the rich and markdown forms so the two never disagree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich import box
from rich.table import Table
from rich.text import Text

from remat.units import (
    format_bytes,
    format_flops,
    format_grad_check,
    format_ms,
    format_pct,
    format_ratio,
    markdown_table,
)

if TYPE_CHECKING:
    from remat.compare.frontier import Frontier
    from remat.core.rows import ComparisonResult, StrategyRow


#: Column headers of the comparison table, in order.
COMPARISON_COLUMNS: tuple[str, ...] = (
    "Strategy",
    "Peak memory",
    "Peak vs none",
    "Activations",
    "Activations vs none",
    "Recompute FLOPs",
    "Step time vs none",
    "Gradient check",
)
# Two-line headers keep the terminal table narrow.
_RICH_HEADERS: tuple[str, ...] = (
    "Strategy",
    "Peak\nmemory",
    "Peak\nvs none",
    "Activations",
    "Activations\nvs none",
    "Recompute\nFLOPs",
    "Step time\nvs none",
    "Gradient\ncheck",
)


def comparison_cells(row: StrategyRow, *, baseline: str = "none") -> list[str]:
    """The display cells of one comparison row, in :data:`COMPARISON_COLUMNS` order."""
    is_base = row.strategy == baseline
    return [
        row.strategy,
        format_bytes(row.peak_bytes),
        "-" if is_base else format_pct(row.peak_change_pct, signed=True),
        format_bytes(row.activation_bytes),
        "-" if is_base else format_pct(row.activation_change_pct, signed=True),
        format_pct(row.recompute_overhead_pct),
        format_ratio(row.step_time_ratio),
        format_grad_check(row.grad_passed, row.grad_max_rel_error),
    ]


def comparison_table(result: ComparisonResult, *, title: str | None = None) -> Table:
    """A rich table with one row per strategy of ``result``.

    Memory changes are relative to the baseline; recompute FLOPs are the FLOPs
    spent recomputing as a share of the baseline step's FLOPs; the step-time
    ratio is the median step time over the baseline's.
    """
    table = Table(
        title=title if title is not None else _comparison_title(result),
        caption=_comparison_caption(result),
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for index, header in enumerate(_RICH_HEADERS):
        # Cells may wrap at spaces ("253.08\nMiB") on narrow terminals rather than be cut.
        table.add_column(header, justify="left" if index == 0 else "right",
                         no_wrap=index == 0)
    for row in result.rows:
        cells: list[str | Text] = list(comparison_cells(row, baseline=result.baseline))
        check = str(cells[-1])
        style = "green" if check.startswith("PASS") else "red" if check.startswith("FAIL") else ""
        cells[-1] = Text(check, style=style)
        table.add_row(*cells)
    return table


def comparison_markdown(result: ComparisonResult) -> str:
    """``result`` as a GitHub-flavoured markdown table (no title)."""
    rows = [comparison_cells(row, baseline=result.baseline) for row in result.rows]
    return markdown_table(COMPARISON_COLUMNS, rows)


def _comparison_title(result: ComparisonResult) -> str:
    label = f"{result.label} on {result.device}" if result.label else result.device
    return f"remat compare: {label}"


def _comparison_caption(result: ComparisonResult) -> str:
    base_ms = result.row(result.baseline).step_ms
    timing = (f"step time: median of {result.repeats} interleaved forward+backward steps "
              f"({result.baseline}: {format_ms(base_ms)})"
              if result.repeats and base_ms is not None else "step time: not measured")
    base = result.baseline
    return (f"Changes and step-time ratios are relative to {base}; recompute FLOPs are a "
            f"share of {base}'s step FLOPs; {timing}; gradient check: worst relative error of "
            "loss and gradients vs the un-checkpointed model.")


def blocks_table(profile: Any, *, title: str = "Per block") -> Table:
    """A rich table of ``profile.blocks``: name, saved bytes, forward FLOPs, forward time."""
    table = Table(title=title)
    table.add_column("Block", no_wrap=True)
    table.add_column("Saved for backward", justify="right")
    table.add_column("Forward FLOPs", justify="right")
    table.add_column("Forward time", justify="right")
    for block in profile.blocks:
        table.add_row(block.name, format_bytes(block.saved_bytes),
                      format_flops(block.forward_flops), format_ms(block.forward_ms))
    return table


def totals_cells(profile: Any) -> list[tuple[str, str]]:
    """(label, value) pairs summarising a profile: memory by category, FLOPs, times."""
    cells = [
        ("Peak memory", format_bytes(profile.peak_bytes)),
        ("Activations", format_bytes(profile.activation_bytes)),
        ("Parameters", format_bytes(profile.param_bytes)),
        ("Buffers", format_bytes(profile.buffer_bytes)),
        ("Gradients", format_bytes(profile.grad_bytes)),
        ("Optimizer state", format_bytes(profile.optimizer_bytes)),
        ("Batch", format_bytes(profile.batch_bytes)),
    ]
    if profile.allocator_peak_bytes is not None:
        cells.append(("Allocator peak", format_bytes(profile.allocator_peak_bytes)))
    cells += [
        ("FLOPs (fwd+bwd)", format_flops(profile.flops)),
        ("Forward FLOPs", format_flops(profile.forward_flops)),
        ("Backward FLOPs", format_flops(profile.backward_flops)),
        ("Recompute FLOPs", format_flops(profile.recompute_flops)),
        ("Forward time", format_ms(profile.forward_ms)),
        ("Backward time", format_ms(profile.backward_ms)),
        ("Step time", format_ms(profile.step_ms)),
        ("Backward / forward", format_ratio(backward_forward_ratio(profile))),
    ]
    return cells


def totals_table(profile: Any, *, title: str = "Totals") -> Table:
    """A two-column rich table of :func:`totals_cells`."""
    table = Table(title=title, show_header=False)
    table.add_column("What")
    table.add_column("Value", justify="right")
    for label, value in totals_cells(profile):
        table.add_row(label, value)
    return table


def backward_forward_ratio(profile: Any) -> float | None:
    """``backward_ms / forward_ms`` of a profile, or ``None`` when not timed."""
    if profile.forward_ms is None or profile.backward_ms is None or profile.forward_ms <= 0:
        return None
    return float(profile.backward_ms) / float(profile.forward_ms)


# ---- frontier ----------------------------------------------------------------------------

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
