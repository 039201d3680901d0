"""Toy models for the measure tests: small enough to account for every byte by hand."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat.recompute import recomputing


class ToyBlock(nn.Module):
    """Linear(d, d, bias=False) then ReLU."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d, bias=False)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class CheckpointedToyBlock(ToyBlock):
    """ToyBlock under non-reentrant checkpoint, marking its recompute pass like remat does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(  # type: ignore[no-any-return]
            super().forward, x, use_reentrant=False,
            context_fn=lambda: (contextlib.nullcontext(), recomputing()),
        )


class Toy(nn.Module):
    """``n`` blocks in an ``nn.ModuleList`` called ``blocks``, input ``(B, d)``."""

    def __init__(self, n: int = 2, d: int = 64, block: type[ToyBlock] = ToyBlock) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


@pytest.fixture
def toy() -> Callable[..., Toy]:
    """Factory: ``toy(n=2, d=64, checkpointed=False)`` with a fixed seed."""

    def make(n: int = 2, d: int = 64, checkpointed: bool = False) -> Toy:
        torch.manual_seed(0)
        return Toy(n, d, CheckpointedToyBlock if checkpointed else ToyBlock)

    return make


@pytest.fixture
def toy_blocks() -> Callable[[Toy], list[tuple[str, nn.Module]]]:
    return lambda model: [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    """Tiny ops on a busy 2-core machine: OpenMP threads spinning against other
    processes make a step 50x slower, and these tests time nothing that needs them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
