"""remat.plan on every Hugging Face architecture of the compatibility matrix.

For each architecture (the small random-weight configs and batches of ``compat_matrix.py``)
and budgets 25% and 75% of the way from the full-checkpoint peak to the no-checkpoint peak:
plan, compare the plan's measured peak with its budget, and the gradients with the
un-checkpointed model. An architecture remat cannot plan is a row that gives the error
(a documented refusal, e.g. ``BlocksNotFound``, ``BudgetTooSmall``), and the run goes on.
Prints a markdown table and writes it to ``docs/plan_matrix.md``; exits 1 if any plan
misses its budget, its gradients differ, or anything fails other than a remat refusal.

Usage::

    .venv/bin/python scripts/plan_matrix.py [--arch llama --arch t5] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compat_matrix as cm  # noqa: E402

import remat  # noqa: E402
from remat.errors import RematError  # noqa: E402
from remat.measure import profile  # noqa: E402
from remat.units import format_bytes, format_flops, format_ms  # noqa: E402

FRACTIONS = (0.25, 0.75)
DOC = Path(__file__).resolve().parents[1] / "docs" / "plan_matrix.md"
HEADER = ("model", "budget", "plan's peak", "fits", "recompute", "recompute time", "grad error",
          "parity", "plan time", "plan")


@dataclass(frozen=True)
class Row:
    """One budget on one architecture, or the refusal / error that stopped the architecture."""

    model: str
    cells: tuple[str, ...]  # HEADER[1:] for a plan; empty for a refusal / error
    status: str  # "ok", "MISS" (over budget or gradients differ), "refused" or "ERROR"
    note: str = ""  # the exception of a refusal or error


def _recompute(flops: int, step_flops: int) -> str:
    """Recomputed FLOPs per step, and as a share of the un-checkpointed step's FLOPs."""
    if flops == 0:
        return "0 FLOP"
    return f"{format_flops(flops)} (+{flops / step_flops:.0%})"


def _plan_rows(arch: cm.Arch) -> list[Row]:
    batch = arch.batch()
    model = cm.build(arch)
    none = profile(model, batch, timing=False)
    remat.apply(model, "full")
    full_peak = profile(model, batch, timing=False).peak_bytes
    remat.remove(model)
    rows = []
    for fraction in FRACTIONS:
        budget = int(full_peak + fraction * (none.peak_bytes - full_peak))
        started = time.perf_counter()
        plan = remat.plan(model, batch, budget=budget)
        elapsed_s = time.perf_counter() - started
        report = remat.validate(cm.build(arch), batch, plan)
        peak = plan.measured_peak_bytes or 0
        fits = peak <= budget
        rows.append(Row(arch.name, (
            f"{fraction:.0%}: {format_bytes(budget)}", format_bytes(peak),
            "yes" if fits else "NO", _recompute(plan.recompute_flops, none.flops),
            f"{format_ms(plan.recompute_ms)} ({plan.cost_device})",
            f"{report.max_rel_error:.1e}", "PASS" if report.passed else "FAIL",
            f"{elapsed_s:.1f} s", plan.label()), "ok" if fits and report.passed else "MISS"))
    return rows


def run(arch: cm.Arch) -> list[Row]:
    """One row per budget, or one row with the refusal / error; never raises."""
    try:
        return _plan_rows(arch)
    except RematError as exc:  # remat says why it cannot plan this model
        return [Row(arch.name, (), "refused", cm.first_line(exc))]
    except Exception as exc:
        return [Row(arch.name, (), "ERROR", cm.first_line(exc))]


def render(rows: list[Row]) -> str:
    """The markdown table, refusals and errors as footnotes under it."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    notes: list[str] = []
    for row in rows:
        cells = row.cells
        if not cells:
            notes.append(f"{row.model}: {row.note}")
            cells = ("", "", f"{row.status} [{len(notes)}]", *[""] * (len(HEADER) - 4))
        lines.append("| " + " | ".join((row.model, *cells)) + " |")
    if notes:
        lines += ["", *(f"[{i}] {note}" for i, note in enumerate(notes, 1))]
    return "\n".join(lines)


def document(table: str, seconds: float) -> str:
    return (
        "# remat.plan on Hugging Face architectures\n\n"
        f"Produced by `python scripts/plan_matrix.py` in {seconds:.0f} s on "
        f"{time.strftime('%Y-%m-%d', time.gmtime())} ({cm.cpu_label()}; torch {torch.__version__}, "
        f"transformers {cm.transformers.__version__}, float32). Models and batches are those "
        "of [compat.md](compat.md) (random weights, small configs). Budgets are 25% and 75% "
        "of the way from the full-checkpoint peak to the no-checkpoint peak. *plan's peak* is "
        "the step's peak measured with the plan applied (`plan.measured_peak_bytes`), *fits* "
        "compares it with the budget, *recompute* is the FLOPs the plan recomputes per step "
        "and their share of the un-checkpointed step's FLOPs (elementwise ops count 0 FLOPs), "
        "*recompute time* the plan's cost estimate for them (`plan.recompute_ms`, roofline on "
        "the cost device, so elementwise-only recomputation costs time but no FLOPs), and the "
        "gradient error is the "
        "worst relative error of loss and gradients vs the un-checkpointed model. A model "
        "remat cannot plan shows `refused` and the error remat raised.\n\n" + table + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", choices=sorted(cm.ARCHS),
                        help="architectures to plan (default: all)")
    parser.add_argument("--out", type=Path, default=DOC, help="markdown file to write")
    args = parser.parse_args(argv)
    cm.quiet()
    started = time.perf_counter()
    rows: list[Row] = []
    for key in args.arch or list(cm.ARCHS):
        t0 = time.perf_counter()
        rows += run(cm.ARCHS[key])
        statuses = ", ".join(row.status for row in rows if row.model == cm.ARCHS[key].name)
        print(f"{cm.ARCHS[key].name}: {time.perf_counter() - t0:.1f} s, {statuses}",
              file=sys.stderr, flush=True)
    table = render(rows)
    print(table)
    args.out.write_text(document(table, time.perf_counter() - started))
    return 0 if all(row.status in ("ok", "refused") for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
