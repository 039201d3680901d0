"""Regenerate the planner numbers of docs/jax.md ("Plans on the preset", "Planning time").

Usage: ``python scripts/jax_plan_numbers.py`` (needs ``pip install 'remat[jax]'``).
Prints one markdown row per budget and the wall and CPU time of ``plan_preset``.
"""

from __future__ import annotations

import os
import platform
import time
from datetime import datetime, timezone


def main() -> None:
    started, cpu = time.perf_counter(), time.process_time()
    import remat.jax as rj

    plan = rj.plan_preset("gpt-small", budget="50%")
    wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    import jax

    print(f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, jax {jax.__version__}, backend {jax.default_backend()}")
    print(f"plan_preset('gpt-small', budget='50%') incl. import: {wall_s:.1f} s wall, "
          f"{cpu_s:.1f} s CPU: {plan.label()}")
    model = rj.build_model("gpt-small")
    batch = rj.make_batch(model, 8)
    none = rj.analyze_step(model, batch).peak_bytes
    full = rj.analyze_step(rj.apply(model, "full"), batch).peak_bytes
    rj.remove(model)
    budgets: list[tuple[str, int | str]] = [
        (f"{f:.0%}", int(full + f * (none - full))) for f in (0.25, 0.5, 0.75)]
    budgets.append(('"50%"', "50%"))
    print("| budget | bytes | XLA peak | predicted | recompute FLOPs | plan |")
    print("|---|---:|---:|---:|---:|---|")
    for name, budget in budgets:
        p = rj.plan(model, batch, budget=budget)
        print(f"| {name} | {p.budget_bytes:,} | {p.measured_peak_bytes:,} | "
              f"{p.predicted_peak_bytes:,} | {p.recompute_flops:,} | {p.label()} |")


if __name__ == "__main__":
    main()
