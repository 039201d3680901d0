"""Benchmark the planner against every manual strategy; write RESULTS.md and a frontier plot.

For gpt-small and llama-small (batch 8, full sequence length, CPU, float32):

1. measure every manual strategy (none, full, every:N for all N, sqrt, attn, mlp, ops)
   with :func:`remat.compare.frontier.frontier`: peak bytes, and recompute cost as the
   roofline time of the recomputed ops with H100 figures;
2. for budgets 25%, 50% and 75% of the way from the full-checkpoint peak to the
   no-checkpoint peak, run :func:`remat.plan` (closed loop measured for real) and
   compare its recompute cost with the cheapest manual strategy whose peak fits;
3. check the gradients of every plan against the un-checkpointed model;
4. time planning a 12-layer model end to end.

Then it replaces the section between ``<!-- planner:start -->`` and
``<!-- planner:end -->`` in ``benchmarks/RESULTS.md`` (created when missing) and draws
``benchmarks/planner.png`` (the frontier at the 50% budget, one panel per model).

Usage::

    .venv/bin/python benchmarks/planner.py               # real measurements
    .venv/bin/python benchmarks/planner.py --simulate    # FakeTensorMode (same bytes on CPU)
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from remat.compare.frontier import Frontier, FrontierPoint, frontier
from remat.models import build_model, make_batch
from remat.planning import Plan, plan, prepare
from remat.report.frontier import frontier_markdown, plot_frontier
from remat.report.tables import markdown_table
from remat.units import format_bytes, format_pct
from remat.validation import validate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import cpu_name as _cpu_name  # noqa: E402
from _results import replace_section  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
PLOT = HERE / "planner.png"
SECTION = "planner"
RUNS: tuple[tuple[str, int], ...] = (("gpt-small", 8), ("llama-small", 8))
FRACTIONS = (0.25, 0.5, 0.75)


@dataclass
class Row:
    """One model at one budget."""

    model: str
    fraction: float
    plan: Plan
    best: FrontierPoint
    grad_error: float
    plan_s: float

    @property
    def reduction(self) -> float:
        """1 - plan recompute / best manual recompute."""
        return float(1.0 - self.plan.recompute_ms / self.best.recompute_ms)




def _command() -> str:
    root = HERE.parent
    python = Path(sys.executable)
    shown = str(python.relative_to(root)) if python.is_relative_to(root) else "python"
    script = Path(sys.argv[0]).resolve()
    script_text = str(script.relative_to(root)) if script.is_relative_to(root) else str(script)
    return shlex.join([shown, script_text, *sys.argv[1:]])


def _us(ms: float) -> str:
    return f"{ms * 1e3:.1f} us"


def run_model(preset: str, batch_size: int, *, simulate: bool,
              log: list[str]) -> tuple[list[Row], Frontier]:
    """Measure the manual strategies and plan three budgets for one preset."""
    torch.manual_seed(0)
    model = build_model(preset)
    model.train()
    batch = make_batch(model, batch_size)
    label = f"{preset}, batch {batch_size}, seq {int(batch['input_ids'].shape[1])}"
    started = time.perf_counter()
    context = prepare(model, batch)
    prepare_s = time.perf_counter() - started
    manual = frontier(model, batch, budget_bytes=1, simulate=simulate, label=label)
    full, none = manual.point("full").peak_bytes, manual.point("none").peak_bytes
    rows: list[Row] = []
    mid: Frontier | None = None
    for fraction in FRACTIONS:
        budget = int(full + fraction * (none - full))
        started = time.perf_counter()
        result = plan(model, batch, budget=budget, context=context, simulate=simulate)
        plan_s = prepare_s + time.perf_counter() - started
        fitting = [p for p in manual.points if p.peak_bytes <= budget]
        best = min(fitting, key=lambda p: (p.recompute_ms, p.peak_bytes))
        report = validate(model, batch, result)
        rows.append(Row(preset, fraction, result, best,
                        max(report.max_rel_error, report.loss_rel_error), plan_s))
        log.append(f"{preset} {fraction:.0%}: plan {_us(result.recompute_ms)} vs "
                   f"{best.name} {_us(best.recompute_ms)} ({rows[-1].reduction:+.1%})")
        print(log[-1], flush=True)
        if fraction == 0.5:
            points = tuple(FrontierPoint(p.name, p.peak_bytes, p.recompute_flops,
                                         p.recompute_ms, p.overhead_pct,
                                         p.peak_bytes <= budget) for p in manual.points)
            plan_point = FrontierPoint(
                "plan", result.peak_bytes, result.recompute_flops, result.recompute_ms,
                100.0 * result.recompute_ms / manual.step_ms, result.peak_bytes <= budget)
            mid = Frontier(points + (plan_point,), budget, manual.step_ms, manual.cost_device,
                           f"{label}, budget 50% of the way")
    if mid is None:
        raise RuntimeError("planner benchmark: the 50% budget was not planned")
    return rows, mid


def twelve_layer_seconds(simulate: bool) -> float:
    """Wall time of ``plan`` (everything included) for ``gpt-tiny`` with 12 layers."""
    torch.manual_seed(0)
    model = build_model("gpt-tiny", n_layer=12)
    batch = make_batch(model, 2)
    started = time.perf_counter()
    plan(model, batch, budget="85%", simulate=simulate)
    return time.perf_counter() - started


def render(rows: list[Row], fronts: list[Frontier], *, twelve_s: float, elapsed_s: float,
           simulate: bool) -> str:
    """The markdown body of the planner section."""
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    headers = ("Model", "Budget", "Plan peak (measured)", "Predicted", "Plan recompute",
               "Best manual that fits", "Its recompute", "Less recompute", "Grad error",
               "Plan time", "Plan")
    table = []
    for r in rows:
        table.append([
            r.model, f"{r.fraction:.0%}: {format_bytes(r.plan.budget_bytes)}",
            format_bytes(r.plan.peak_bytes), format_bytes(r.plan.predicted_peak_bytes),
            _us(r.plan.recompute_ms), f"{r.best.name} ({format_bytes(r.best.peak_bytes)})",
            _us(r.best.recompute_ms), format_pct(100 * r.reduction), f"{r.grad_error:.1e}",
            f"{r.plan_s:.1f} s", r.plan.label(),
        ])
    average = sum(r.reduction for r in rows) / len(rows)
    fits = all(r.plan.peak_bytes <= r.plan.budget_bytes for r in rows)
    beats = all(r.plan.recompute_ms <= r.best.recompute_ms for r in rows)
    lines = [
        "## Planner: cheapest plan under a budget vs the best manual strategy",
        "",
        f"Command: `{_command()}` (from the repository root; {elapsed_s:.0f} s in total).",
        f"Date: {now}.",
        "",
        f"- Platform: {platform.platform()}, Python {platform.python_version()}",
        f"- CPU: {_cpu_name()} ({os.cpu_count()} logical cores visible, torch threads: "
        f"{torch.get_num_threads()})",
        f"- torch {torch.__version__}; device: cpu; measurements: "
        f"{'simulated (FakeTensorMode)' if simulate else 'real'}",
        "",
        "Budgets are 25%, 50% and 75% of the way from the full-checkpoint peak to the "
        "no-checkpoint peak (whole training step: parameters, gradients, batch and "
        "activations; no optimizer). Recompute cost is the roofline time of every "
        "recomputed op with H100 figures (max of FLOPs / 67 TFLOP/s fp32 and bytes / "
        "3.35 TB/s). \"Best manual\" is the cheapest of none, full, every:N (all N), sqrt, "
        "attn, mlp and ops whose measured peak fits the budget. Plan peaks are measured "
        "with `remat.profile` after applying the plan; \"Predicted\" is the peak model's "
        "prediction. Grad error: worst relative error of loss and gradients vs the "
        "un-checkpointed model (float32, dropout on). Plan time includes measuring the "
        "candidates and the closed loop.",
        "",
        markdown_table(headers, table),
        "",
        f"Average recompute reduction vs the best manual strategy: **{average:.1%}** "
        f"(every plan fits its budget: {'yes' if fits else 'NO'}; every plan at most the "
        f"best manual cost: {'yes' if beats else 'NO'}).",
        "",
        f"Planning a 12-layer model (`gpt-tiny` with `n_layer=12`, batch 2) end to end: "
        f"{twelve_s:.1f} s.",
        "",
    ]
    for front in fronts:
        lines += [f"### Frontier: {front.label} ({format_bytes(front.budget_bytes)})", "",
                  frontier_markdown(front), ""]
    lines += [f"![Peak memory vs recompute overhead]({PLOT.name})", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", action="store_true",
                        help="measure under FakeTensorMode (same bytes on CPU, faster)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    warnings.simplefilter("ignore")
    started = time.perf_counter()
    rows: list[Row] = []
    fronts: list[Frontier] = []
    log: list[str] = []
    for preset, batch_size in RUNS:
        model_rows, front = run_model(preset, batch_size, simulate=args.simulate, log=log)
        rows += model_rows
        fronts.append(front)
    twelve_s = twelve_layer_seconds(args.simulate)
    elapsed_s = time.perf_counter() - started
    body = render(rows, fronts, twelve_s=twelve_s, elapsed_s=elapsed_s,
                  simulate=args.simulate)
    text = RESULTS.read_text() if RESULTS.exists() else ""
    RESULTS.write_text(replace_section(text, SECTION, body))
    plot_frontier(fronts, PLOT)
    average = sum(r.reduction for r in rows) / len(rows)
    print(f"average reduction {average:.1%}; wrote {RESULTS} and {PLOT}")


if __name__ == "__main__":
    main()
