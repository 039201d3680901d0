"""Plans and their throughput search for people: rich, plain text and markdown.

Units are formatted by :mod:`remat.units` helpers (the one place that formats
them); this module only lays plans out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from remat.units import format_bytes, format_flops, format_ms, markdown_table

if TYPE_CHECKING:
    from remat.planning.plans import Plan


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
    ]
    if plan.allocator_peak_bytes is not None:
        cells.append(("Allocator peak (first and steady step)",
                      format_bytes(plan.allocator_peak_bytes)))
    if plan.reserved_peak_bytes is not None:
        cells.append(("Reserved peak with workspaces (predicted)",
                      format_bytes(plan.reserved_peak_bytes)))
    cells += [
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
    if plan.source != "planner":  # NOTE [ Never worse than manual ]
        cells.append(("Chosen", f"built-in strategy {plan.source}: {plan.source_note}"))
    if plan.compiled is not None and "" in plan.compiled:  # the compiler's own setting
        cells.append(("Compiled, activation memory budget",
                      f"{plan.compiled['']:g} (whole model)"))
    elif plan.compiled is not None:  # remat.plan_compiled: blocks compiled at these budgets
        values = list(plan.compiled.values())
        cells.append(("Compiled, activation memory budget", ", ".join(
            f"{v:g} x{values.count(v)}" for v in dict.fromkeys(values))))
    return cells


def _title(plan: Plan) -> str:
    if plan.compiled is not None and "" in plan.compiled:
        return "Compiled plan: the compiler's own setting (no remat checkpointing)"
    return "Empty plan (no checkpointing needed)" if plan.is_empty else "Checkpointing plan"


def plan_text(plan: Plan) -> str:
    """A plain-text summary of ``plan``: budget, peaks, costs and the decision per block."""
    lines = [_title(plan)]
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
    """Rich renderables for ``plan``: a summary table and the decisions per block
    (``console.print(plan_renderable(plan))``)."""
    summary = Table(title=_title(plan), show_header=False)
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


# ---- throughput ------------------------------------------------------------------------

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

