"""The "plan" rows of simulate() under FSDP are planned against the per-rank budget.

Regression test: ``remat simulate --hf mistral --seq 4096 --batch 4
--world-size 8 --sharding fsdp`` showed the plan at 91.67 GiB per rank (no) while
``full`` fit at 12.99 GiB. Here on a small Mistral built in-process from its config.
"""

from __future__ import annotations

from typing import Any

import pytest

from allocated_fit import ON_ALLOCATED

pytest.importorskip("transformers")

import remat.simulate.planned_rows as planned_rows
from remat.devices import DeviceSpec
from remat.simulate.hf import hf_config_from_name, hf_model_from_config
from remat.simulate.run import simulate

SEQ, BATCH, WORLD = 64, 4, 8
TINY_MISTRAL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=2048)


def _factory():  # type: ignore[no-untyped-def]
    config = hf_config_from_name("mistral", **TINY_MISTRAL)
    return lambda: hf_model_from_config(config)


def _device(memory: int) -> DeviceSpec:
    return DeviceSpec(f"gpu-{memory}", memory, 1e12, 1e11, 1e11, 1e9)


@pytest.fixture(scope="module")
def peaks() -> tuple[int, int]:
    """Per-rank peaks of full and none (fsdp x8)."""
    probe = simulate(_factory(), seq_len=SEQ, batch_sizes=[BATCH], strategies=["none", "full"],
                     world_size=WORLD, sharding="fsdp", device="l4")
    full, none = probe.row("full", BATCH), probe.row("none", BATCH)
    assert full.fits and none.fits and full.peak_bytes < none.peak_bytes
    return full.peak_bytes, none.peak_bytes


@pytest.mark.parametrize("where", [0.0, 0.5])
def test_fsdp_plan_row_fits_whenever_full_fits(peaks: tuple[int, int], where: float,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Devices from exactly full's per-rank peak to halfway to none's: full fits, none does not.
    full_peak, none_peak = peaks
    device = _device(full_peak + int(where * (none_peak - full_peak)))
    assert device.capacity_bytes < none_peak  # none does not fit (measured in `peaks`)
    simulated: list[str] = []  # each round's plan, as simulated on the rank
    real_simulate_plan = planned_rows._simulate_plan

    def logged(setup: Any, chosen: Any, *args: Any) -> Any:
        simulated.append(chosen.label())
        return real_simulate_plan(setup, chosen, *args)

    monkeypatch.setattr(planned_rows, "_simulate_plan", logged)
    result = simulate(_factory(), seq_len=SEQ, batch_sizes=[BATCH], strategies=["full"],
                      world_size=WORLD, sharding="fsdp", device=device, plan=True,
                      **ON_ALLOCATED)
    assert result.row("full", BATCH).fits
    planned = result.row("plan", BATCH)
    gib = 1024**3
    assert planned.fits, (
        f"plan row {planned.peak_bytes / gib:.6f} GiB per rank does not fit "
        f"{device.capacity_bytes / gib:.6f} GiB while full fits at {full_peak / gib:.6f} GiB")
    assert planned.peak_bytes <= device.capacity_bytes
    assert not planned.note and planned.step_ms > 0
    assert planned.single_device_peak_bytes > planned.peak_bytes  # sharding arithmetic applied
    # A tighter round's budget may choose the plan of the round before (at 0.5 it does):
    # its row is known, not simulated again.
    assert simulated and len(set(simulated)) == len(simulated), simulated


def test_fsdp_no_plan_fits_a_device_smaller_than_full(peaks: tuple[int, int]) -> None:
    full_peak, _ = peaks
    device = _device(full_peak // 2)
    result = simulate(_factory(), seq_len=SEQ, batch_sizes=[BATCH], strategies=["full"],
                      world_size=WORLD, sharding="fsdp", device=device, plan=True,
                      **ON_ALLOCATED)
    planned = result.row("plan", BATCH)
    assert not result.row("full", BATCH).fits and not planned.fits
    assert planned.peak_bytes > device.capacity_bytes
