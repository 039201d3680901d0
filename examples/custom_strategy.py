"""A strategy of your own in one file: register it, and remat compares, plans and applies it.

Run it (from the repository root)::

    .venv/bin/python examples/custom_strategy.py

It defines ``halves`` (checkpoint the first half of each block's children, one region each),
registers it, and shows that ``remat compare``'s default rows, the planner's candidates and
``remat.apply`` all know it, with gradients unchanged. docs/extending.md walks through it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

import remat
from remat.strategies import BlockContext, BlockDecision, BlockStrategy, Offer
from remat.strategies.regions import install_checkpoint


@remat.register_strategy
@dataclass(frozen=True)
class CheckpointFirstHalf(BlockStrategy):
    """Checkpoint the first half of each block's children (attention, say), keep the rest."""

    name: ClassVar[str] = "halves"
    summary: ClassVar[str] = "checkpoint the first half of each block's children"

    def install_block(self, block: nn.Module, decision: BlockDecision) -> list[nn.Module]:
        children = [c for c in block.children() if any(p.requires_grad for p in c.parameters())]
        first = children[: max(1, len(children) // 2)]
        for child in first:
            install_checkpoint(child, label=decision.label())
        return first

    def offers(self, context: BlockContext) -> list[Offer]:
        return [Offer((("", BlockDecision(self.name)),))]  # one planner candidate per block


def main() -> None:
    from rich.console import Console

    from remat.compare.runner import compare_preset
    from remat.devices import get_device
    from remat.models import build_model, make_batch
    from remat.planning import prepare
    from remat.planning.candidates import measure_groups
    from remat.planning.context import fake_setup
    from remat.report import comparison_table

    warnings.simplefilter("ignore", remat.RematWarning)  # offload on CPU is a no-op
    print("registered:", ", ".join(remat.STRATEGIES))
    result = compare_preset("gpt-tiny", batch_size=4, repeats=0)  # bytes and FLOPs: exact
    Console(width=110).print(comparison_table(result))

    model = build_model("gpt-tiny")
    batch = make_batch(model, 4)
    setup = fake_setup(model, batch, optimizer=None, blocks=None)
    groups = measure_groups(setup, get_device("h100-80gb"), prune=False)
    print("candidates measured for one block (before dominated ones are dropped):")
    for cand in groups[0].candidates:
        if cand.label() in ("none", "full", "attn", "halves"):
            print(f"  {cand.label():7s} saves {cand.saved_bytes:7d} B, recomputes "
                  f"{cand.recompute_flops:8d} FLOP ({cand.recompute_ms * 1e3:.2f} us on H100)")
    context = prepare(model, batch)
    kept = [c.label() for c in context.peak_model.tables[0]]
    print("kept for the solver:", "halves" in kept and "yes" or "no (another candidate is as "
          "good in every number)")
    plan = remat.plan(model, batch, budget="75%", context=context)
    print("plan at 75%:", plan.label())
    remat.apply(model, "halves")
    print("validate halves:", remat.validate(model, batch, "halves").passed)


if __name__ == "__main__":
    main()
