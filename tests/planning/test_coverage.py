"""The planner says so when the blocks found hold little of the activations (NOTE [ Blocks
that miss the activations ] in planning/coverage.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat.errors import RematWarning
from remat.planning import prepare
from remat.planning.coverage import owners_outside


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.conv(x))


class StemNet(nn.Module):
    """Most activations in a wide stem that no container holds, two small blocks after it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.stem_act = nn.ReLU()
        self.down = nn.Conv2d(32, 4, 3, stride=4, padding=1)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.down(self.stem_act(self.stem(x)))
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x.mean((2, 3))), y)


def test_blocks_that_miss_the_activations_are_named() -> None:
    torch.manual_seed(0)
    model = StemNet().train()
    batch = (torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,)))
    with pytest.warns(RematWarning, match="the blocks found hold") as caught:
        prepare(model, batch)
    text = next(str(w.message) for w in caught if "blocks found hold" in str(w.message))
    assert "most of the rest is in: stem_act 64.00 KiB" in text  # 2 x 32 x 16 x 16 floats
    assert "fix:" in text


def test_owners_are_the_outermost_modules_without_blocks() -> None:
    saved = {"enc.conv.0.act": 10, "enc.conv.1.act": 6, "enc.layers.0.fc": 50, "head": 3}
    blocks = ["enc.conv.1", "enc.layers.0"]
    assert owners_outside(saved, blocks, unattributed=1) == [
        ("enc.conv.0", 10), ("head", 3), ("the model's own forward (no submodule)", 1)]
