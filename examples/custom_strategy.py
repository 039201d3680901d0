"""A strategy with a parameter in one file: register it, and remat plans, applies, saves,
loads and validates it, the parameter included.

Run it (from the repository root)::

    .venv/bin/python examples/custom_strategy.py

It defines ``first:K`` (checkpoint the first K trainable children of each block, one region
each): a frozen config (the data a plan stores) and its handler (what it does), registers
them, and shows ``remat compare``'s default rows, the planner's candidates,
``remat.apply``, a plan file and ``remat.validate`` all carrying ``K``. docs/extending.md
walks through it.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

import remat
from remat.errors import StrategyError, message
from remat.strategies import BlockContext, BlockHandler, BlockStrategy, Offer, Strategy
from remat.strategies.base import Purpose
from remat.strategies.regions import install_checkpoint


@dataclass(frozen=True)
class FirstChildren(BlockStrategy):
    """Checkpoint the first ``count`` trainable children of each block, one region each."""

    name: ClassVar[str] = "first"

    count: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(message("FirstChildren", "count must be an int >= 1",
                                     {"found": repr(self.count)}, fix="pass count >= 1"))

    def label(self) -> str:
        return f"{self.name}:{self.count}"  # how it is written, so labels parse back


@remat.register_strategy(FirstChildren)
class FirstChildrenHandler(BlockHandler[FirstChildren]):
    """What ``first:K`` does: install, offer candidates, read and list its spelling."""

    summary: ClassVar[str] = "checkpoint the first K children of each block"
    argument: ClassVar[str | None] = "K"

    def parse(self, argument: str | None) -> FirstChildren:
        if argument is None:
            return FirstChildren()
        if not argument.isdigit() or int(argument) < 1:
            # No API name: parse_strategy puts the caller's (remat.apply, remat.validate...)
            raise StrategyError(message("", f"cannot read strategy 'first:{argument}'",
                                        fix="write first:K with an integer K >= 1"))
        return FirstChildren(int(argument))

    def examples(self, num_blocks: int, purpose: Purpose) -> list[Strategy]:
        return [FirstChildren(1), FirstChildren(2)]  # the rows remat compare shows

    def install_block(self, config: FirstChildren, block: nn.Module) -> list[nn.Module]:
        children = [c for c in block.children() if any(p.requires_grad for p in c.parameters())]
        for child in children[: config.count]:
            install_checkpoint(child, label=config.label())
        return children[: config.count]

    def offers(self, config: FirstChildren, context: BlockContext) -> list[Offer]:
        return [Offer((("", FirstChildren(k)),)) for k in (1, 2, 3)]  # planner candidates


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
        if cand.label() in ("none", "full", "attn=full") or cand.label().startswith("first"):
            print(f"  {cand.label():9s} keeps {cand.saved_bytes:7d} B, recomputes "
                  f"{cand.recompute_flops:8d} FLOP ({cand.recompute_ms * 1e3:.2f} us on H100)")
    context = prepare(model, batch)
    kept = sorted({c.label() for c in context.peak_model.tables[0]
                   if c.label().startswith("first")})
    print("kept for the solver:", ", ".join(kept) or "none of them (another candidate is as "
          "good in every number)")
    plan = remat.plan(model, batch, budget="80%", context=context)
    print("plan at 80%:", plan.label())

    mine = remat.Plan({name: FirstChildren(2) for name in plan.block_names},
                      plan.block_names, plan.budget_bytes,
                      remat.StepCost(peak_bytes=plan.predicted_peak_bytes))
    text = mine.to_json()
    print("in a plan file:", json.dumps(json.loads(text)["decisions"][plan.block_names[0]]))
    loaded = remat.Plan.from_json(text)
    print("loaded back equal:", loaded == mine, "| block 0 gets", repr(loaded.decision(
        plan.block_names[0])))
    remat.apply(model, loaded)
    applied = remat.strategies.applied(model)
    assert applied is not None
    print("applied:", dict(applied.decisions)[plan.block_names[0]],
          "| activations", remat.profile(model, batch, timing=False).activation_bytes, "B")
    report = remat.validate(model, batch, "first:2")
    print("validate first:2:", report.passed, f"(worst relative error {report.max_rel_error:.1e})")


if __name__ == "__main__":
    main()
