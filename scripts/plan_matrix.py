"""remat.plan on every Hugging Face architecture of the compatibility matrix.

For each architecture (the small random-weight configs of ``compat_matrix.py``) and budgets
25% and 75% of the way from the full-checkpoint peak to the no-checkpoint peak: plan, check
the measured peak against the budget and the gradients against the un-checkpointed model.
Prints a markdown table and writes it to ``docs/plan_matrix.md``; exits 1 if any plan
misses its budget or its gradients differ.

Usage::

    .venv/bin/python scripts/plan_matrix.py [--arch llama --arch t5] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compat_matrix as cm  # noqa: E402

import remat  # noqa: E402
from remat.measure import profile  # noqa: E402
from remat.units import format_bytes  # noqa: E402

FRACTIONS = (0.25, 0.75)
DOC = Path(__file__).resolve().parents[1] / "docs" / "plan_matrix.md"


def _fresh(arch: cm.Arch) -> torch.nn.Module:
    torch.manual_seed(0)
    model = arch.build()
    model.train()
    return model


def run(arch: cm.Arch) -> list[tuple[str, ...]]:
    """One row per budget: budget, measured peak, fits, worst gradient error, time, plan."""
    batch = cm.make_batch(arch.kind)
    model = _fresh(arch)
    none_peak = profile(model, batch, timing=False).peak_bytes
    remat.apply(model, "full")
    full_peak = profile(model, batch, timing=False).peak_bytes
    remat.remove(model)
    rows = []
    for fraction in FRACTIONS:
        budget = int(full_peak + fraction * (none_peak - full_peak))
        started = time.perf_counter()
        plan = remat.plan(model, batch, budget=budget)
        elapsed_s = time.perf_counter() - started
        report = remat.validate(_fresh(arch), batch, plan)
        peak = plan.measured_peak_bytes or 0
        rows.append((arch.name, f"{fraction:.0%}: {format_bytes(budget)}", format_bytes(peak),
                     "yes" if peak <= budget else "NO", f"{report.max_rel_error:.1e}",
                     "PASS" if report.passed else "FAIL", f"{elapsed_s:.1f} s", plan.label()))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", choices=sorted(cm.ARCHS),
                        help="architectures to plan (default: all)")
    parser.add_argument("--out", type=Path, default=DOC, help="markdown file to write")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    header = ("model", "budget", "measured peak", "fits", "grad error", "parity", "plan time",
              "plan")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    ok = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for key in args.arch or list(cm.ARCHS):
            for row in run(cm.ARCHS[key]):
                ok = ok and row[3] == "yes" and row[5] == "PASS"
                lines.append("| " + " | ".join(row) + " |")
                print(lines[-1], file=sys.stderr, flush=True)
    table = "\n".join(lines)
    print(table)
    args.out.write_text(
        "# remat.plan on Hugging Face architectures\n\n"
        f"Produced by `python scripts/plan_matrix.py` in {time.perf_counter() - started:.0f} s "
        f"(torch {torch.__version__}, transformers {cm.transformers.__version__}, CPU, "
        "float32). Models and batches are those of [compat.md](compat.md) (random weights, "
        "small configs). Budgets are 25% and 75% of the way from the full-checkpoint peak to "
        "the no-checkpoint peak; the peak is measured with the plan applied, and the gradient "
        "error is the worst relative error of loss and gradients vs the un-checkpointed "
        "model.\n\n" + table + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
