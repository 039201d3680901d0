"""remat.compare: result objects, and every strategy run on the tiny built-in models."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from remat.compare.runner import (
    ComparisonResult,
    StrategyRow,
    _normalize_strategies,
    compare,
    compare_preset,
)
from remat.errors import StrategyError
from remat.models import build_model, get_config, make_batch
from remat.strategies.registry import default_strategies


def _row(name: str = "none", **overrides: object) -> StrategyRow:
    fields: dict[str, object] = dict(
        strategy=name, peak_bytes=100, activation_bytes=50, param_bytes=10, grad_bytes=10,
        flops=1000, recompute_flops=0, step_ms=1.0, peak_change_pct=0.0,
        activation_change_pct=0.0, recompute_overhead_pct=0.0, step_time_ratio=1.0,
        grad_max_rel_error=0.0, grad_passed=True, worst_param="w",
    )
    fields.update(overrides)
    return StrategyRow.from_dict(fields)


def test_row_validation() -> None:
    with pytest.raises(ValueError, match="StepCost: peak_bytes must be an int >= 0\n  found: -1"):
        _row(peak_bytes=-1)
    with pytest.raises(ValueError,
                       match=r"StepCost: recompute_flops \(2000\) exceeds flops \(1000\)\n"
                             r"  found: 2000"):
        _row(recompute_flops=2000)
    with pytest.raises(ValueError, match="step_ms must be a finite number"):
        _row(step_ms=float("nan"))
    with pytest.raises(ValueError, match="both be set or both be None"):
        _row(grad_passed=None)


def test_result_validation_and_lookup() -> None:
    with pytest.raises(ValueError, match="baseline 'none' is not among the rows"):
        ComparisonResult(rows=(_row("full"),), device="cpu", repeats=1)
    with pytest.raises(ValueError, match="duplicate strategies"):
        ComparisonResult(rows=(_row(), _row()), device="cpu", repeats=1)
    result = ComparisonResult(rows=(_row(), _row("full", recompute_flops=10)), device="cpu",
                              repeats=1, label="x", meta={"model": "gpt-tiny"})
    assert result.strategies == ("none", "full")
    assert result.row("full").recompute_flops == 10
    with pytest.raises(KeyError, match=r"no strategy 'sqrt'; have: \['none', 'full'\]; fix: "):
        result.row("sqrt")
    data = json.loads(result.to_json())
    assert data["version"] == 1 and data["meta"] == {"model": "gpt-tiny"}
    assert data["rows"][1]["recompute_flops"] == 10
    assert ComparisonResult.from_json(result.to_json()) == result
    with pytest.raises(ValueError, match="unsupported version 99"):
        ComparisonResult.from_dict({**data, "version": 99})


def test_normalize_strategies() -> None:
    assert _normalize_strategies(["full", "sqrt"]) == ["none", "full", "sqrt"]
    assert _normalize_strategies("full, none") == ["full", "none"]
    with pytest.raises(ValueError, match="listed twice"):
        _normalize_strategies(["full", "full"])
    with pytest.raises(ValueError, match="must not be empty"):
        _normalize_strategies([])


def test_default_strategies_are_read_from_the_registry_at_call_time() -> None:
    from dataclasses import dataclass
    from typing import ClassVar

    from remat.strategies import register_strategy, unregister_strategy
    from remat.strategies.builtin.full import Full, FullHandler

    assert _normalize_strategies(None) == default_strategies("compare")

    @dataclass(frozen=True)
    class Twice(Full):
        name: ClassVar[str] = "twice"

    register_strategy(Twice, FullHandler)
    try:
        assert _normalize_strategies(None)[-1] == "twice"
    finally:
        unregister_strategy("twice")
    assert "twice" not in _normalize_strategies(None)


def test_compare_every_default_strategy() -> None:
    # gpt-tiny runs every default strategy in tests/cli/test_cli_compare.py.
    preset = "llama-tiny"
    seen: list[tuple[int, int]] = []
    result = compare_preset(preset, 2, device="cpu", repeats=1,
                            progress=lambda _step, done, total: seen.append((done, total)))
    defaults = default_strategies("compare")
    assert list(result.strategies) == defaults
    assert result.meta["seq_len"] == get_config(preset).max_seq_len
    assert seen[-1][0] == seen[-1][1] == len(defaults) * 2 + 1
    none, full = result.row("none"), result.row("full")
    assert none.recompute_flops == 0 and none.recompute_overhead_pct == 0.0
    assert none.step_time_ratio == 1.0 and none.peak_change_pct == 0.0
    assert full.activation_bytes < none.activation_bytes
    assert full.activation_change_pct < 0
    assert full.recompute_flops > 0 and full.recompute_overhead_pct > 0
    assert full.flops == none.flops + full.recompute_flops
    for row in result.rows:
        # Same seed, same weights: identical parameter memory for every strategy.
        assert row.param_bytes == none.param_bytes
        assert row.grad_passed is True, (row.strategy, row.grad_max_rel_error, row.worst_param)
        assert row.grad_max_rel_error is not None and row.grad_max_rel_error <= 1e-6
        assert row.step_ms is not None and row.step_ms > 0


def test_compare_custom_factory_without_timing_or_grads() -> None:
    model = build_model("gpt-tiny", dropout=0.0)
    batch = make_batch(model, 2, 16)
    result = compare(lambda: build_model("gpt-tiny", dropout=0.0), batch, ["every:2"],
                     repeats=0, check_grads=False, label="custom")
    assert result.strategies == ("none", "every:2")
    assert result.repeats == 0 and result.label == "custom"
    every = result.row("every:2")
    assert every.step_ms is None and every.step_time_ratio is None
    assert every.grad_passed is None and every.grad_max_rel_error is None
    assert 0 < every.recompute_flops < result.row("none").flops
    assert dataclasses.asdict(every)["strategy"] == "every:2"


def test_compare_bad_input() -> None:
    with pytest.raises(StrategyError,
                       match=r"(?s)^remat.compare: unknown strategy .*valid strategies:"):
        compare(lambda: build_model("gpt-tiny"), make_batch("gpt-tiny", 1), ["bogus"],
                repeats=0, check_grads=False)
    with pytest.raises(ValueError,
                       match=r"^remat.compare: repeats must be >= 0\n  found: -1\n  fix: "):
        compare(lambda: build_model("gpt-tiny"), make_batch("gpt-tiny", 1), ["full"],
                repeats=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compare_on_cuda() -> None:
    result = compare_preset("gpt-tiny", 2, strategies=["none", "full", "offload"],
                            device="cuda", repeats=1)
    assert result.device.startswith("cuda")
    assert all(row.grad_passed for row in result.rows)
    assert all(row.allocator_peak_bytes is not None for row in result.rows)
