"""Where a plan's gap to the lower bound comes from, for chosen cases of benchmarks/planner.py.

For each case ``MODEL:PERCENT`` (``fam-bloom:75``, ``gen-103:25``) it measures ``none`` and
``full`` and plans the budget as benchmarks/planner.py does, then splits plan / LP bound
into three factors whose product it is:

- integrality: the integer optimum of the bound's program (NOTE [ Lower bound ]; HiGHS's
  dual bound) / the LP optimum: what the fractional relaxation gains;
- peak: the integer optimum at the bytes the plan actually freed (``none`` peak - the
  plan's measured peak) / at the bytes the budget needs: the plan frees more than it must
  (the peak model's margin, or no candidate between);
- planner: the plan's recompute / the integer optimum at the bytes it freed: what the
  planner's candidates (block-level choices, its op menu) or its solver leave on the table.

It also prints which program binds (plans without a chunked head, or with one: NOTE [ A
chunked head in the bound ] in benchmarks/_bound.py) and which ops its integer optimum
re-runs besides the groups every such plan re-runs.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/bound_gap.py fam-bloom:75 gen-103:25
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import Bounds, LinearConstraint, milp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bound import (  # noqa: E402
    ForwardGraph,
    _program,
    integer_bound_ms,
    lp_bound_ms,
    program_lp_ms,
    programs,
)
from planner import head_freed_bytes, model_and_batch, saved_graph  # noqa: E402

from remat.compare.frontier import frontier  # noqa: E402
from remat.planning import plan  # noqa: E402


def rerun(graph: ForwardGraph, need_bytes: int, head_bytes: int) -> str:
    """The binding program (the one with the least LP optimum) and what its integer optimum
    re-runs besides its forced groups: each group's ops, how many such groups."""
    program = min(programs(graph, need_bytes, head_bytes), key=lambda p: program_lp_ms(graph, p))
    objective, matrix, rhs = _program(graph, program)
    result = milp(objective, constraints=LinearConstraint(matrix, -np.inf, rhs),
                  integrality=np.ones(len(objective)), bounds=Bounds(0.0, 1.0),
                  options={"time_limit": 30.0})
    y = result.x[len(graph.nbytes):]
    groups = Counter("+".join(op.removeprefix("aten.") for op in graph.ops[g])
                     for g in np.flatnonzero(y > 0.5)
                     if program.cost_ms[g] > 0 and g not in program.forced)
    return f"{program.label}: " + ", ".join(f"{n}x {ops}" for ops, n in groups.most_common())


def gap(case: str) -> str:
    """One line: the case's plan / bound and its three factors."""
    preset, percent = case.rsplit(":", 1)
    model, batch, name = model_and_batch(preset, 2 if preset.startswith("gen-") else 4)
    manual = frontier(model, batch, budget_bytes=1, strategies=("none", "full"))
    full, none = manual.point("full").peak_bytes, manual.point("none").peak_bytes
    budget = int(full + int(percent) / 100 * (none - full))
    graph = saved_graph(model, batch, manual.cost_device)
    head_bytes = head_freed_bytes(model, batch, graph)  # NOTE [ A chunked head in the bound ]
    result = plan(model, batch, budget=budget)
    freed = none - result.measured_or_predicted_peak_bytes
    lp = lp_bound_ms(graph, none - budget, head_bytes)
    whole = integer_bound_ms(graph, none - budget, head_bytes)
    at_plan = integer_bound_ms(graph, freed, head_bytes)
    return (f"{name} {percent}%: plan {result.recompute_ms * 1e3:.2f} us, LP "
            f"{lp * 1e3:.2f} us ({result.recompute_ms / lp:.2f}x) = integrality "
            f"{whole / lp:.2f} x peak {at_plan / whole:.2f} (frees {freed / 1e6:.2f} MB, "
            f"needs {(none - budget) / 1e6:.2f} MB; predicted peak "
            f"{result.predicted_peak_bytes / 1e6:.2f} MB, measured "
            f"{result.measured_or_predicted_peak_bytes / 1e6:.2f} MB, budget "
            f"{budget / 1e6:.2f} MB) x planner {result.recompute_ms / at_plan:.2f} "
            f"[{result.label()}]; the binding program and what its integer optimum re-runs: "
            f"{rerun(graph, none - budget, head_bytes)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", help="MODEL:PERCENT, e.g. fam-bloom:75")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))  # as planner.py
    for case in args.cases:
        print(gap(case), flush=True)


if __name__ == "__main__":
    main()
