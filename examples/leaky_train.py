"""A training step that leaks, for ``remat doctor`` (README, "Why it ran out of memory").

``train_step`` keeps each step's logits to score them later, as tensors: every step adds
one (batch, seq, vocab) tensor nothing frees, and the job runs out of memory after enough
steps. From the repository root::

    remat doctor --module examples/my_model.py:build \\
        --train-step examples/leaky_train.py:train_step --batch 2 --seq 64

names the list, how much it grows per step and the fix; ``fixed_train_step`` keeps numbers
instead and is healthy (exit code 0).
"""

from __future__ import annotations

import torch
from my_model import next_token_loss
from torch import Tensor, nn

#: Each step's predictions, kept for an accuracy at the end of the epoch.
predictions: list[Tensor] = []
accuracies: list[float] = []


def train_step(model: nn.Module, batch: dict[str, Tensor],
               optimizer: torch.optim.Optimizer) -> None:
    """One step that keeps its logits alive: the leak."""
    logits = model(batch["input_ids"])  # (B, T, vocab)
    loss = next_token_loss(logits, batch["labels"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    predictions.append(logits)


def fixed_train_step(model: nn.Module, batch: dict[str, Tensor],
                     optimizer: torch.optim.Optimizer) -> None:
    """The same step keeping a number: nothing grows."""
    logits = model(batch["input_ids"])
    loss = next_token_loss(logits, batch["labels"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    accuracies.append((logits.argmax(-1)[:, :-1] == batch["labels"][:, 1:]).float().mean().item())
