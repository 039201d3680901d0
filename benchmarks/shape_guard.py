"""What the shape guard costs a training step (NOTE [ Shape guard ] in strategies/guard.py).

For each built-in model, one plan (``remat.plan`` at ``--budget``) is applied to two
copies of the model with the same weights: one with the guard (``on_new_shape="error"``,
the default), one without (``on_new_shape="off"``). Their training steps (forward,
backward, AdamW) run interleaved, A B A B ..., so machine noise hits both alike; the
step times are the medians. Since the guard's work is a few integer comparisons, a
difference of step medians is mostly noise; so the guard's own call (the forward
pre-hook on the batch, as the model's call makes it) is also timed alone, many calls in
a row, and reported as a share of the guarded step's median: that is its cost.

Writes benchmarks/RESULTS_shapes.md (the section between ``<!-- shape_guard:start -->``
and ``<!-- shape_guard:end -->``).

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/shape_guard.py [--repeats 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import remat
from remat.models import build_model, make_batch
from remat.strategies.guard import shape_guard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import replace_section, run_header  # noqa: E402

RESULTS_SHAPES = Path(__file__).resolve().parent / "RESULTS_shapes.md"
#: (preset, batch size, sequence length): the built-in models at sizes a CPU steps in
#: milliseconds (tiny) to a few hundred (small).
MODELS = (("gpt-tiny", 8, 32), ("llama-tiny", 8, 32), ("gpt-small", 8, 128),
          ("llama-small", 8, 128))
#: Calls of the guard alone per timing.
HOOK_CALLS = 2000


def _step(model: nn.Module, batch: dict[str, torch.Tensor]) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def run() -> None:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return run


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def measure(preset: str, batch_size: int, seq_len: int, *, budget: str,
            repeats: int) -> dict[str, Any]:
    """Step medians with and without the guard and the guard's own call, ms."""
    torch.manual_seed(0)
    model = build_model(preset)
    batch = make_batch(model, batch_size, seq_len=seq_len)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = remat.plan(model, batch, budget=budget)
        bare = copy.deepcopy(model)
        remat.apply(model, plan)  # the default: on_new_shape="error"
        remat.apply(bare, plan, on_new_shape="off")
    guard = shape_guard(model)
    assert guard is not None and shape_guard(bare) is None
    steps = {"guard on": _step(model, batch), "guard off": _step(bare, batch)}
    for step in steps.values():  # warm-up: allocator, optimizer state
        step()
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(_timed(step))
    medians = {name: statistics.median(t) for name, t in times.items()}

    def hook_calls() -> None:
        for _ in range(HOOK_CALLS):
            guard(model, (), batch)

    hook_us = statistics.median(_timed(hook_calls) for _ in range(7)) * 1e3 / HOOK_CALLS
    return {"model": preset, "batch": f"{batch_size} x {seq_len}",
            "envelope": guard.plan.shape_envelope.label(), "decisions": len(plan.decisions),
            "on_ms": medians["guard on"], "off_ms": medians["guard off"], "hook_us": hook_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="steps per variant")
    parser.add_argument("--budget", default="70%", help="the plan's budget")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: a shared machine's other jobs cannot stall "
                             "a step's thread pool)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.time()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = [measure(p, b, s, budget=args.budget, repeats=args.repeats) for p, b, s in MODELS]
    lines = ["| model | batch | step, guard off | step, guard on | on / off | guard's call "
             "| guard's call / step |", "|---|---|--:|--:|--:|--:|--:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} | {r['off_ms']:.2f} ms | "
                     f"{r['on_ms']:.2f} ms | {r['on_ms'] / r['off_ms']:.3f}x | "
                     f"{r['hook_us']:.1f} us | {r['hook_us'] / 1e3 / r['on_ms']:.4%} |")
    body = (run_header("Shape guard: cost per training step", "shape_guard.py",
                       sys.argv[1:], started)
            + f"Plan: `remat.plan(model, batch, budget={args.budget!r})`, applied to two "
            "copies of the model with the same weights, one guarded (`on_new_shape=\"error\"`, "
            "the default) and one not (`\"off\"`). Step: forward, backward, AdamW; median of "
            f"{args.repeats} steps per variant, interleaved. Guard's call: the forward "
            f"pre-hook alone on the same batch, median of 7 runs of {HOOK_CALLS} calls; its "
            "share of the guarded step is the guard's cost (the step medians differ by "
            "noise of the same order). Load average (1, 5, 15 min) when the run started: "
            f"{load} (a shared machine: step times vary between runs).\n\n"
            + "\n".join(lines) + "\n")
    print(body)
    if not args.no_write:
        text = RESULTS_SHAPES.read_text() if RESULTS_SHAPES.exists() else ""
        RESULTS_SHAPES.write_text(replace_section(text, "shape_guard", body))


if __name__ == "__main__":
    main()
