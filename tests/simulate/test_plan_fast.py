"""The fast plan rows (NOTE [ Fast plan rows ]) against the exact ones, row by row."""

from __future__ import annotations

import math
from typing import Any

import pytest

import remat.simulate.plan_fast as plan_fast
import remat.simulate.planned_rows as planned
from allocated_fit import ON_ALLOCATED
from remat.devices import DeviceSpec
from remat.measure.windows import StepWindows
from remat.models import build_model
from remat.simulate.plan_windows import deepen_windows, interpolate_windows
from remat.simulate.run import simulate
from remat.simulate.samples import NotAffine

SEQ, SIZES, LAYERS = 32, [1, 4, 8, 16], 5
#: (preset, dtype); gpt-tiny has dropout and tied weights, llama-tiny fp32 norms in bf16.
CASES = [("llama-tiny", "bf16"), ("gpt-tiny", "fp32")]
EXACT_KEYS = ("peak_bytes", "single_device_peak_bytes", "activation_bytes", "param_bytes",
              "grad_bytes", "optimizer_bytes", "flops", "recompute_flops", "fits",
              "peak_phase", "note")


def _factory(preset: str) -> Any:
    return lambda: build_model(preset, n_layer=LAYERS)


def _kwargs(preset: str, dtype: str, full: bool = False, **extra: Any
            ) -> tuple[dict[str, Any], Any]:
    """Simulate's arguments for a device one byte short of ``none``'s peak at batch 4
    (``none`` fits at batch 1 only; the plans at 4, 8 and 16 checkpoint more and more, 8
    between 4 and 16 is interpolated), and the probe: ``none``'s row at 4 (with ``full``,
    ``full``'s at 8 too; their peak and FLOPs do not depend on the sizes simulated with
    them)."""
    kwargs: dict[str, Any] = dict(seq_len=SEQ, batch_sizes=SIZES, dtype=dtype, **extra)
    probe = simulate(_factory(preset), device="l4", **{
        **kwargs, "strategies": ["none", "full"] if full else ["none"],
        "batch_sizes": [4, 8] if full else [4]})
    memory = probe.row("none", 4).peak_bytes - 1
    return {**kwargs, "strategies": ["none"], "plan": True,
            "device": DeviceSpec("gpu-test", memory, 1e14, 1e12, 1e12, 1e10),
            **ON_ALLOCATED}, probe


@pytest.fixture(scope="module", params=CASES, ids=[f"{p}-{d}" for p, d in CASES])
def case(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any], Any, Any]:
    """``(preset, simulate kwargs, none and full rows, exact result)``."""
    preset, dtype = request.param
    kwargs, probe = _kwargs(preset, dtype, full=True)
    return preset, kwargs, probe, simulate(_factory(preset), exact=True, **kwargs)


def _compare_plans(fast: Any, exact: Any) -> None:
    for b in fast.batch_sizes:
        f, e = fast.row("plan", b), exact.row("plan", b)
        for key in EXACT_KEYS:
            assert getattr(f, key) == getattr(e, key), (
                f"plan at batch {b}: {key} fast {getattr(f, key)} != exact {getattr(e, key)}")
        for key in ("step_ms", "recompute_ms", "tokens_per_s"):
            assert math.isclose(getattr(f, key), getattr(e, key), rel_tol=1e-9,
                                abs_tol=1e-12), f"plan at batch {b}: {key}"


def _first_case_only(case: tuple[str, dict[str, Any], Any, Any]) -> tuple[str, dict[str, Any], Any]:
    """``(preset, kwargs, exact)`` of the first case; the others skip (one model is enough)."""
    preset, kwargs, _, exact = case
    if preset != CASES[0][0]:
        pytest.skip("one model is enough")
    return preset, kwargs, exact


def _count_exact_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = planned._plan_row

    def counted(setup: Any, batch_size: int, *args: Any) -> Any:
        calls.append(batch_size)
        return real(setup, batch_size, *args)

    monkeypatch.setattr(planned, "_plan_row", counted)
    return calls


def test_fast_plan_rows_equal_exact_plan_rows(case: tuple[str, dict[str, Any], Any, Any],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    preset, kwargs, probe, exact = case
    calls = _count_exact_rows(monkeypatch)
    mixed: list[int] = []
    failed: list[int] = []
    real_mix = plan_fast.mix_run

    def mix(*args: Any) -> Any:
        mixed.append(args[-1])
        try:
            return real_mix(*args)
        except NotAffine:
            failed.append(args[-1])
            raise

    monkeypatch.setattr(plan_fast, "mix_run", mix)
    fast = simulate(_factory(preset), **kwargs)
    assert calls == []  # every plan row took the fast path
    # batch 8's block runs were interpolated (gpt-tiny measures a run whose backward
    # peaks at another moment at batch 4 than at 16: NOTE [ Fast plan rows ] 1)
    assert set(mixed) == {8} and len(failed) <= (0 if preset == "llama-tiny" else 2)
    _compare_plans(fast, exact)
    # The cases cover a plan that fits and recomputes part of what full does (at 8), and
    # one that recomputes more or fits no more (at 16).
    assert not exact.row("none", 4).fits
    at_8, at_16 = exact.row("plan", 8), exact.row("plan", 16)
    assert at_8.fits and 0 < at_8.recompute_flops < probe.row("full", 8).recompute_flops
    assert at_16.recompute_flops > at_8.recompute_flops or at_16.note


def test_fast_plan_rows_under_ddp_equal_exact() -> None:
    kwargs, _ = _kwargs("llama-tiny", "bf16", world_size=4, sharding="ddp")
    kwargs["batch_sizes"] = [8]
    fast = simulate(_factory("llama-tiny"), **kwargs)
    _compare_plans(fast, simulate(_factory("llama-tiny"), exact=True, **kwargs))
    planned_row = fast.row("plan", 8)
    assert planned_row.peak_bytes > planned_row.single_device_peak_bytes  # DDP's buckets


def test_windows_off_the_pattern_fall_back_to_the_exact_path(
        case: tuple[str, dict[str, Any], Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    preset, kwargs, exact = _first_case_only(case)
    kwargs = {**kwargs, "batch_sizes": [8]}
    calls = _count_exact_rows(monkeypatch)
    failed: list[int] = []

    def off_pattern(steps: Any, n_blocks: int) -> StepWindows:
        failed.append(n_blocks)
        raise NotAffine

    monkeypatch.setattr(plan_fast, "deepen_windows", off_pattern)
    _compare_plans(simulate(_factory(preset), **kwargs), exact)
    assert calls == [8] and failed == [LAYERS]


@pytest.fixture(scope="module")
def measured_alone(case: tuple[str, dict[str, Any], Any, Any]
                   ) -> tuple[Any, Any, list[int], list[list[Any]], list[int]]:
    """``(fast, exact, exact-row sizes, runs measured per rebatch, sizes confirmed)`` of
    one run (the first case only) that both measures batch 8's block runs and windows (no
    interpolation: runs that do not line up) and confirms each size on its own (no
    confirmation at once). The two act on separate stages (candidates and windows; the
    confirmation), so one run serves the two tests below, each asserting its own part;
    the plain run (test_fast_plan_rows_equal_exact_plan_rows) keeps both defaults."""
    preset, kwargs, exact = _first_case_only(case)
    measured: list[list[Any]] = []  # per batch size the candidates were measured at
    confirmed: list[int] = []
    real_run_block, real_rebatch = plan_fast.run_block, plan_fast._rebatch
    real_confirmed = plan_fast._confirmed

    def never(*args: Any) -> Any:
        raise NotAffine

    def counted(*args: Any, **kwargs: Any) -> Any:
        measured[-1].append(tuple(args[4]))
        return real_run_block(*args, **kwargs)

    def rebatched(*args: Any, **kwargs: Any) -> Any:
        measured.append([])
        return real_rebatch(*args, **kwargs)

    def spy(*args: Any) -> set[int]:
        done = real_confirmed(*args)
        confirmed.extend(sorted(done))
        return done

    with pytest.MonkeyPatch.context() as monkeypatch:
        calls = _count_exact_rows(monkeypatch)
        monkeypatch.setattr(plan_fast, "mix_run", never)
        monkeypatch.setattr(plan_fast, "interpolate_windows", never)
        monkeypatch.setattr(plan_fast, "run_block", counted)
        monkeypatch.setattr(plan_fast, "_rebatch", rebatched)
        monkeypatch.setattr(plan_fast, "_confirmed_once", lambda *args: None)
        monkeypatch.setattr(plan_fast, "_confirmed", spy)
        fast = simulate(_factory(preset), **kwargs)
    return fast, exact, calls, measured, confirmed


def test_runs_that_do_not_line_up_are_measured(
        measured_alone: tuple[Any, Any, list[int], list[list[Any]], list[int]]) -> None:
    fast, exact, calls, measured, _ = measured_alone
    _compare_plans(fast, exact)
    assert calls == []  # batch 8 measured on the cut stack, still the fast path
    low, high, between = (runs for runs in measured if runs)  # 4 and 16, then 8
    # 8 measures its own runs (its minimum-cut save sets may differ from the ends')
    assert set(between) >= set(low) & set(high) and len(set(between)) == len(between)


def _windows(peaks: dict[str, int], moments: dict[str, tuple[int, int]] | None = None
             ) -> StepWindows:
    return StepWindows(peaks, tuple(peaks), max(peaks.values()), {}, (), {},
                       moments if moments is not None else dict.fromkeys(peaks, (1, 1)),
                       dict.fromkeys(peaks, "forward"))


def _step(depth: int, off: int = 0) -> StepWindows:
    """A made-up step of ``depth`` blocks whose windows follow NOTE [ Windows from shallow
    steps ] (``off`` bytes added to its head)."""
    peaks = {"pre": 100 + 10 * depth}
    for i in range(depth):
        peaks[f"fwd:{i}"] = 200 + 10 * depth + 3 * i
        peaks[f"gap:{i}"] = 150 + 10 * depth + 3 * i if i < depth - 1 else 500 + 9 * depth + off
    for i in reversed(range(depth)):
        peaks[f"bwd:{i}"] = 300 + 11 * depth - 5 * i
    return _windows({**peaks, "tail": 50 + depth, "optimizer": 70 + 20 * depth})


def test_deepen_windows_extrapolates_each_kind_and_checks_the_third_depth() -> None:
    deep = deepen_windows({d: _step(d) for d in (2, 3, 4)}, 32)
    assert deep.peaks == _step(32).peaks and deep.order == _step(32).order
    with pytest.raises(NotAffine):  # the third depth is off the line
        deepen_windows({2: _step(2), 3: _step(3), 4: _step(4, off=1)}, 32)
    with pytest.raises(NotAffine):  # a window missing from a step's order
        deepen_windows({2: _step(2), 3: _step(3), 4: _windows(
            {k: v for k, v in _step(4).peaks.items() if k != "tail"})}, 32)


def test_interpolate_windows_needs_the_same_peak_moments() -> None:
    lo, hi = _windows({"pre": 10, "fwd:0": 20}), _windows({"pre": 30, "fwd:0": 60})
    assert interpolate_windows(lo, hi, (2, 4), 3).peaks == {"pre": 20, "fwd:0": 40}
    moved = _windows({"pre": 30, "fwd:0": 60}, {"pre": (1, 1), "fwd:0": (2, 1)})
    with pytest.raises(NotAffine):
        interpolate_windows(lo, moved, (2, 4), 3)


def test_autocast_fails_the_confirmation_and_takes_the_exact_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Fast plan rows ] 4: under autocast the peak model is not exact; let the fast
    path try anyway (it does not by default): the confirmation sends the size to the
    exact path."""
    kwargs, _ = _kwargs("llama-tiny", "amp-bf16")
    kwargs["batch_sizes"] = [8]
    exact = simulate(_factory("llama-tiny"), exact=True, **kwargs)
    calls = _count_exact_rows(monkeypatch)
    confirmed: list[set[int]] = []
    real = plan_fast._confirmed

    def spy(*args: Any) -> set[int]:
        confirmed.append(real(*args))
        return confirmed[-1]

    monkeypatch.setattr(plan_fast, "_confirmed", spy)
    monkeypatch.setattr(plan_fast, "_inexact", lambda setup: False)
    _compare_plans(simulate(_factory("llama-tiny"), **kwargs), exact)
    assert confirmed == [set()] and calls == [8]


def test_each_size_is_confirmed_alone_where_the_largest_lacks_a_choice(
        measured_alone: tuple[Any, Any, list[int], list[list[Any]], list[int]]) -> None:
    """NOTE [ Fast plan rows ] 4: the choices are confirmed at once at the largest size,
    or, where it did not measure them all, each size on its own (here: confirmation at
    once declines, in `measured_alone`)."""
    fast, exact, calls, _, confirmed = measured_alone
    _compare_plans(fast, exact)
    assert calls == [] and confirmed == [4, 8, 16]
