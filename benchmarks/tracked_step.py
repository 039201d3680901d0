"""A tracked step's CPU time against an untracked one's (the tracker's own cost).

The 32-layer Hugging Face Llama of ``plan_time.py --hf-llama`` (d 128, seq 128, batch 4)
under ``ops``, one thread: the median CPU seconds of ``--repeats`` untracked steps and of
as many tracked steps (``tracked_step``, as ``remat.profile`` and the closed loop run it),
alternated after one of each untimed. Compare two versions of ``src/`` by running the
script with each on ``PYTHONPATH``, alternated.

    PYTHONPATH=src .venv/bin/python benchmarks/tracked_step.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_time import hf_llama  # noqa: E402

import remat  # noqa: E402
from remat.measure.step import Step, clear_grads, run_step  # noqa: E402
from remat.measure.tracked_step import tracked_step  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, batch = hf_llama(args.layers)
    remat.apply(model, "ops")
    step = Step(model, batch)
    named = step.blocks_found(api="tracked_step.py", required=False)

    def cpu_s(fn: object) -> float:
        clear_grads(model)
        started = time.process_time()
        fn()  # type: ignore[operator]
        return time.process_time() - started

    def plain() -> None:
        run_step(model, batch)

    def tracked() -> None:
        tracked_step(step, named)

    cpu_s(plain), cpu_s(tracked)
    plains, trackeds = [], []
    for _ in range(args.repeats):
        plains.append(cpu_s(plain))
        trackeds.append(cpu_s(tracked))
    p, t = statistics.median(plains), statistics.median(trackeds)
    print(f"HF Llama, {args.layers} layers, ops, 1 thread: untracked {p:.3f} s CPU, "
          f"tracked {t:.3f} s CPU, {t / p:.2f}x (medians of {args.repeats})")


if __name__ == "__main__":
    main()
