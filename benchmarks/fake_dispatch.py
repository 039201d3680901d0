"""A simulated step's CPU time under remat's fake mode and under PyTorch's own.

NOTE [ Fake dispatch cache keys ] (measure/fake_mode.py): remat's fake mode keys a fake
tensor by one tuple instead of PyTorch's field-by-field metadata walk, and caches
``_unsafe_view`` as the view it is. This script runs the same exact simulation
(``remat.simulate(..., exact=True)``: every row a whole fake step, no fast path) under each
mode, alternated in one process after one untimed run of each, and prints the median CPU
seconds of each and their ratio; the rows (bytes, FLOPs) must be equal, or the script
fails. One thread.

    PYTHONPATH=src .venv/bin/python benchmarks/fake_dispatch.py
    PYTHONPATH=src .venv/bin/python benchmarks/fake_dispatch.py --preset gpt-small --layers 12
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import remat.measure.fake_mode as fake_mode
from remat.models import build_model
from remat.simulate.run import simulate


def _run(args: argparse.Namespace, ours: bool) -> tuple[float, list[tuple[Any, ...]]]:
    fake_mode._KEYS_SUPPORTED = ours
    FakeTensorMode.cache.clear()  # each run fills its own entries, as a fresh process would
    started = time.process_time()
    result = simulate(lambda: build_model(args.preset, n_layer=args.layers), exact=True,
                      seq_len=args.seq, batch_sizes=args.batch_sizes,
                      strategies=args.strategies.split(","), device=args.device)
    seconds = time.process_time() - started
    rows = [(r.strategy, r.batch_size, r.peak_bytes, r.activation_bytes, r.flops,
             r.recompute_flops) for r in result.rows]
    return seconds, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-small")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 8, 32])
    parser.add_argument("--strategies", default="none,full,attn,ops")
    parser.add_argument("--device", default="l4")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not fake_mode._KEYS_SUPPORTED:
        raise SystemExit(f"torch {torch.__version__} dispatches fake tensors another way: "
                         "remat uses PyTorch's own mode here")
    _, ours_rows = _run(args, True)
    _, theirs_rows = _run(args, False)
    if ours_rows != theirs_rows:
        raise SystemExit(f"rows differ:\n{ours_rows}\n{theirs_rows}")
    ours, theirs = [], []
    for _ in range(args.repeats):
        theirs.append(_run(args, False)[0])
        ours.append(_run(args, True)[0])
    o, t = statistics.median(ours), statistics.median(theirs)
    print(f"{args.preset}, {args.layers} layers, seq {args.seq}, batches {args.batch_sizes}, "
          f"{args.strategies} on {args.device}, exact, 1 thread, torch {torch.__version__}: "
          f"PyTorch's fake mode {t:.2f} s CPU, remat's {o:.2f} s CPU, {o / t:.2f}x "
          f"(medians of {args.repeats}; {len(ours_rows)} rows equal)")


if __name__ == "__main__":
    main()
