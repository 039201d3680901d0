"""accelerate: ``Accelerator.prepare`` before or after ``remat.apply``, and ``remat.plan`` on
the prepared model (examples/accelerate_train.py, in-process, 2 steps each)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
from types import ModuleType
from typing import Any

import pytest
import torch

from loading import load_example

# Checked without importing: the package loads only in the worker that runs these tests.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                reason="needs accelerate")


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example("accelerate_train.py")


def _run(example: ModuleType, *argv: str) -> dict[str, Any]:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # one Accelerator per run, as in a fresh script
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            result: dict[str, Any] = example.main(list(argv))
    finally:
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(True)
    return {**result, "stdout": out.getvalue()}


@pytest.fixture(scope="module")
def baseline(example: ModuleType) -> dict[str, Any]:
    run = _run(example)
    assert run["applied"] is None and len(run["losses"]) == 2
    return run


def _max_rel_error(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert grads.keys() == ref.keys() and len(ref) > 0
    return max(float((grads[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30))
               for n in ref)


@pytest.mark.parametrize("order", ["apply-first", "prepare-first"])
def test_either_order_keeps_the_strategy_and_the_gradients(example: ModuleType, order: str,
                                                           baseline: dict[str, Any]) -> None:
    run = _run(example, "--strategy", "full", "--order", order)
    assert run["applied"] is not None and run["applied"].strategy == "full"
    assert dict(run["applied"].decisions) == {"blocks.0": "full", "blocks.1": "full"}
    assert _max_rel_error(run["grads"], baseline["grads"]) <= 1e-6
    assert run["losses"] == pytest.approx(baseline["losses"], rel=1e-6, abs=0)
    assert f"remat applied: full ({order})" in run["stdout"]


def test_plan_on_the_prepared_model_fits(example: ModuleType, baseline: dict[str, Any]) -> None:
    run = _run(example, "--budget", "activations:70%")
    plan = run["plan"]
    assert plan is not None and not plan.is_empty and run["applied"].strategy == "plan"
    assert plan.measured_peak_bytes <= plan.budget_bytes < plan.no_checkpoint_peak_bytes
    assert _max_rel_error(run["grads"], baseline["grads"]) <= 1e-6
    assert f"measured peak {plan.measured_peak_bytes:,} B" in run["stdout"]
