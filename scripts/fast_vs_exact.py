"""``remat simulate``'s fast rows against its exact rows, row by row, on any model.

The fast path (NOTE [ Fast rows ] in src/remat/simulate/fast_rows.py) extrapolates shallow fake
steps in depth and batch; ``exact=True`` runs a full fake step per row. This script runs
both for one model, sharding and list of batch sizes, and prints every figure that differs
(peak, one-device peak, activations, FLOPs, recompute FLOPs, the peak's phase) and the
time each path took. Exits 1 if any row differs.

Usage::

    .venv/bin/python scripts/fast_vs_exact.py --model llama-7b --seq 2048
    .venv/bin/python scripts/fast_vs_exact.py --model llama-7b --sharding fsdp --world-size 8 \\
        --strategies none,full,every:2,attn,ops
    .venv/bin/python scripts/fast_vs_exact.py --hf qwen2 --set num_hidden_layers=10 \\
        --set hidden_size=256 --set intermediate_size=704 --set num_attention_heads=8 \\
        --set num_key_value_heads=2 --set vocab_size=4096 --seq 512 --batch 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from typing import Any

from remat.simulate.run import simulate

FIGURES = ("peak_bytes", "single_device_peak_bytes", "activation_bytes", "flops",
           "recompute_flops", "peak_phase")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-7b", help="a built-in preset")
    parser.add_argument("--hf", default=None, help="a Hugging Face family instead of --model")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override of --hf (repeatable)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", default="1,2,4,8,16,32")
    parser.add_argument("--strategies", default="none,full,every:2,sqrt,attn,mlp,ops")
    parser.add_argument("--sharding", default="none", choices=("none", "fsdp", "ddp"))
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--device", default="h100-80gb")
    args = parser.parse_args(argv)
    model: Any = args.model
    if args.hf is not None:
        from remat.cli.options import overrides
        from remat.simulate.hf import hf_model_from_name

        model = functools.partial(hf_model_from_name, args.hf, **overrides(args.set))
    kwargs: dict[str, Any] = dict(
        seq_len=args.seq, batch_sizes=[int(b) for b in args.batch.split(",")],
        strategies=args.strategies.split(","), dtype=args.dtype, device=args.device,
        sharding=args.sharding, world_size=args.world_size)
    started = time.perf_counter()
    fast = simulate(model, **kwargs)
    fast_s = time.perf_counter() - started
    started = time.perf_counter()
    exact = simulate(model, exact=True, **kwargs)
    exact_s = time.perf_counter() - started
    differ = 0
    for f, e in zip(fast.rows, exact.rows, strict=True):
        for key in FIGURES:
            if getattr(f, key) != getattr(e, key):
                differ += 1
                print(f"{f.strategy} batch {f.batch_size}: {key} fast {getattr(f, key)} "
                      f"exact {getattr(e, key)}")
    name = args.hf or args.model
    print(f"{name}, sharding {args.sharding} x {args.world_size}: {len(fast.rows)} rows, "
          f"{differ} figures differ; fast {fast_s:.1f} s, exact {exact_s:.1f} s")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
