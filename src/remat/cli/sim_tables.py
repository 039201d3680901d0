"""The rich tables of ``remat simulate`` and ``remat estimate``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from rich.table import Table

    from remat.simulate.estimate import EstimateTable
    from remat.simulate.result import SimulationResult


def rate(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.2f} M"
    if value >= 1e3:
        return f"{value / 1e3:.1f} k"
    return f"{value:.1f}"


def _ms(value: float) -> str:
    return f"{value:.3f}" if value < 1 else f"{value:.1f}"


def _signed(nbytes: int) -> str:
    from remat.units import format_bytes

    return format_bytes(nbytes) if nbytes >= 0 else f"[red]-{format_bytes(-nbytes)}[/]"


def simulation_tables(result: SimulationResult) -> tuple[Table, Table]:
    """The per-strategy-and-batch table and the largest-batch summary, as rich tables."""
    from rich.table import Table

    from remat.units import format_bytes

    ranks = f", {result.sharding} x{result.world_size}" if result.sharding != "none" else ""
    outside = (f"; {format_bytes(result.outside_bytes)} outside the allocator, "
               f"{format_bytes(result.workspace_bytes)} workspaces"
               if result.outside_bytes or result.workspace_bytes else "")
    main = Table(title=f"{result.model}: seq {result.seq_len}, {result.precision} + "
                       f"{result.optimizer} on {result.device} "
                       f"({format_bytes(result.device_memory_bytes)}{outside}{ranks}), "
                       "simulated" + (", accumulation micro-steps (gradients held)"
                                      if result.accumulating else ""),
                 title_justify="left")
    for header in ("Strategy", "Batch", "Allocated / rank", "Reserved / rank", "Left", "Fits",
                   "Activations", "Step (ms)", "Samples/s", "Tokens/s", "Recompute time"):
        main.add_column(header, justify="left" if header == "Strategy" else "right")
    for strategy in result.strategies:
        rows = result.rows_for(strategy)
        for i, r in enumerate(rows):
            recompute = f"{100 * r.recompute_ms / r.step_ms:.0f}%" if r.step_ms else "-"
            missing = bool(r.note) and not r.note.startswith("fits with")
            fits = "[green]yes[/]" if r.fits else \
                "[yellow]expandable[/]" if r.note.startswith("fits with") else "[red]no[/]"
            main.add_row(
                strategy if i == 0 else "", str(r.batch_size), format_bytes(r.peak_bytes),
                format_bytes(r.reserved_bytes) if r.reserved_bytes else "-",
                _signed(r.margin_bytes) if r.reserved_bytes else "-", fits,
                format_bytes(r.activation_bytes) if not missing else "-",
                _ms(r.step_ms) if not missing else "-",
                rate(r.samples_per_s) if not missing else r.note,
                rate(r.tokens_per_s) if not missing else "-",
                recompute if not missing else "-",
                end_section=i == len(rows) - 1,
            )
    best = result.best()
    summary = Table(title="Largest micro-batch that fits, per strategy", title_justify="left")
    for header in ("Strategy", "Largest batch", "Reserved / rank", "Tokens/s"):
        summary.add_column(header, justify="left" if header == "Strategy" else "right")
    for strategy in result.strategies:
        largest = result.largest_batch(strategy)
        if largest is None:
            summary.add_row(strategy, "[red]none fits[/]", "-", "-")
            continue
        r = result.row(strategy, largest)
        mark = " (best)" if best is not None and r == best else ""
        summary.add_row(strategy + mark, str(largest),
                        format_bytes(r.reserved_bytes or r.peak_bytes), rate(r.tokens_per_s))
    return main, summary


def longest_seqs(results: Sequence[SimulationResult]) -> dict[str, dict[str, int] | None]:
    """Per strategy: the longest sequence (of the runs) at which some micro-batch fits, with
    the largest micro-batch that fits there, its allocated and its reserved peak per rank
    and the margin left on the card; None when none fits."""
    out: dict[str, dict[str, int] | None] = {}
    for strategy in results[0].strategies:
        out[strategy] = None
        for result in sorted(results, key=lambda r: r.seq_len):
            largest = result.largest_batch(strategy) if strategy in result.strategies else None
            if largest is not None:
                row = result.row(strategy, largest)
                out[strategy] = {"seq_len": result.seq_len, "batch_size": largest,
                                 "peak_bytes": row.peak_bytes,
                                 "reserved_bytes": row.reserved_bytes,
                                 "margin_bytes": row.margin_bytes}
    return out


def longest_seq_table(results: Sequence[SimulationResult]) -> Table:
    """The longest sequence that fits per strategy, over one simulation per length."""
    from rich.table import Table

    from remat.units import format_bytes

    seqs = ", ".join(str(r.seq_len) for r in sorted(results, key=lambda r: r.seq_len))
    table = Table(title=f"Longest sequence that fits, per strategy (of {seqs})",
                  title_justify="left")
    for header in ("Strategy", "Longest seq", "Largest batch there", "Peak / rank"):
        table.add_column(header, justify="left" if header == "Strategy" else "right")
    for strategy, found in longest_seqs(results).items():
        if found is None:
            table.add_row(strategy, "[red]none fits[/]", "-", "-")
        else:
            table.add_row(strategy, str(found["seq_len"]), str(found["batch_size"]),
                          format_bytes(found["peak_bytes"]))
    return table


def estimate_table(table: EstimateTable) -> Table:
    """The formula-vs-simulation table, as a rich table."""
    from rich.table import Table

    from remat.simulate.estimate import FORMULAS
    from remat.units import format_bytes

    out = Table(title=f"{table.model}: activation bytes per layer (h={table.hidden_size}, "
                      f"a={table.n_heads}, {table.precision}), formulas vs simulation",
                title_justify="left", caption="error = (formula - simulated) / simulated",
                caption_justify="left")
    for header in ("Seq", "Batch", "Checkpointing", "Simulated", "12·s·b·h",
                   "Korthikanti Eq.1", "34·s·b·h (flash)", "2·s·b·h (full ckpt)"):
        out.add_column(header, justify="right")
    for i, row in enumerate(table.rows):
        cells = []
        for name in FORMULAS:
            est = row.estimate(name)
            cells.append("" if est is None else
                         f"{format_bytes(est.bytes)} ({100 * est.rel_error:+.0f}%)")
        out.add_row(str(row.seq_len), str(row.batch_size), row.checkpointing,
                    format_bytes(row.simulated_bytes), *cells,
                    end_section=row.checkpointing == "full" and i < len(table.rows) - 1)
    return out
