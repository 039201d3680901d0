"""A real copy standing in for the fake one: the same measurements, and how much faster.

For each model, ``remat.planning.prepare`` runs twice, alternately: on fake tensors only
(``stand_in=False``) and as ``remat.plan`` does (a real copy where NOTE [ A real copy
standing in for the fake one ] in src/remat/planning/context.py finds it cheaper). It checks
that both measured the same (every candidate of every block, the windows, the peak model's
calibration, the built-in strategies' decisions) and that the user's RNG did not move, and
prints the median seconds of each over ``--repeats`` (1 torch thread, after one untimed
pair). Where the two differ, ``--plans`` also plans ``activations:40/60/80%`` from each and
says whether the plans are the same. Exit status 1 on any difference.

Models: seeded random decoders (tests/generated_models.py, ``--seeds``), issue #31's five
6-layer families (benchmarks/planner.py's ``family_model``, batch 4 x 128; ``--families``)
and rows of the README's support table (scripts/support_matrix.py, ``--support t5,led``).

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/stand_in.py                    # seeds 0-23
    PYTHONPATH=src .venv/bin/python benchmarks/stand_in.py --seeds 0-3 --families
    PYTHONPATH=src .venv/bin/python benchmarks/stand_in.py --seeds '' --families --plans
    PYTHONPATH=src .venv/bin/python benchmarks/stand_in.py --seeds '' --support t5,bart,led
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from remat.planning.context import PlanContext, prepare  # noqa: E402


def _models(seeds: list[int], families: bool, support: list[str]
            ) -> list[tuple[str, torch.nn.Module, Any]]:
    from tests.generated_models import generated_model

    found: list[tuple[str, torch.nn.Module, Any]] = []
    for seed in seeds:
        drawn = generated_model(seed)
        found.append((f"{seed}: {drawn.label}", drawn.model, drawn.batch))
    if families:
        from planner import FAMILY_RUNS, family_model, hf_batch

        for name, batch_size in FAMILY_RUNS[:5]:
            found.append((name, family_model(name), hf_batch(batch_size)))
    if support:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "support_matrix", ROOT / "scripts" / "support_matrix.py")
        assert spec is not None and spec.loader is not None
        matrix = importlib.util.module_from_spec(spec)
        sys.modules["support_matrix"] = matrix
        spec.loader.exec_module(matrix)
        for key in support:
            torch.manual_seed(0)
            model, batch = matrix.FAMILIES[key].build()
            found.append((f"support: {key}", model.train(), batch))
    return found


def _same(a: PlanContext, b: PlanContext) -> bool:
    return (a.peak_model == b.peak_model and a.builtin == b.builtin
            and a.no_checkpoint_peak_bytes == b.no_checkpoint_peak_bytes
            and a.static_bytes == b.static_bytes)


def _same_plans(model: torch.nn.Module, batch: Any, a: PlanContext, b: PlanContext) -> str:
    """``same`` or ``differ`` for the plans at activations:40/60/80% from each context."""
    import remat

    for percent in (40, 60, 80):
        budget = f"activations:{percent}%"
        if remat.plan(model, batch, budget=budget, context=a).decisions != \
                remat.plan(model, batch, budget=budget, context=b).decisions:
            return "differ"
    return "same"


def _timed(model: torch.nn.Module, batch: Any, stand_in: bool) -> tuple[float, PlanContext]:
    started = time.perf_counter()
    ctx = prepare(model, batch, stand_in=stand_in)
    return time.perf_counter() - started, ctx


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0-23", help="generated seeds, e.g. 0-23 or 1,5")
    parser.add_argument("--families", action="store_true", help="also issue #31's families")
    parser.add_argument("--support", default="",
                        help="rows of scripts/support_matrix.py, e.g. t5,bart,led")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plans", action="store_true",
                        help="where the measurements differ, compare plans at 40/60/80%%")
    args = parser.parse_args()
    if "-" in args.seeds:
        lo, hi = (int(x) for x in args.seeds.split("-"))
        seeds = list(range(lo, hi + 1))
    else:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    print("| model | copy used | same bytes | RNG kept | fake s | stand-in s | speed-up |"
          + (" plans 40/60/80% |" if args.plans else ""))
    print("|---|---|---|---|---:|---:|---:|" + ("---|" if args.plans else ""))
    failed = 0
    ratios = []
    for label, model, batch in _models(seeds, args.families,
                                         [k for k in args.support.split(",") if k]):
        _timed(model, batch, False)
        _timed(model, batch, True)
        fake_s, real_s = [], []
        same = kept = True
        used = "fake"
        for _ in range(args.repeats):
            seconds, fake = _timed(model, batch, False)
            fake_s.append(seconds)
            state = torch.get_rng_state()
            seconds, real = _timed(model, batch, True)
            real_s.append(seconds)
            kept &= torch.equal(state, torch.get_rng_state())
            same &= _same(fake, real)
            used = "real" if real.setup is not None and real.setup.stand_in else "fake"
        failed += not (same and kept)
        ratio = statistics.median(fake_s) / statistics.median(real_s)
        ratios.append(ratio)
        plans = ""
        if args.plans:
            verdict = "same (bytes equal)" if same else _same_plans(model, batch, fake, real)
            plans = f" {verdict} |"
        print(f"| {label} | {used} | {'yes' if same else 'NO'} | {'yes' if kept else 'NO'} | "
              f"{statistics.median(fake_s):.2f} | {statistics.median(real_s):.2f} | "
              f"{ratio:.1f}x |{plans}", flush=True)
    print(f"\n{len(ratios)} models, median speed-up {statistics.median(ratios):.1f}x, "
          f"differences: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
