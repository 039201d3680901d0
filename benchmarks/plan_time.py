"""Time ``remat.plan`` end to end on issue #11's timing model, with a per-phase breakdown.

The model is ``gpt-tiny`` with ``n_layer`` layers, d_model 128, seq 128, batch 4 (float32,
CPU). Each layer count is planned once untimed (imports, dynamo set-up and other
first-call costs stay out), then ``--repeats`` times per budget; the script prints the
median wall and CPU (``time.process_time``) seconds of each, and the median seconds spent
in each phase of NOTE [ How a plan is made ] (src/remat/planning/planner.py), read off the
planner's progress reports:

- ``fake copy``: the fake model, batch and optimizer;
- ``block inputs``: the forward that captures each block's arguments;
- ``candidates``: every candidate of every kind of block run on its own;
- ``windows``: one tracked whole step without checkpointing (the peak model's calibration);
- ``closed loop``: solving, and measuring the chosen plan with a whole step.

``--throughput`` also times ``plan_throughput(...)`` on ``gpt-small`` (budget 60% of
the batch-8 peak), once (it takes a minute).

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/plan_time.py                  # 32 layers, 50%
    PYTHONPATH=src .venv/bin/python benchmarks/plan_time.py --layers 16,32 --budgets 25,50,75
    PYTHONPATH=src .venv/bin/python benchmarks/plan_time.py --throughput
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections import defaultdict

import torch

from remat.models import build_model, make_batch
from remat.planning import plan, plan_throughput
from remat.progress import reporting

PHASES = ("fake copy", "block inputs", "candidates", "windows", "closed loop")


def _phase(step: str) -> str:
    """The phase a progress report's ``step`` belongs to (see the module docstring)."""
    if step.startswith("closed loop"):
        return "closed loop"
    if step.startswith("memory windows"):
        return "windows"
    if step in ("fake copy", "block inputs"):
        return step
    return "candidates"


class PhaseClock:
    """Wall seconds per phase, from the timestamps of the planner's progress reports."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._phase: str | None = None
        self._since = 0.0

    def __call__(self, step: str, done: int, total: int) -> None:
        self._switch(_phase(step))

    def _switch(self, phase: str | None) -> None:
        now = time.perf_counter()
        if self._phase is not None:
            self.seconds[self._phase] += now - self._since
        self._phase, self._since = phase, now

    def stop(self) -> None:
        """Charge the time since the last report to its phase."""
        self._switch(None)


def time_plan(n_layer: int, budget_percent: int) -> tuple[float, float, dict[str, float], bool]:
    """Wall s, CPU s, wall s per phase of one ``plan`` at ``budget_percent``% of the
    no-checkpoint peak, and whether the plan's measured peak fits its budget."""
    torch.manual_seed(0)
    model = build_model("gpt-tiny", n_layer=n_layer, d_model=128, max_seq_len=128)
    batch = make_batch(model, 4)
    clock = PhaseClock()
    started, cpu = time.perf_counter(), time.process_time()
    with reporting(clock):
        result = plan(model, batch, budget=f"{budget_percent}%")
    clock.stop()
    wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    return wall_s, cpu_s, dict(clock.seconds), result.measured_peak_bytes <= result.budget_bytes


def time_throughput() -> tuple[float, float, int]:
    """Wall s, CPU s and the batch size picked by the throughput search on ``gpt-small``."""
    torch.manual_seed(0)
    model = build_model("gpt-small")
    started, cpu = time.perf_counter(), time.process_time()
    result = plan_throughput(model, lambda n: make_batch(model, n), budget="60%")
    return time.perf_counter() - started, time.process_time() - cpu, int(result.batch_size or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="32", help="layer counts, comma-separated")
    parser.add_argument("--budgets", default="50",
                        help="budgets, percent of the no-checkpoint peak, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="timed plans per case")
    parser.add_argument("--throughput", action="store_true",
                        help="also time the throughput search on gpt-small")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of "
          f"{args.repeats}", flush=True)
    for n_layer in (int(n) for n in args.layers.split(",") if n.strip()):
        time_plan(n_layer, 75)  # first-call costs
        for budget in (int(b) for b in args.budgets.split(",") if b.strip()):
            runs = [time_plan(n_layer, budget) for _ in range(args.repeats)]
            wall = statistics.median(r[0] for r in runs)
            cpu = statistics.median(r[1] for r in runs)
            phases = ", ".join(f"{p} {statistics.median(r[2].get(p, 0.0) for r in runs):.2f}"
                               for p in PHASES)
            fits = all(r[3] for r in runs)
            print(f"plan, {n_layer} layers, budget {budget}%: {wall:.2f} s wall, "
                  f"{cpu:.2f} s CPU (runs: {', '.join(f'{r[0]:.2f}' for r in runs)} s wall); "
                  f"phases, s wall: {phases}; fits: {fits}", flush=True)
    if args.throughput:
        wall_s, cpu_s, batch_size = time_throughput()
        print(f"throughput search, gpt-small: {wall_s:.1f} s wall, {cpu_s:.1f} s CPU, "
              f"batch {batch_size}", flush=True)


if __name__ == "__main__":
    main()
