"""Plans under gradient accumulation, on the CPU allocator.

A job that steps its optimizer every second micro-batch runs micro-step 2 with micro-step
1's gradients alive. For each model (tiny Hugging Face configs of several families and
seeded random decoders from tests/generated_models.py, AdamW) the budget is half-way
between ``full`` and ``none`` of that micro-step (``remat.profile(...,
accumulating=True)``); the table gives, for the plan made without and with
``accumulating=True``, the allocator's peak of the job's first two accumulation cycles
(two micro-steps each, on a fresh copy with the plan applied and a new AdamW, the bytes
alive before each cycle added), and whether it fits.

    PYTHONPATH=src .venv/bin/python benchmarks/accumulation.py
"""

from __future__ import annotations

import copy
import platform
import warnings

import torch
from _models import named_and_generated

import remat
from accumulation_job import accumulation_peak

NAMED = ("llama", "gpt2", "mixtral", "bert")
GENERATED = (3000, 3001, 3002, 3003)


def cycles_peak(pristine: torch.nn.Module, batch: dict, plan: remat.Plan) -> int:
    """The allocator's peak of the first two accumulation cycles with ``plan`` applied."""
    model = copy.deepcopy(pristine)
    remat.apply(model, plan)
    return accumulation_peak(model, batch, torch.optim.AdamW(model.parameters(), lr=1e-3),
                             cycles=2)


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {platform.machine()}, 1 thread; AdamW; budget half-way "
          "between full and none of an accumulating micro-step\n")
    print("| model | budget | gradients | plain plan: cycle peak | over by | accumulating plan: "
          "cycle peak | fits |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for label, pristine, batch in named_and_generated(NAMED, GENERATED):
        model = copy.deepcopy(pristine)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peaks = []
            for strategy in ("none", "full"):
                remat.apply(model, strategy)
                peaks.append(remat.profile(model, batch, optimizer=opt, timing=False,
                                           accumulating=True).peak_bytes)
            remat.remove(model)
            budget = (peaks[0] + peaks[1]) // 2
            plain = remat.plan(model, batch, optimizer=opt, budget=budget)
            held = remat.plan(model, batch, optimizer=opt, budget=budget, accumulating=True)
            plain_peak, held_peak = cycles_peak(pristine, batch, plain), \
                cycles_peak(pristine, batch, held)
        grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        print(f"| {label} | {budget:,} | {grads:,} | {plain_peak:,} | "
              f"{max(plain_peak - budget, 0):,} | {held_peak:,} | "
              f"{'yes' if held_peak <= budget else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
