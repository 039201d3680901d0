"""Where the fast plan rows' time goes (NOTE [ Fast plan rows ]), and the rows against exact ones.

Simulates Llama-7B's ``none`` rows and plan rows (bf16, seq 2048, h100-80gb, batch
1..32), prints the CPU seconds of each part of the fast plan path (candidates on the cut
stack, shallow windows steps, the confirmation steps), and with ``--exact 8,32`` compares
those plan rows with exact ones (the whole planner and its closed loop per size).

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/plan_rows.py --exact 8,32
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import remat.simulate.plan_fast as plan_fast
from remat.simulate.run import simulate

PARTS = ("_candidates", "_windows", "_confirmed")


def _timed(seconds: dict[str, float], name: str) -> None:
    real: Callable[..., Any] = getattr(plan_fast, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.process_time()
        try:
            return real(*args, **kwargs)
        finally:
            seconds[name] = seconds.get(name, 0.0) + time.process_time() - started

    setattr(plan_fast, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-7b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", default="1,2,4,8,16,32")
    parser.add_argument("--exact", default="", help="batch sizes to compare with exact rows")
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch.split(",")]
    seconds: dict[str, float] = {}
    for name in PARTS:
        _timed(seconds, name)
    started = time.process_time()
    fast = simulate(args.model, seq_len=args.seq, batch_sizes=sizes, strategies=["none"],
                    plan=True)
    total = time.process_time() - started
    parts = ", ".join(f"{name.strip('_')} {seconds.get(name, 0.0):.2f} s" for name in PARTS)
    print(f"{args.model} none + plan rows: {total:.2f} s CPU; fast plan parts: {parts}")
    for b in [int(b) for b in args.exact.split(",") if b]:
        exact = simulate(args.model, seq_len=args.seq, batch_sizes=[b], strategies=["none"],
                         plan=True, exact=True).row("plan", b)
        row = fast.row("plan", b)
        step = row.step_ms / exact.step_ms - 1 if exact.step_ms else 0.0
        print(f"plan batch {b}: peak {row.peak_bytes - exact.peak_bytes:+d} B, step "
              f"{step:+.2e}, flops {row.flops - exact.flops:+d}, activations "
              f"{row.activation_bytes - exact.activation_bytes:+d} B, phase "
              f"{row.peak_phase} / {exact.peak_phase}")


if __name__ == "__main__":
    main()
