"""Shared, measured-once set-ups for the planner tests (tiny presets, CPU, float32).

Measuring candidates and manual strategies costs a few seconds per model, so each
preset is prepared once per session and every test plans against the same context.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
import torch
from torch import nn

from remat.compare.frontier import Frontier, frontier
from remat.models import build_model, make_batch
from remat.planning import PlanContext, prepare

BATCH = 2


@dataclass
class Prepared:
    """A tiny model, its batch, its planning context and every manual strategy measured."""

    preset: str
    model: nn.Module
    batch: Any
    context: PlanContext
    manual: Frontier

    @property
    def none_peak(self) -> int:
        return int(self.manual.point("none").peak_bytes)

    @property
    def full_peak(self) -> int:
        return int(self.manual.point("full").peak_bytes)

    def budget_at(self, fraction: float) -> int:
        """``fraction`` of the way from the full-checkpoint peak to the no-checkpoint peak."""
        return int(self.full_peak + fraction * (self.none_peak - self.full_peak))


@cache
def prepared(preset: str, **overrides: Any) -> Prepared:
    torch.manual_seed(0)
    model = build_model(preset, **overrides)
    batch = make_batch(model, BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        context = prepare(model, batch)
        manual = frontier(model, batch, budget_bytes=1)
    return Prepared(preset, model, batch, context, manual)


@pytest.fixture(params=["gpt-tiny", "llama-tiny"])
def tiny(request: pytest.FixtureRequest) -> Prepared:
    return prepared(request.param)


@pytest.fixture
def gpt_tiny() -> Prepared:
    return prepared("gpt-tiny")
