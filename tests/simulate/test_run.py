"""simulate(): exact against a real CPU run, fit logic, sharding, JSON."""

from __future__ import annotations

import dataclasses
import json
import warnings
from typing import Any

import pytest
import torch

from allocated_fit import ON_ALLOCATED
from remat.core.cost import StepCost
from remat.devices import DeviceSpec
from remat.errors import StrategyError
from remat.measure import profile
from remat.models import build_model, make_batch
from remat.simulate.precision import make_optimizer
from remat.simulate.run import SimulationResult, SimulationRow, simulate
from remat.strategies import apply

SEQ = 16


def _real_profile(strategy: str, batch_size: int, dtype: torch.dtype,
                  autocast: bool = False):
    torch.manual_seed(0)
    model = build_model("llama-tiny").to(dtype)
    optimizer = make_optimizer("adamw", model.parameters())
    apply(model, strategy)
    batch = make_batch(model, batch_size, SEQ)
    run = model
    if autocast:
        from remat.simulate.sim_setup import Autocast

        run = Autocast(model, torch.bfloat16)
    return profile(run, batch, optimizer=optimizer, timing=False)


@pytest.mark.parametrize(("precision", "dtype", "autocast"), [
    ("fp32", torch.float32, False),
    ("amp-bf16", torch.float32, True),
])
def test_simulated_bytes_equal_a_real_cpu_run(precision: str, dtype: torch.dtype,
                                              autocast: bool) -> None:
    result = simulate("llama-tiny", seq_len=SEQ, batch_sizes=[2], dtype=precision,
                      strategies=["none", "full"], device="l4")
    for strategy in ("none", "full"):
        real = _real_profile(strategy, 2, dtype, autocast)
        row = result.row(strategy, 2)
        assert not real.simulated
        assert row.peak_bytes == row.single_device_peak_bytes == real.peak_bytes
        assert row.activation_bytes == real.activation_bytes
        assert (row.param_bytes, row.grad_bytes, row.optimizer_bytes) == (
            real.param_bytes, real.grad_bytes, real.optimizer_bytes)
        assert row.flops == real.flops and row.recompute_flops == real.recompute_flops
    assert result.row("full", 2).recompute_flops > 0 == result.row("none", 2).recompute_flops


@pytest.fixture(scope="module")
def sgd_probe() -> SimulationResult:
    """``none`` and ``full`` under SGD at batch 1, 2 and 4: the peaks (which do not depend
    on the device) the synthetic devices below are sized from, one simulation for all."""
    return simulate("llama-tiny", seq_len=SEQ, batch_sizes=[1, 2, 4], optimizer="sgd",
                    strategies=["none", "full"], device="l4")


def test_largest_batch_on_a_synthetic_device(sgd_probe: SimulationResult) -> None:
    # A device exactly as large as "none" at batch 2: 1 and 2 fit (<=), 4 does not.
    memory = sgd_probe.row("none", 2).peak_bytes
    tiny = DeviceSpec("tiny-gpu", memory, 1e12, 1e11, 1e11, 1e9)
    result = simulate("llama-tiny", seq_len=SEQ, batch_sizes=[4, 1, 2, 2], optimizer="sgd",
                      strategies=["none", "full"], device=tiny,
                      **ON_ALLOCATED)
    assert result.batch_sizes == (1, 2, 4)
    assert result.device == "tiny-gpu" and result.device_memory_bytes == memory
    peaks = {(r.strategy, r.batch_size): r.peak_bytes for r in result.rows}
    assert peaks[("none", 1)] < peaks[("none", 2)] == memory < peaks[("none", 4)]
    assert [r.fits for r in result.rows_for("none")] == [True, True, False]
    assert result.largest_batch("none") == 2
    expected_full = max(b for b in (1, 2, 4) if peaks[("full", b)] <= memory)
    assert result.largest_batch("full") == expected_full
    assert result.largest_batches == {"none": 2, "full": expected_full}


def _row(strategy: str, batch: int, peak: int, fits: bool, tokens: float) -> SimulationRow:
    cost = StepCost(peak_bytes=peak, step_ms=1.0, flops=0, recompute_ms=0.0)
    return SimulationRow(strategy, batch, 8, cost, fits, tokens / 8, tokens, peak)


def test_largest_batch_and_best_from_rows() -> None:
    rows = (_row("none", 1, 10, True, 100.0), _row("none", 2, 20, False, 180.0),
            _row("full", 1, 5, True, 80.0), _row("full", 2, 8, True, 150.0),
            _row("full", 4, 14, True, 150.0))
    result = SimulationResult("m", 1, 8, "bf16", "adamw", "x", 12, 1, "none", (1, 2, 4),
                              ("none", "full", "sqrt"), rows)
    assert result.largest_batch("none") == 1
    assert result.largest_batch("full") == 4
    assert result.largest_batch("sqrt") is None
    best = result.best()
    assert best is not None and (best.strategy, best.batch_size) == ("full", 2)  # tie: less memory
    with pytest.raises(KeyError, match="no strategy 'ops'"):
        result.rows_for("ops")
    data = json.loads(result.to_json())
    assert data["largest_batch"] == {"none": 1, "full": 4, "sqrt": None}
    assert data["best"]["batch_size"] == 2 and len(data["rows"]) == 5


def test_sharding_rows() -> None:
    kw = dict(seq_len=SEQ, batch_sizes=[2], strategies=["none"], device="l4", dtype="fp32")
    single = simulate("llama-tiny", **kw).row("none", 2)
    ddp = simulate("llama-tiny", world_size=4, sharding="ddp", **kw).row("none", 2)
    fsdp = simulate("llama-tiny", world_size=4, sharding="fsdp", **kw).row("none", 2)
    # DDP: whole states plus flat gradient buckets of every gradient.
    assert ddp.single_device_peak_bytes == single.peak_bytes
    assert ddp.peak_bytes == single.peak_bytes + single.grad_bytes
    # FSDP: states divided by 4 (rounded up), one block and the root gathered.
    assert fsdp.param_bytes == -(-single.param_bytes // 4)
    assert fsdp.optimizer_bytes == -(-single.optimizer_bytes // 4)
    assert fsdp.peak_bytes < single.peak_bytes
    assert fsdp.activation_bytes == single.activation_bytes
    # Throughput counts all ranks.
    assert ddp.samples_per_s == pytest.approx(4 * 2 / (ddp.step_ms / 1e3))


def test_default_strategies_are_read_from_the_registry_at_call_time() -> None:
    from dataclasses import dataclass
    from typing import ClassVar

    import remat.simulate
    from remat.simulate.run import _check_arguments
    from remat.strategies import register_strategy, unregister_strategy
    from remat.strategies.builtin.full import Full, FullHandler
    from remat.strategies.registry import default_strategies

    def defaults() -> list[str]:
        return _check_arguments(SEQ, [1], 1, "none", None, False)[1]

    assert defaults() == default_strategies("simulate")
    assert "offload" not in defaults()  # no separate host memory in a simulation

    @dataclass(frozen=True)
    class Twice(Full):
        name: ClassVar[str] = "twice"

    register_strategy(Twice, FullHandler)
    try:
        assert defaults()[-1] == "twice"
        assert remat.simulate.DEFAULT_STRATEGIES[-1] == "twice"  # kept, read live
    finally:
        unregister_strategy("twice")
    assert "twice" not in defaults()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"(?s)^remat.simulate: world_size=2 needs sharding"
                                         r".*fix: pass sharding='fsdp' or 'ddp'"):
        simulate("llama-tiny", seq_len=SEQ, batch_sizes=[1], world_size=2)
    with pytest.raises(StrategyError, match=r"(?s)^remat.simulate: cannot read strategy "
                                            r"'every:x'.*fix: write every:N"):
        simulate("llama-tiny", seq_len=SEQ, batch_sizes=[1], strategies=["every:x"])
    with pytest.raises(ValueError, match="batch_sizes must be a non-empty list"):
        simulate("llama-tiny", seq_len=SEQ, batch_sizes=[])
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        simulate("llama-tiny", seq_len=SEQ, batch_sizes=[1], dtype="fp8")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        simulate("llama-tiny", seq_len=SEQ, batch_sizes=[1], device="tpu")
    with pytest.raises(ValueError, match="unknown preset 'llama-3'"):
        simulate("llama-3", seq_len=SEQ, batch_sizes=[1])


def test_meta_module_and_factory() -> None:
    with torch.device("meta"):
        model = build_model("gpt-tiny", dropout=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        by_module = simulate(model, seq_len=SEQ, batch_sizes=[1], strategies=["full"],
                             optimizer="none")
        by_factory = simulate(lambda: build_model("gpt-tiny", dropout=0.0), seq_len=SEQ,
                              batch_sizes=[1], strategies=["full"], optimizer="none")
    assert by_module.model == by_factory.model == "GPT"
    assert by_module.rows == by_factory.rows
    assert by_module.rows[0].optimizer_bytes == 0
    assert next(model.parameters()).dtype == torch.bfloat16  # converted in place (documented)


@pytest.fixture(scope="module")
def tight_plan(sgd_probe: SimulationResult) -> tuple[SimulationResult, DeviceSpec, list[int]]:
    """``(result, device, planned sizes)``: ``none`` and the plan under SGD at batch 1 and 4
    on a device halfway between ``full``'s and ``none``'s peak at 4, and the sizes
    ``planned_rows._plan_row`` was called for. One planner run serves the two tests below,
    each asserting its own part."""
    import remat.simulate.planned_rows as planned_module

    low, high = sgd_probe.row("full", 4).peak_bytes, sgd_probe.row("none", 4).peak_bytes
    assert low < high
    tight = DeviceSpec("tight-gpu", (low + high) // 2, 1e12, 1e11, 1e11, 1e9)
    planned_sizes: list[int] = []
    real_row = planned_module._plan_row

    def counted(setup: Any, batch_size: int, *args: Any) -> Any:
        planned_sizes.append(batch_size)
        return real_row(setup, batch_size, *args)

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(planned_module, "_plan_row", counted)
        result = simulate("llama-tiny", seq_len=SEQ, batch_sizes=[1, 4], strategies=["none"],
                          optimizer="sgd", device=tight, plan=True, **ON_ALLOCATED)
    return result, tight, planned_sizes


def test_planner_rows_fit_a_device_no_strategy_fits(
        tight_plan: tuple[SimulationResult, DeviceSpec, list[int]]) -> None:
    result, tight, _ = tight_plan
    assert result.strategies == ("none", "plan")
    assert not result.row("none", 4).fits
    planned = result.row("plan", 4)
    assert planned.fits and planned.peak_bytes <= tight.capacity_bytes
    assert planned.recompute_flops > 0  # the plan had to checkpoint something


def test_plan_row_is_nones_row_where_none_fits(
        tight_plan: tuple[SimulationResult, DeviceSpec, list[int]]) -> None:
    result, _, planned_sizes = tight_plan
    # The device (in `tight_plan`) is one that none fits at batch 1 and not at 4.
    none_1 = result.row("none", 1)
    assert none_1.fits and not result.row("none", 4).fits
    assert result.row("plan", 1) == dataclasses.replace(none_1, strategy="plan")
    assert planned_sizes == [4]  # batch 1 was not planned: nothing beats no recompute
    assert result.row("plan", 4).fits and result.row("plan", 4).recompute_flops > 0


def test_plan_row_from_the_planners_copy_equals_a_fresh_simulation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import remat.planning.loop as loop

    probe = simulate("llama-tiny", seq_len=SEQ, batch_sizes=[4], strategies=["none", "full"],
                     device="l4")
    low, high = probe.row("full", 4).peak_bytes, probe.row("none", 4).peak_bytes
    device = DeviceSpec("tight-gpu", (low + high) // 2, 1e12, 1e11, 1e11, 1e9)
    kwargs: dict[str, Any] = dict(seq_len=SEQ, batch_sizes=[4], strategies=["none"],
                                  device=device, plan=True, **ON_ALLOCATED)
    on_copy = simulate("llama-tiny", **kwargs).row("plan", 4)
    # Without the copy the plan is applied and simulated afresh (fake copy and warm-up).
    monkeypatch.setattr(loop, "measure_on_copy", lambda *args: None)
    fresh = simulate("llama-tiny", **kwargs).row("plan", 4)
    assert on_copy.fits and not on_copy.note and on_copy.recompute_ms > 0  # a real plan
    assert on_copy == fresh


def test_op_level_recompute_costs_time_not_flops() -> None:
    result = simulate("llama-tiny", seq_len=SEQ, batch_sizes=[1], strategies=["none", "ops"],
                      optimizer="none", device="l4")
    none, ops = result.row("none", 1), result.row("ops", 1)
    assert none.recompute_ms == 0.0 and none.recompute_flops == 0
    # "ops" keeps matmul outputs and recomputes the pointwise rest: bandwidth, no FLOPs.
    assert ops.recompute_flops == 0 and 0.0 < ops.recompute_ms < ops.step_ms
    assert ops.step_ms > none.step_ms
