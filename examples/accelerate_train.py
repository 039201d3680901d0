"""A training loop under Hugging Face accelerate with remat (CPU is fine, no downloads).

``Accelerator.prepare(model, optimizer, dataloader)`` and ``remat.apply`` work in either
order: remat installs its regions on the blocks, and accelerate wraps the model's forward
(autocast, device placement) around them. A budget is planned on the prepared model
with one batch from the prepared dataloader, counting the optimizer's state.

Examples::

    python examples/accelerate_train.py --strategy full --order apply-first
    python examples/accelerate_train.py --budget activations:60%
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset

import remat
from remat.models import build_model, make_batch
from remat.strategies import applied


class Tokens(Dataset):  # type: ignore[type-arg]
    """``size`` random sequences of ``seq_len`` tokens (labels = inputs)."""

    def __init__(self, model: torch.nn.Module, size: int, seq_len: int) -> None:
        self.batch = make_batch(model, size, seq_len, seed=1)

    def __len__(self) -> int:
        return len(self.batch["input_ids"])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[index] for key, value in self.batch.items()}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--strategy", default=None, help="remat strategy, e.g. full, ops")
    how.add_argument("--budget", default=None, help="peak budget: 2MiB, 80%%, activations:60%%")
    parser.add_argument("--order", choices=("apply-first", "prepare-first"),
                        default="prepare-first", help="remat.apply before or after prepare")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train; returns losses, the first step's gradients, what was applied and the plan."""
    args = parse_args(argv)
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0)
    loader = DataLoader(Tokens(model, 4 * args.batch, args.seq), batch_size=args.batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    if args.strategy is not None and args.order == "apply-first":
        remat.apply(model, args.strategy)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    plan = None
    if args.strategy is not None and args.order == "prepare-first":
        remat.apply(model, args.strategy)
    elif args.budget is not None:
        # accelerate's optimizer wraps the torch one, which the planner steps and restores.
        plan = remat.plan(model, next(iter(loader)), budget=args.budget,
                          optimizer=optimizer.optimizer)
        remat.apply(model, plan)
        print(f"plan: budget {plan.budget_bytes:,} B, measured peak "
              f"{plan.measured_peak_bytes:,} B, without checkpointing "
              f"{plan.no_checkpoint_peak_bytes:,} B, {plan.label()}")
    info = applied(accelerator.unwrap_model(model))
    print(f"remat applied: {info.strategy if info else 'nothing'} ({args.order})")
    losses: list[float] = []
    first_grads: dict[str, torch.Tensor] = {}
    for step, batch in enumerate(loader):
        if step == args.steps:
            break
        loss = model(**batch).loss
        accelerator.backward(loss)
        if step == 0:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                           if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        print(f"step {step} | loss {loss.item():.6f}")
    return {"losses": losses, "grads": first_grads, "applied": info, "plan": plan}


if __name__ == "__main__":
    main()
