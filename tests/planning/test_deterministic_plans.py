"""Deterministic plans (NOTE [ Work, not time ] in remat/core/solver.py, NOTE [ Closed loop
on the real model ] in remat/planning/loop.py): no clock decides a plan, and a plan's first
step peaks the same in fresh processes, on an idle and on a loaded machine."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import remat
from remat.measure.profile import first_step_peak
from remat.measure.step import Step
from remat.models import build_model, make_batch

ROOT = Path(__file__).resolve().parents[2]

# A fresh process: the model built from the seed, the plan applied, the first step read
# on the allocator, as a job's first step runs. It says "ready" once imported, then waits
# for the plan on stdin.
_FIRST_STEP = """
import json, sys, torch, remat
from remat.measure.profile import first_step_peak
from remat.measure.step import Step
from remat.models import build_model, make_batch
print("ready", flush=True)
torch.manual_seed(0)
model = build_model("gpt-tiny", n_layer=4, dropout=0.1)
batch = make_batch(model, 2, seed=1)
remat.apply(model, remat.Plan.from_json(sys.stdin.read()))
step = Step(model, batch, optimizer=torch.optim.AdamW(model.parameters()))
print(json.dumps([first_step_peak(step) for _ in range(2)]))
"""


def _model() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model("gpt-tiny", n_layer=4, dropout=0.1)
    return model, make_batch(model, 2, seed=1)


def _plan(model: torch.nn.Module, batch: torch.Tensor, optimizer: torch.optim.Optimizer
          ) -> remat.Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # half-way between the peaks of full (3,852,440 B) and none (4,443,080 B)
        return remat.plan(model, batch, optimizer=optimizer, budget=4_150_000)


@pytest.fixture(scope="module")
def planned() -> tuple[torch.nn.Module, torch.Tensor, torch.optim.Optimizer, remat.Plan]:
    """The model, its batch and optimizer, and their plan on the real clock (planned once
    for the tests below)."""
    model, batch = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    return model, batch, optimizer, _plan(model, batch, optimizer)


def test_a_slowed_clock_gives_the_same_plan(
        planned: tuple[torch.nn.Module, torch.Tensor, torch.optim.Optimizer, remat.Plan],
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, batch, optimizer, idle = planned
    ticks = itertools.count()

    def slow() -> float:  # every reading 1000 s after the last: a machine 1000x busier
        return 1000.0 * next(ticks)

    for name in ("perf_counter", "monotonic", "time", "process_time"):
        monkeypatch.setattr(time, name, slow)
    loaded = _plan(model, batch, optimizer)
    monkeypatch.undo()
    assert loaded.decisions == idle.decisions
    assert loaded.allocator_peak_bytes == idle.allocator_peak_bytes
    assert loaded.cost.recompute_flops == idle.cost.recompute_flops


def test_the_first_step_peaks_the_same_in_fresh_processes(
        planned: tuple[torch.nn.Module, torch.Tensor, torch.optim.Optimizer, remat.Plan]
        ) -> None:
    _, batch, _, plan = planned
    assert plan.allocator_peak_bytes is not None
    # two fresh processes at once, beside a process that keeps a core busy from when both
    # have imported (what is measured runs after the imports) to when both are done
    runs = [subprocess.Popen([sys.executable, "-c", _FIRST_STEP], cwd=ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for _ in range(2)]
    burner = None
    try:
        for run in runs:
            assert run.stdout is not None and run.stdout.readline() == "ready\n"
        burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for run in runs:  # both get their plan before either is waited for
            assert run.stdin is not None
            run.stdin.write(plan.to_json())
            run.stdin.close()
        for run in runs:  # a line of output each: it fits the pipe, so none blocks on it
            run.wait(timeout=300)
        outputs = []
        for run in runs:
            assert run.stdout is not None
            outputs.append(run.stdout.read())
            run.stdout.close()
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
        for run in runs:
            run.kill()
            run.wait()
    peaks = [json.loads(out) for out in outputs]
    assert peaks[0] == peaks[1], peaks
    first, second = peaks[0]
    assert max(first, second) <= plan.budget_bytes
    # the closed loop read the first step of the same plan in this process
    fresh, _ = _model()
    remat.apply(fresh, plan)
    step = Step(fresh, batch, optimizer=torch.optim.AdamW(fresh.parameters()))
    assert first_step_peak(step) == first


#: Modules that time on purpose: measured costs (``cost="measured"``), and the clocks of
#: the CLI's and the simulation's "took N s" lines.
_TIMERS = {"planning/timed.py", "measure/timing.py", "simulate/run.py", "compare/runner.py",
           "cli/compare.py", "cli/plan.py", "cli/jax_backend.py", "cli/seq_len.py"}


def test_no_module_that_decides_a_plan_reads_the_clock() -> None:
    src = ROOT / "src" / "remat"
    readers = sorted(
        str(path.relative_to(src)) for path in src.rglob("*.py")
        if not path.is_relative_to(src / "jax")
        and any(clock in path.read_text() for clock in
                ("perf_counter(", "time.time(", "monotonic(", "time_limit")))
    assert set(readers) <= _TIMERS, set(readers) - _TIMERS
