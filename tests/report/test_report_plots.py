"""remat.report.plots writes real image files."""

from __future__ import annotations

from pathlib import Path

import pytest

from remat.compare.runner import ComparisonResult, StrategyRow
from remat.core.cost import StepCost
from remat.report.plots import plot_comparison

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _result(label: str, scale: float) -> ComparisonResult:
    def row(name: str, peak: int, recompute: int) -> StrategyRow:
        cost = StepCost(peak_bytes=int(peak * scale), activation_bytes=peak // 2,
                        param_bytes=1, grad_bytes=1, flops=100, recompute_flops=recompute)
        return StrategyRow(
            strategy=name, cost=cost, peak_change_pct=0.0, activation_change_pct=0.0,
            recompute_overhead_pct=recompute,
            step_time_ratio=None,
        )
    # "offload" coincides with "none" (a no-op on CPU): the two share one label.
    rows = (row("none", 2**26, 0), row("full", 2**25, 33), row("offload", 2**26, 0))
    return ComparisonResult(rows=rows, device="cpu", repeats=0, label=label)


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 1000


def test_plot_one_result_creates_missing_dirs(tmp_path: Path) -> None:
    out = tmp_path / "new" / "dir" / "compare.png"
    assert plot_comparison(_result("toy", 1.0), out) == out
    _assert_png(out)


def test_plot_several_results(tmp_path: Path) -> None:
    out = plot_comparison([_result("a", 1.0), _result("b", 2.0)], tmp_path / "two.png",
                          title="two sizes")
    _assert_png(out)


def test_plot_svg_by_suffix(tmp_path: Path) -> None:
    out = plot_comparison(_result("toy", 1.0), tmp_path / "c.svg")
    assert out.read_text().lstrip().startswith("<?xml")


def test_plot_nothing_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no results"):
        plot_comparison([], tmp_path / "x.png")
