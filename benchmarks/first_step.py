"""The first training step after ``remat.apply`` against later steps, on the CPU allocator.

For each model (tiny Hugging Face configs of several families and seeded random decoders
from tests/generated_models.py) and each manual strategy, the allocator's peak of the
first step of a new job (AdamW, its state created in that step), the first step of a
resumed job (the optimizer state loaded, the strategy applied anew) and the third step,
bytes alive before each step included; then plans at 25/50/75% of the way from ``full``
to ``none``: their budget, the closed loop's allocator peak (NOTE [ The first step ] in
remat/measure/profile.py) and the same steps of a fresh copy. Writes the "The first
step" section of RESULTS.md with ``--write``.

    PYTHONPATH=src .venv/bin/python benchmarks/first_step.py [--write]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "measure"))

from _models import named_and_generated  # noqa: E402
from _results import RESULTS, replace_section, run_header  # noqa: E402

import remat  # noqa: E402
from remat.measure import profile  # noqa: E402
from remat.measure.profile import first_step_peak  # noqa: E402
from remat.measure.step import Step  # noqa: E402
from remat.planning import prepare  # noqa: E402

NAMED = ("llama", "gpt2", "mixtral", "bert", "gpt_neox", "qwen2_moe")
GENERATED = (2000, 2001, 2002, 2003)
STRATEGIES = ("none", "full", "attn", "ops")
FRACTIONS = (0.25, 0.5, 0.75)


def _models() -> list[tuple[str, torch.nn.Module, dict[str, torch.Tensor]]]:
    return named_and_generated(NAMED, GENERATED)


def _steps(pristine: torch.nn.Module, batch: dict, strategy: object) -> list[int]:
    """First step of a new job, first step of a resumed one (the optimizer state loaded,
    the strategy applied anew), and the third step."""
    model = copy.deepcopy(pristine)
    if strategy != "none":
        remat.apply(model, strategy)
    step = Step(model, batch, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    new = first_step_peak(step)
    if strategy != "none":
        remat.apply(model, strategy)
    peaks = [first_step_peak(step) for _ in range(3)]
    return [new, peaks[0], peaks[2]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite RESULTS.md's section")
    args = parser.parse_args()
    started = time.time()
    warnings.simplefilter("ignore")
    manual = ["| model | strategy | first step, new job | first step, resumed job | third step "
              "| resumed - third |",
              "|---|---|---|---|---|---|"]
    plans = ["| model | budget | plan's allocator peak | first step (new or resumed) "
             "| third step | fits |",
             "|---|---|---|---|---|---|"]
    higher = total = over = 0
    for label, pristine, batch in _models():
        peaks = {}
        for strategy in STRATEGIES:
            first, resumed, third = peaks[strategy] = _steps(pristine, batch, strategy)
            total += 1
            higher += max(first, resumed) > third
            manual.append(f"| {label} | {strategy} | {first:,} | {resumed:,} | {third:,} | "
                          f"{resumed - third:+,} |")
        model = copy.deepcopy(pristine)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        none_peak = profile(model, batch, optimizer=opt, timing=False).peak_bytes
        remat.apply(model, "full")
        full_peak = profile(model, batch, optimizer=opt, timing=False).peak_bytes
        remat.remove(model)
        context = prepare(model, batch, optimizer=opt)
        for fraction in FRACTIONS:
            budget = int(full_peak + fraction * (none_peak - full_peak))
            plan = remat.plan(model, batch, optimizer=opt, budget=budget, context=context)
            first, resumed, third = _steps(pristine, batch, plan)
            first = max(first, resumed)
            fits = first <= budget and third <= budget
            over += not fits
            plans.append(f"| {label} | {budget:,} ({fraction:.0%}) | "
                         f"{plan.allocator_peak_bytes:,} | {first:,} | {third:,} | "
                         f"{'yes' if fits else '**no**'} |")
        print(f"{label}: done", file=sys.stderr)
    body = (run_header("The first step", "first_step.py", sys.argv[1:], started)
            + f"Manual strategies: a first step (of a new or a resumed job) peaks above the "
            f"third in {higher} of {total} (model, strategy) pairs (bytes on the CPU "
            "allocator, AdamW, batch 2 x 32 tokens).\n\n" + "\n".join(manual)
            + f"\n\nPlans (25/50/75% of the way from `full` to `none`): {over} of "
            f"{len(plans) - 2} over budget on the first or the third step.\n\n"
            + "\n".join(plans) + "\n")
    print(body)
    if args.write:
        RESULTS.write_text(replace_section(RESULTS.read_text(), "first-step", body))


if __name__ == "__main__":
    main()
