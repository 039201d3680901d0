"""Display of remat results: plans, rich tables, markdown tables, and plots.

The only package that formats units for people (bytes via
:func:`remat.units.format_bytes`, FLOPs, percentages, times); everything else
in remat passes raw ints and floats around.
"""

from __future__ import annotations

from remat.report.plan import plan_renderable, plan_text
from remat.report.plots import plot_comparison
from remat.report.tables import (
    blocks_table,
    comparison_markdown,
    comparison_table,
    totals_table,
)
from remat.units import markdown_table

__all__ = [
    "blocks_table",
    "comparison_markdown",
    "comparison_table",
    "markdown_table",
    "plan_renderable",
    "plan_text",
    "plot_comparison",
    "totals_table",
]
