"""What the state a user's job is in changes in remat's figures, on the CPU allocator.

Prints the figures benchmarks/RESULTS.md cites for three states a training job is often in
when it calls remat (tiny models, batch 4, one thread):

* **gradients left by a step**: gpt-tiny planned at 80% with and without the gradients of
  a training step of its own still set (the plan, its measured peak, the gradients' bytes);
* **a batch without labels**: a tiny Hugging Face Llama's profiled peak with and without
  ``labels`` (without, the step trains on the logits' mean: NOTE [ A batch without labels ]);
* **padding**: the same Llama planned at 60% on a batch with an all-ones attention mask,
  and the first step of that plan on the batch and on a padded copy of it; then the plan
  made with the padded copy in ``shapes=`` (NOTE [ A batch without padding ]);
* **a replan in an accumulation loop**: tests/tiny_nets' ``net()`` planned for its shape
  bucket's batch (4 x 64) at 85% of its accumulation micro-step's peak as a plain step
  (what the shape guard's replan of an accumulating plan made before ``Plan.accumulating``)
  and as the micro-step, each plan's micro-step peak against the budget.

    PYTHONPATH=src .venv/bin/python scripts/user_state.py
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / "measure"),
                str(Path(__file__).resolve().parents[1] / "tests")]

import remat  # noqa: E402
from remat.measure.profile import first_step_peak  # noqa: E402
from remat.measure.step import Step, run_step  # noqa: E402
from remat.models import build_model, make_batch  # noqa: E402


def gradients_left() -> None:
    model = build_model("gpt-tiny")
    batch = make_batch(model, 4)
    clean = remat.plan(model, batch, budget="80%")
    run_step(model, batch)  # a step of its own: its gradients stay set
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                if p.grad is not None)
    again = remat.plan(model, batch, budget="80%")
    print(f"gradients left by a step (gpt-tiny, 80%, budget {clean.budget_bytes:,} B): "
          f"gradients {grads:,} B; allocator peak without them {clean.allocator_peak_bytes:,} B, "
          f"with them {again.allocator_peak_bytes:,} B; same plan: "
          f"{again.decisions == clean.decisions}")


def labels_and_padding() -> None:
    import hf_tiny

    model, batch = hf_tiny.build_hf("llama", batch_size=2, seq=32)
    with_labels = remat.profile(model, batch, timing=False).peak_bytes
    without = remat.profile(model, {"input_ids": batch["input_ids"]}, timing=False).peak_bytes
    print(f"a batch without labels (tiny Llama, batch 2, 32 tokens): peak {without:,} B, "
          f"with labels {with_labels:,} B")
    model, batch = hf_tiny.build_hf("llama", batch_size=4, seq=64)
    unpadded = {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}
    padded = {**unpadded, "attention_mask": unpadded["attention_mask"].clone()}
    padded["attention_mask"][2, 30:] = 0

    def first_steps(plan: remat.Plan) -> str:
        work = copy.deepcopy(model)
        remat.apply(work, plan)
        peaks = [first_step_peak(Step(work, b)) for b in (unpadded, padded)]
        return f"first step {peaks[0]:,} B unpadded, {peaks[1]:,} B padded"

    alone = remat.plan(model, unpadded, budget="60%")
    print(f"padding (tiny Llama, batch 4, 64 tokens, 60%: budget {alone.budget_bytes:,} B): "
          f"planned unpadded: {first_steps(alone)}")
    both = remat.plan(model, unpadded, budget=alone.budget_bytes, shapes=[padded])
    print(f"  planned with the padded batch in shapes=: {first_steps(both)}")


def accumulating_replan() -> None:
    from tiny_nets import net

    model, bucket = net(), torch.randn(4, 64, 64, generator=torch.Generator().manual_seed(0))
    held = remat.profile(model, bucket, timing=False, accumulating=True).peak_bytes
    budget = int(0.85 * held)
    print(f"a replan in an accumulation loop (net(), batch 4 x 64, budget {budget:,} B):")
    for accumulating in (False, True):
        plan = remat.plan(model, bucket, budget=budget, accumulating=accumulating)
        remat.apply(model, plan)
        model.zero_grad(set_to_none=True)
        peak = remat.profile(model, bucket, timing=False, accumulating=True).peak_bytes
        remat.remove(model)
        print(f"  planned as {'the micro-step' if accumulating else 'a plain step'}: "
              f"{plan.label()}; micro-step peak {peak:,} B "
              f"({'fits' if peak <= budget else f'over by {peak - budget:,} B'})")


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gradients_left()
        labels_and_padding()
        accumulating_replan()


if __name__ == "__main__":
    main()
