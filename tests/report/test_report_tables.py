"""Tables and cell formatting of remat.report (synthetic results, no model runs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from rich.console import Console

from remat.compare.runner import ComparisonResult, StrategyRow
from remat.core.cost import StepCost
from remat.report.tables import (
    COMPARISON_COLUMNS,
    backward_forward_ratio,
    blocks_table,
    comparison_cells,
    comparison_markdown,
    comparison_table,
    markdown_table,
    totals_cells,
    totals_table,
)
from remat.units import format_flops, format_grad_check, format_ms, format_pct

MIB = 1024**2


def _row(strategy: str, peak_mib: float, act_mib: float, recompute_pct: float, ratio: float,
         passed: bool = True) -> StrategyRow:
    cost = StepCost(peak_bytes=int(peak_mib * MIB), activation_bytes=int(act_mib * MIB),
                    param_bytes=MIB, grad_bytes=MIB, flops=1000,
                    recompute_flops=int(recompute_pct * 10), step_ms=10.0 * ratio)
    return StrategyRow(
        strategy=strategy, cost=cost, peak_change_pct=100 * (peak_mib / 100 - 1),
        activation_change_pct=100 * (act_mib / 80 - 1), recompute_overhead_pct=recompute_pct,
        step_time_ratio=ratio, grad_max_rel_error=0.0 if passed else 2e-3, grad_passed=passed,
        worst_param="wte.weight",
    )


@pytest.fixture
def result() -> ComparisonResult:
    return ComparisonResult(
        rows=(_row("none", 100, 80, 0, 1.0), _row("full", 40, 20, 33.3, 1.31),
              _row("ops", 70, 50, 5.0, 1.05, passed=False)),
        device="cpu", repeats=3, label="toy, batch 2, seq 8",
    )


def test_format_helpers() -> None:
    assert format_flops(1_500_000_000) == "1.50 GFLOP"
    assert format_flops(999) == "999 FLOP"
    assert format_pct(-12.345, signed=True) == "-12.3%"
    assert format_pct(33.34) == "33.3%"
    assert format_pct(None) == "n/a"
    assert format_ms(12.345) == "12.35 ms"
    assert format_ms(None) == "n/a"
    assert format_grad_check(True, 3.1e-8) == "PASS (3.1e-08)"
    assert format_grad_check(None, None) == "skipped"


def test_comparison_cells(result: ComparisonResult) -> None:
    assert comparison_cells(result.row("none")) == [
        "none", "100.00 MiB", "-", "80.00 MiB", "-", "0.0%", "1.00x", "PASS (0.0e+00)",
    ]
    assert comparison_cells(result.row("full")) == [
        "full", "40.00 MiB", "-60.0%", "20.00 MiB", "-75.0%", "33.3%", "1.31x", "PASS (0.0e+00)",
    ]
    assert comparison_cells(result.row("ops"))[-1] == "FAIL (2.0e-03)"


def test_comparison_markdown(result: ComparisonResult) -> None:
    lines = comparison_markdown(result).splitlines()
    assert lines[0] == "| " + " | ".join(COMPARISON_COLUMNS) + " |"
    assert lines[1] == "|:---|" + "|".join(["---:"] * (len(COMPARISON_COLUMNS) - 1)) + "|"
    assert len(lines) == 2 + 3
    assert lines[3].startswith("| full | 40.00 MiB | -60.0% |")


def test_markdown_table_escapes_pipes() -> None:
    assert markdown_table(["a", "b"], [["x|y", "1"]]).splitlines()[2] == "| x\\|y | 1 |"


def test_comparison_table_renders(result: ComparisonResult) -> None:
    console = Console(width=200, record=True)
    console.print(comparison_table(result))
    text = " ".join(console.export_text().split())
    assert "remat compare: toy, batch 2, seq 8 on cpu" in text
    for header in ("Strategy", "Peak memory", "Activations vs none", "Recompute FLOPs",
                   "Step time vs none", "Gradient check"):
        assert header.split()[0] in text
    assert "-60.0%" in text and "FAIL (2.0e-03)" in text
    assert "median of 3 interleaved" in text


def _profile(**overrides: object) -> SimpleNamespace:
    fields: dict[str, object] = dict(
        peak_bytes=3 * MIB, activation_bytes=MIB, param_bytes=MIB // 2, buffer_bytes=0,
        grad_bytes=MIB // 2, optimizer_bytes=0, batch_bytes=256, flops=3_000_000,
        forward_flops=1_000_000, backward_flops=2_000_000, recompute_flops=0, forward_ms=2.0,
        backward_ms=4.5, step_ms=6.5, allocator_peak_bytes=None,
        blocks=(SimpleNamespace(name="blocks.0", saved_bytes=4096, forward_flops=500_000,
                                forward_ms=0.75),),
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


def test_totals_and_blocks() -> None:
    profile = _profile()
    cells = dict(totals_cells(profile))
    assert cells["Peak memory"] == "3.00 MiB"
    assert cells["Batch"] == "256 B"
    assert cells["Backward / forward"] == "2.25x"
    assert "CUDA max allocated" not in cells
    assert backward_forward_ratio(profile) == pytest.approx(2.25)
    assert backward_forward_ratio(_profile(forward_ms=None)) is None
    console = Console(width=200, record=True)
    console.print(blocks_table(profile))
    console.print(totals_table(profile))
    text = console.export_text()
    assert "blocks.0" in text and "4.00 KiB" in text and "500.00 kFLOP" in text
    assert "0.750 ms" in text
