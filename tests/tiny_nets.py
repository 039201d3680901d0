"""Small models shared by tests (importable: pyproject puts tests/ on pytest's path)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["D", "Block", "Net", "net"]

D = 64


class Block(nn.Module):
    """A pre-norm residual MLP block (LayerNorm, Linear, GELU, Linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)
        self.norm = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """Two :class:`Block` between an input projection and a head; returns a scalar loss."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(D, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x).square().mean()


def net() -> Net:
    """A :class:`Net` with seed-0 weights."""
    torch.manual_seed(0)
    return Net()
