"""``simulate(accumulating=True)``: gradient-accumulation micro-steps, gradients held from
the start (the step ``remat.profile(..., accumulating=True)`` measures, equal to the
allocator's: tests/measure/test_accumulating.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from remat.cli import app
from remat.models import build_model
from remat.simulate.run import simulate

KWARGS: dict[str, Any] = dict(seq_len=32, batch_sizes=[1, 8], strategies=["none", "full"],
                              device="l4")


def _factory() -> Any:
    return build_model("llama-tiny", n_layer=4)


@pytest.mark.parametrize(("sharding", "world_size"), [("none", 1), ("ddp", 2)])
def test_rows_are_micro_steps_with_the_gradients_held(sharding: str, world_size: int) -> None:
    kwargs = {**KWARGS, "sharding": sharding, "world_size": world_size}
    plain = simulate(_factory, exact=True, **kwargs)
    exact = simulate(_factory, exact=True, accumulating=True, **kwargs)
    fast = simulate(_factory, accumulating=True, **kwargs)
    assert exact.accumulating and fast.accumulating and not plain.accumulating
    for p, e, f in zip(plain.rows, exact.rows, fast.rows, strict=True):
        where = f"{p.strategy} at {p.batch_size}"
        assert e.peak_bytes == f.peak_bytes, where
        assert (e.flops, e.recompute_flops) == (p.flops, p.recompute_flops), where
        assert e.peak_bytes >= p.peak_bytes, where
    # Without checkpointing at batch 8 the step peaks in backward, every activation still
    # held: the micro-step holds every gradient more at that moment.
    none_8 = plain.row("none", 8)
    assert none_8.peak_phase == "backward"
    assert exact.row("none", 8).peak_bytes - none_8.peak_bytes == none_8.grad_bytes > 0
    # More checkpointing is needed for the same device: some size fits less often.
    assert sum(r.fits for r in exact.rows) <= sum(r.fits for r in plain.rows)


def test_fsdp_and_a_non_bool_are_refused() -> None:
    with pytest.raises(ValueError, match="(?s)remat.simulate.*accumulating=True cannot be "
                                         "simulated with sharding='fsdp'.*sharding='ddp'"):
        simulate(_factory, accumulating=True, sharding="fsdp", world_size=2, **KWARGS)
    with pytest.raises(TypeError, match="accumulating must be True or False"):
        simulate(_factory, accumulating=1, **KWARGS)  # type: ignore[arg-type]


def test_cli_accumulating_json_and_title() -> None:
    runner = CliRunner()
    base = ["simulate", "--model", "llama-tiny", "--seq", "32", "--batch", "8",
            "--strategies", "none", "--device", "l4", "--no-plan"]
    plain = runner.invoke(app, [*base, "--json", "-"])
    held = runner.invoke(app, [*base, "--accumulating", "--json", "-"])
    assert plain.exit_code == 0 and held.exit_code == 0, held.output
    p, h = json.loads(plain.stdout), json.loads(held.stdout)
    assert (p["accumulating"], h["accumulating"]) == (False, True)
    assert h["rows"][0]["peak_bytes"] - p["rows"][0]["peak_bytes"] == p["rows"][0]["grad_bytes"]
    table = runner.invoke(app, [*base, "--accumulating"])
    assert "accumulation micro-steps (gradients held)" in " ".join(table.output.split())
    refused = runner.invoke(app, [*base, "--accumulating", "--tp", "2"])
    assert refused.exit_code != 0 and "--accumulating is simulated on one device" in \
        refused.output


def test_plan_rows_plan_the_micro_step() -> None:
    from allocated_fit import ON_ALLOCATED
    from remat.devices import DeviceSpec

    kwargs: dict[str, Any] = dict(seq_len=32, strategies=["none"], **ON_ALLOCATED)
    probe = simulate(_factory, device="l4", batch_sizes=[4], accumulating=True, **kwargs)
    # one byte short of the micro-step's peak at 4: at 8 the plan must checkpoint
    device = DeviceSpec("gpu-test", probe.row("none", 4).peak_bytes - 1, 1e14, 1e12, 1e12,
                        1e10)
    kwargs = {**kwargs, "device": device, "batch_sizes": [8], "plan": True}
    fast = simulate(_factory, accumulating=True, **kwargs)
    exact = simulate(_factory, accumulating=True, exact=True, **kwargs)
    plain = simulate(_factory, **kwargs)  # its fast row is the exact one: test_plan_fast.py
    f, e, p = fast.row("plan", 8), exact.row("plan", 8), plain.row("plan", 8)
    assert (f.peak_bytes, f.recompute_flops, f.fits) == (e.peak_bytes, e.recompute_flops, True)
    assert e.peak_bytes <= device.capacity_bytes
    # the gradients held leave less room: the plan recomputes more than a plain step's
    assert e.recompute_flops > p.recompute_flops > 0
