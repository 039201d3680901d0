"""Time ``remat.jax.plan_preset`` on the NNX gpt-small preset at budgets 25%, 50% and 75%.

Budgets are 25/50/75% of the way from the ``full`` peak to the ``none`` peak (XLA's
compiled peaks of the step), as in the planner tests and ``benchmarks/planner.py``.
Each plan runs in a fresh Python process (no compile cache shared between budgets),
timed from after ``import remat.jax`` to the returned plan, model construction
included. The parent process compiles the manual strategies (not timed) and prints,
per budget, the cheapest manual strategy whose XLA peak fits, so the table shows the
plan's recompute next to it.

Usage::

    .venv/bin/python benchmarks/jax_plan.py                  # gpt-small, batch 8
    .venv/bin/python benchmarks/jax_plan.py --preset gpt-tiny --batch 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone

FRACTIONS = (0.25, 0.5, 0.75)
MANUAL = ("full", "every:2", "sqrt", "dots_saveable", "dots_with_no_batch_dims_saveable",
          "save_only_these_names:qkv,mlp_up", "nothing_saveable")


def one(preset: str, batch_size: int, budget_bytes: int) -> None:
    """Child process: plan once, cold, and print the result as one JSON line."""
    import remat.jax as rj

    wall, cpu = time.perf_counter(), time.process_time()
    plan = rj.plan_preset(preset, budget=budget_bytes, batch_size=batch_size)
    print(json.dumps({"plan_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                      "peak_bytes": plan.measured_peak_bytes,
                      "recompute_flops": plan.recompute_flops, "label": plan.label()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt-small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        one(args.preset, args.batch, args.one)
        return
    import jax

    import remat.jax as rj

    model = rj.build_model(args.preset)
    batch = rj.make_batch(model, args.batch)
    none = rj.analyze_step(model, batch)
    manual = {}
    for name in MANUAL:
        step = rj.analyze_step(rj.apply(model, name), batch)
        manual[name] = (step.peak_bytes, step.flops - none.flops)
        rj.remove(model)
    full_peak = manual["full"][0]
    print(f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, jax {jax.__version__}, backend {jax.default_backend()}; "
          f"{args.preset}, batch {args.batch}; each plan in a fresh process")
    print("| budget | bytes | plan_s | CPU s | XLA peak | recompute FLOPs | plan "
          "| best fitting manual (recompute FLOPs) |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for fraction in FRACTIONS:
        budget_bytes = int(full_peak + fraction * (none.peak_bytes - full_peak))
        out = subprocess.run(
            [sys.executable, __file__, "--preset", args.preset, "--batch", str(args.batch),
             "--one", str(budget_bytes)], check=True, capture_output=True, text=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        fits = [(flops, name) for name, (peak, flops) in manual.items() if peak <= budget_bytes]
        best = min(fits) if fits else None
        best_text = "-" if best is None else f"{best[1]} ({best[0]:,})"
        print(f"| {fraction:.0%} | {budget_bytes:,} | {row['plan_s']:.1f} | {row['cpu_s']:.1f} "
              f"| {row['peak_bytes']:,} | {row['recompute_flops']:,} | {row['label']} "
              f"| {best_text} |", flush=True)


if __name__ == "__main__":
    main()
