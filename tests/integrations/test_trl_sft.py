"""TRL's SFTTrainer with remat's Trainer callback: examples/sft_trl.py, 2 steps each, in-process."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import warnings
from types import ModuleType
from typing import Any

import pytest
import torch

from loading import load_example

# Checked without importing: the packages load only in the worker that runs these tests.
pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("trl", "accelerate")),
    reason="needs trl and accelerate")


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example("sft_trl.py")


def _train(example: ModuleType, *argv: str) -> tuple[list[float], Any, str]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out):
            warnings.simplefilter("ignore")
            losses, callback = example.main(list(argv))
    finally:
        torch.set_num_threads(threads)
    return losses, callback, out.getvalue()


@pytest.fixture(scope="module")
def baseline(example: ModuleType) -> list[float]:
    losses, callback, _ = _train(example, "--no-remat")
    assert callback is None and len(losses) == 2
    return losses


def test_strategy_callback_trains_as_without_checkpointing(example: ModuleType,
                                                          baseline: list[float]) -> None:
    losses, callback, out = _train(example, "--strategy", "full")
    assert callback.applied is not None and callback.applied.strategy == "full"
    assert dict(callback.applied.decisions) == {"model.layers.0": "full",
                                                "model.layers.1": "full"}
    assert losses == pytest.approx(baseline, rel=1e-6, abs=0)
    assert "remat applied full: model.layers.0=full, model.layers.1=full" in out


def test_budget_callback_plans_sfttrainers_own_step(example: ModuleType,
                                                    baseline: list[float]) -> None:
    losses, callback, out = _train(example, "--budget", "95%")
    plan = callback.plan
    assert callback.applied is not None and callback.applied.strategy == "plan"
    assert plan is not None and not plan.is_empty
    assert plan.measured_peak_bytes <= plan.budget_bytes < plan.no_checkpoint_peak_bytes
    assert plan.budget_bytes == int(0.95 * plan.no_checkpoint_peak_bytes)
    # The measured step is SFTTrainer's (fused LM head, 32,768-token chunks: 8 MiB at
    # hidden 64), not the model's plain forward with full logits.
    assert plan.no_checkpoint_peak_bytes > 8 * 2**20
    assert losses == pytest.approx(baseline, rel=1e-6, abs=0)
    assert f"measured peak {plan.measured_peak_bytes:,} B" in out
