"""PyTorch Lightning ``Trainer.fit`` with remat's callback (CPU, no downloads, random tokens).

The LightningModule holds one of remat's built-in GPT models as ``self.model``; the
callback applies a strategy to it when training starts, or plans a budget on one
training step (``training_step``, backward, the optimizer) and applies the plan.

Examples::

    python examples/lightning_fit.py --strategy full
    python examples/lightning_fit.py --budget activations:60%
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from remat.integrations.lightning import RematCallback
from remat.models import build_model, make_batch


class LitLM(pl.LightningModule):
    """A causal LM: ``training_step`` returns the model's loss and logs it."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = build_model("gpt-tiny", dropout=0.0)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Tokens(Dataset):  # type: ignore[type-arg]
    def __init__(self, model: torch.nn.Module, size: int, seq_len: int) -> None:
        self.batch = make_batch(model, size, seq_len, seed=1)

    def __len__(self) -> int:
        return len(self.batch["input_ids"])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[index] for key, value in self.batch.items()}


class LossLog(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--strategy", default=None, help="remat strategy (default: full)")
    how.add_argument("--budget", default=None, help="peak budget: 2MiB, 80%%, activations:60%%")
    how.add_argument("--no-remat", action="store_true", help="fit without remat")
    parser.add_argument("--module", default="model",
                        help="the LightningModule's attribute to checkpoint ('' for itself)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> tuple[list[float], RematCallback | None]:
    """Fit; returns the per-step losses and the remat callback (None with --no-remat)."""
    args = parse_args(argv)
    lit = LitLM()
    loader = DataLoader(Tokens(lit.model, 4 * args.batch, args.seq), batch_size=args.batch)
    callback = None if args.no_remat else RematCallback(
        args.strategy if args.budget is None else None, budget=args.budget,
        module=args.module or None)
    log = LossLog()
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[log] + ([callback] if callback else []))
    trainer.fit(lit, loader)
    print("losses: " + ", ".join(f"{loss:.6f}" for loss in log.losses))
    if callback is not None and callback.applied is not None:
        print(f"remat applied {callback.applied.strategy}: "
              + ", ".join(f"{name}={kind}" for name, kind in callback.applied.decisions))
    if callback is not None and callback.plan is not None:
        plan = callback.plan
        print(f"plan: budget {plan.budget_bytes:,} B, measured peak {plan.measured_peak_bytes:,} B"
              f", without checkpointing {plan.no_checkpoint_peak_bytes:,} B")
    return log.losses, callback


if __name__ == "__main__":
    main()
