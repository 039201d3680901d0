"""The fast path (NOTE [ Fast rows ]) against the exact path, row by row."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from remat.models import build_model
from remat.simulate.fast_rows import FastContext, fast_rows
from remat.simulate.precision import get_precision
from remat.simulate.run import simulate
from remat.simulate.sim_setup import build_model as resolve_model
from remat.simulate.sim_setup import make_setup

# Every kind whose fast path runs at 8 blocks. every:N for N > 2 and sqrt take the exact
# path there (every:3's cut depths would be 5 and 8; 8 blocks are 3 sqrt segments:
# test_fast_rows_take_the_fast_path_for_repeating_strategies), as does any pattern of
# several blocks under FSDP; their fast rows are compared at 13 blocks below.
KINDS = ["none", "full", "every:2", "attn", "mlp", "ops"]
SEQ = 128
#: The kinds are sampled, not exhaustive: every kind is checked under at least one
#: sharding, and each sharding checks a subset, at three batch sizes: the first two give
#: the fast path's chord, the middle one is interpolated and checked (NOTE [ Fast rows ]).
#: Every exact row is a full fake step, so the lists are kept short; batch 1 peaks at the
#: optimizer's moment and batch 32 in backward (asserted below). every:2 and ops without
#: sharding are compared at five sizes by test_sizes_on_the_chord_and_deeper_depth_pairs_...
CASES = [("none", 1, ["none", "full", "attn"], [1, 5, 32]),
         ("fsdp", 8, ["none", "attn", "ops"], [1, 6, 32]),
         ("ddp", 4, ["every:2", "mlp"], [1, 7, 32])]


def test_the_cases_check_every_kind() -> None:
    assert {kind for _, _, kinds, _ in CASES for kind in kinds} == set(KINDS)
    # without sharding, with the two kinds the chord test compares
    assert {kind for sharding, _, kinds, _ in CASES if sharding == "none"
            for kind in kinds} | {"every:2", "ops"} == set(KINDS) - {"mlp"}


def _factory(n_layer: int = 8) -> Any:
    return lambda: build_model("llama-small", n_layer=n_layer)


def _compare(fast: Any, exact: Any) -> None:
    assert fast.strategies == exact.strategies
    for f, e in zip(fast.rows, exact.rows, strict=True):
        where = f"{f.strategy} at batch {f.batch_size}"
        assert (f.strategy, f.batch_size) == (e.strategy, e.batch_size)
        # Bytes and FLOPs are exact integers on both paths.
        for key in ("peak_bytes", "single_device_peak_bytes", "activation_bytes",
                    "param_bytes", "grad_bytes", "optimizer_bytes", "flops",
                    "recompute_flops"):
            assert getattr(f, key) == getattr(e, key), (
                f"{where}: {key} fast {getattr(f, key)} != exact {getattr(e, key)} "
                f"({getattr(f, key) / max(getattr(e, key), 1) - 1:+.3%})")
        assert f.fits == e.fits, where
        # Times are float sums in another order: equal to rounding.
        for key in ("step_ms", "recompute_ms", "tokens_per_s"):
            assert math.isclose(getattr(f, key), getattr(e, key), rel_tol=1e-9,
                                abs_tol=1e-12), f"{where}: {key}"


@pytest.mark.parametrize(("sharding", "world_size", "kinds", "sizes"), CASES,
                         ids=[case[0] for case in CASES])
def test_fast_rows_equal_exact_rows_for_every_strategy_kind(
        sharding: str, world_size: int, kinds: list[str], sizes: list[int]) -> None:
    kwargs: dict[str, Any] = dict(seq_len=SEQ, batch_sizes=sizes, strategies=kinds,
                                  device="l4", world_size=world_size, sharding=sharding)
    fast = simulate(_factory(), **kwargs)
    exact = simulate(_factory(), exact=True, **kwargs)
    # Both moments occur: the optimizer's at small batches, backward's at large ones.
    assert {r.peak_phase for r in exact.rows} >= {"optimizer", "backward"}
    _compare(fast, exact)


#: One kind per precision: the precision changes the bytes of every tensor alike, while
#: the kinds' fast paths are each compared at bf16 above; every:2 (block-wide regions)
#: and ops (per-op save sets) are the two ways a kind's fast row is built.
PRECISIONS = [("amp-bf16", "every:2"), ("fp32", "ops")]


@pytest.mark.parametrize(("dtype", "kind"), PRECISIONS)
def test_fast_rows_equal_exact_rows_under_other_precisions(dtype: str, kind: str) -> None:
    kwargs: dict[str, Any] = dict(seq_len=64, batch_sizes=[1, 8], dtype=dtype,
                                  strategies=[kind], device="l4")
    _compare(simulate(_factory(7), **kwargs), simulate(_factory(7), exact=True, **kwargs))


def test_fast_rows_take_the_fast_path_for_repeating_strategies() -> None:
    inner, _ = resolve_model(_factory(), SEQ)
    # No optimizer: a row whose peak is the optimizer's moment takes the exact path.
    setup = make_setup(inner, precision=get_precision("bf16"), optimizer="none",
                       device=__import__("remat.devices").devices.get_device("l4"),
                       world_size=1, sharding="none", blocks=None, loss_fn=None,
                       batch_fn=None)
    context = FastContext(setup)
    # every:3 would need 5 and 8 of the 8 blocks; every:2 is cut to 2 and 4 blocks, which
    # peak at different moments at these
    # sizes: both take the exact path (their rows are compared above).
    for kind in ["none", "full", "attn", "mlp"]:
        assert fast_rows(context, kind, [1, 2], SEQ) is not None, kind
    # ops at these sizes falls back to the exact path (its shallow samples peak at another
    # moment since save sets became per-call checked); its rows are compared above.
    # 8 blocks are 3 sqrt segments (3, 3, 2): too few to cut to 1 and 2 full segments.
    assert fast_rows(context, "sqrt", [1, 2], SEQ) is None


def test_short_stacks_take_the_exact_path() -> None:
    kwargs: dict[str, Any] = dict(seq_len=32, batch_sizes=[1, 2], strategies=["none", "full"],
                                  device="l4")
    _compare(simulate(_factory(3), **kwargs), simulate(_factory(3), exact=True, **kwargs))


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_sqrt_and_odd_depths_take_the_fast_path_and_equal_exact(sharding: str) -> None:
    # 13 blocks: sqrt segments of 4, 4, 4 and 1, cut to 5 and 9 blocks; every:2 to 3 and 5,
    # under FSDP to 5 and 7 (sqrt under FSDP, groups of several blocks, is exact on both).
    # Two sizes, the chord's ends: what a size does on the fast path (sampled alone,
    # interpolated) does not depend on the depth and is compared in the tests above.
    kwargs: dict[str, Any] = dict(seq_len=64, batch_sizes=[4, 32],
                                  strategies=["every:2"] if sharding == "fsdp"
                                  else ["sqrt", "every:2"],
                                  device="l4",
                                  world_size=8 if sharding == "fsdp" else 1, sharding=sharding)
    _compare(simulate(_factory(13), **kwargs), simulate(_factory(13), exact=True, **kwargs))


def test_rows_peaking_at_the_optimizers_moment_take_the_fast_path() -> None:
    inner, _ = resolve_model(_factory(), SEQ)
    setup = make_setup(inner, precision=get_precision("bf16"), optimizer="adamw",
                       device=__import__("remat.devices").devices.get_device("l4"),
                       world_size=8, sharding="fsdp", blocks=None, loss_fn=None, batch_fn=None)
    context = FastContext(setup)
    for kind in ["none", "attn"]:
        rows = fast_rows(context, kind, [1], SEQ)
        assert rows is not None and None not in rows, kind
        # The row's moments were extrapolated, the optimizer's included (equal to the
        # exact rows: test_fast_rows_equal_exact_rows_for_every_strategy_kind).
        assert rows[0] is not None and rows[0].peak_phase == "optimizer", kind


def test_a_row_the_fast_path_cannot_give_is_run_exactly_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import remat.simulate.run as run

    calls: list[int] = []

    def second_row_missing(ctx: Any, label: str, sizes: Any, seq_len: int) -> Any:
        rows = fast_rows(ctx, label, sizes, seq_len)
        assert rows is not None and None not in rows
        return [rows[0], None]

    real_points = run.points

    def counted_points(setup: Any, label: str, sizes: list[int], seq_len: int) -> Any:
        calls.extend(sizes)
        return real_points(setup, label, sizes, seq_len)

    kwargs: dict[str, Any] = dict(seq_len=32, batch_sizes=[1, 2], strategies=["full"],
                                  device="l4")
    exact = simulate(_factory(), exact=True, **kwargs)
    calls.clear()
    monkeypatch.setattr(run, "fast_rows", second_row_missing)
    monkeypatch.setattr(run, "points", counted_points)
    _compare(simulate(_factory(), **kwargs), exact)
    assert calls == [2]  # only the missing row took a full fake step


def test_sizes_on_the_chord_and_deeper_depth_pairs_equal_exact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Fast rows ] 2, 4 and 5: batch 1 sampled alone, 3 and 4 interpolated on the
    chord of 2 and 8 where those peak at the same moments, and rows whose first two depths
    peak at different moments sampled deeper; every row equal to the exact one."""
    import remat.simulate.fast_rows as fast_module

    measured: list[tuple[str, int, tuple[int, ...]]] = []
    real_measure = fast_module._measure

    def logged(ctx: Any, label: str, depth: int, sizes: Any, seq_len: int) -> Any:
        measured.append((label, depth, tuple(sizes)))
        return real_measure(ctx, label, depth, sizes, seq_len)

    monkeypatch.setattr(fast_module, "_measure", logged)
    kwargs: dict[str, Any] = dict(seq_len=64, batch_sizes=[1, 2, 3, 4, 8],
                                  strategies=["every:2", "ops"], device="l4")
    fast = simulate(_factory(), **kwargs)
    # At the shallowest depth 2 and 8 peak at the same moments: 3 and 4 lie on their chord
    # (1 is not on it); one step deeper the peak moves between 2 and 8, so 4 is measured
    # there, and 3 too where 2 and 4 peak at different moments.
    for label in ("every:2", "ops"):
        assert (label, 2, (1, 2, 8)) in measured, measured
    assert all(3 not in sizes and 4 not in sizes for _, depth, sizes in measured if depth == 2)
    assert any(sizes == (4,) for _, _, sizes in measured), measured
    # Some row needed a third depth (every:2 steps by 2 from 2 and 4, ops by 1 from 2 and 3).
    deeper = {(label, depth) for label, depth, _ in measured} - {
        ("every:2", 2), ("every:2", 4), ("ops", 2), ("ops", 3)}
    assert deeper, measured
    _compare(fast, simulate(_factory(), exact=True, **kwargs))


def test_end_segments_are_the_peaks_of_each_phases_first_and_last_blocks() -> None:
    from remat.core.cost import Category as C
    from remat.core.timeline import MemoryTimeline
    from remat.simulate.samples import End, end_segments

    timeline = MemoryTimeline(
        (5, 6, 7, 9, 8, 4, 3, 2),
        ("forward", "forward", "forward", "backward", "backward", "backward", "backward",
         "optimizer"),
        ((0, "parameters", None, 2), (0, "batch", None, 3), (1, "activations", "b0", 1),
         (2, "activations", "b0", 1), (3, "gradients", None, 3), (3, "activations", "b0", -1),
         (4, "activations", "b0", -1), (5, "batch", None, -3), (5, "gradients", None, -1),
         (6, "gradients", None, -1), (7, "gradients", None, -1)),
        (None, "b0", "b0", None, "b1", "b0", "b0", None))
    ends = dict(end_segments(timeline, 2, ["b0", "b1"]))
    # forward: [None 5], [b0 6 7]; backward: [None 9], [b1 8], [b0 4 3]; optimizer: none
    start = End(5, 0, {C.PARAMETERS: 2, C.BATCH: 3}, None)
    b0_fwd = End(7, 1, {C.PARAMETERS: 2, C.BATCH: 3, C.ACTIVATIONS: 2}, (0, 1))
    b1_bwd = End(8, 0, {C.PARAMETERS: 2, C.BATCH: 3, C.GRADIENTS: 3}, (1, 0))
    assert ends == {
        ("forward", "first", 0): start, ("forward", "first", 1): b0_fwd,
        ("forward", "last", 0): b0_fwd, ("forward", "last", 1): start,
        ("backward", "first", 0): End(9, 0, {C.PARAMETERS: 2, C.BATCH: 3, C.ACTIVATIONS: 1,
                                             C.GRADIENTS: 3}, None),
        ("backward", "first", 1): b1_bwd, ("backward", "last", 1): b1_bwd,
        ("backward", "last", 0): End(4, 0, {C.PARAMETERS: 2, C.GRADIENTS: 2}, (0, 1))}
    assert end_segments(dataclasses.replace(timeline, blocks=()), 2) == ()


def test_a_depth_pair_whose_other_end_overtakes_deeper_takes_that_ends_moment() -> None:
    # NOTE [ Fast rows ], 7: ops at micro-batch 1 peaks in backward at the loss with 2
    # and 3 blocks, at the end of backward from 4; extrapolating the loss's moment to 8
    # blocks reads low. The end segments see the end of backward overtake, and the row
    # takes that segment's moment, extrapolated; one only bounded is refused.
    from remat.devices import get_device
    from remat.simulate.fast_rows import _level, _measure
    from remat.simulate.point import point
    from remat.simulate.samples import NotAffine, deepen
    from remat.strategies import apply, remove

    inner, _ = resolve_model(_factory(), SEQ)
    setup = make_setup(inner, precision=get_precision("bf16"), optimizer="adamw",
                       device=get_device("l4"), world_size=8, sharding="fsdp",
                       blocks=None, loss_fn=None, batch_fn=None)
    context = FastContext(setup, ["ops"])
    shallow = [_level(context, "ops", depth, [1], SEQ)[1] for depth in (2, 3)]
    assert [s.phase for s in shallow] == ["backward", "backward"]
    apply(setup.model, "ops", blocks=setup.blocks)
    try:
        exact = point(setup, "ops", 1, SEQ)
    finally:
        remove(setup.model)
    # the end segments alone (the FSDP rank segments left out) move the moment
    ends_only = [dataclasses.replace(s, rank_segments=()) for s in shallow]
    moved = deepen(*ends_only, (2, 3), 8)
    blind = deepen(*(dataclasses.replace(s, ends=()) for s in ends_only), (2, 3), 8)
    whole = _measure(context, "ops", 8, [1], SEQ)[1]  # the 8-block step, measured
    assert (moved.peak_bytes, moved.phase) == (whole.peak_bytes, whole.phase)
    assert moved.breakdown == whole.breakdown
    assert blind.peak_bytes < whole.peak_bytes  # what the pair alone claimed
    # the same ends known only as bounds: refused
    bounds = [dataclasses.replace(s, ends=tuple(
        (key, dataclasses.replace(end, offset=-1)) for key, end in s.ends)) for s in ends_only]
    with pytest.raises(NotAffine):
        deepen(*bounds, (2, 3), 8)
    rows = fast_rows(context, "ops", [1], SEQ)
    assert rows is not None and rows[0] is not None
    assert rows[0].peak_bytes == exact.peak_bytes


def test_exact_rows_share_a_warm_up_and_equal_separate_points() -> None:
    """The exact path simulates a strategy's sizes after one warm-up (``points``); each
    row equals a separate :func:`~remat.simulate.point.point`, under FSDP with AdamW
    (the optimizer state a warm-up builds, and the optimizer-moment re-simulation)."""
    from remat.devices import get_device
    from remat.simulate.point import point, points
    from remat.strategies import apply

    inner, _ = resolve_model(lambda: build_model("gpt-tiny", n_layer=2), 16)
    setup = make_setup(inner, precision=get_precision("fp32"), optimizer="adamw",
                       device=get_device("l4"),
                       world_size=4, sharding="fsdp", blocks=None, loss_fn=None,
                       batch_fn=None)
    apply(setup.model, "every:2", blocks=setup.blocks)
    shared = list(points(setup, "every:2", [1, 3], 16))
    alone = [point(setup, "every:2", b, 16) for b in (1, 3)]
    assert [dataclasses.asdict(r) for r in shared] == [dataclasses.asdict(r) for r in alone]


def test_exact_rows_reach_on_row_as_each_step_is_simulated(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``simulate(on_row=...)`` reports each exact row as soon as its step is simulated
    (progress bars move per size), not once all of a strategy's sizes are done."""
    from remat.measure.profile import WarmFake

    steps: list[int] = []
    real = WarmFake.profiles

    def counted(self: Any, batches: Any) -> Any:
        steps.append(len(batches))
        return real(self, batches)

    monkeypatch.setattr(WarmFake, "profiles", counted)
    seen: list[tuple[str, int, int]] = []
    result = simulate(lambda: build_model("gpt-tiny", n_layer=2), seq_len=16,
                      batch_sizes=[1, 2, 3], strategies=["none", "full"], device="l4",
                      exact=True, on_row=lambda r: seen.append((r.strategy, r.batch_size,
                                                               sum(steps))))
    # one tracked step per row, each row reported before the next step runs
    assert seen == [(s, b, i + 1) for i, (s, b) in
                    enumerate((s, b) for s in ("none", "full") for b in (1, 2, 3))]
    assert [(r.strategy, r.batch_size) for r in result.rows] == [(s, b) for s, b, _ in seen]


def test_a_cut_copys_optimizer_state_is_in_its_groups_order() -> None:
    """The state a copy cut short starts with is in its groups' order, as a step creates
    it: the allocation log replays it in that order (reserved bytes), and a set's order
    follows addresses (another each run)."""
    import torch

    from remat.simulate.fast_rows import cut_copy

    model = build_model("gpt-tiny", n_layer=6)
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    blocks = list(model.blocks)
    for depth in (2, 4):
        with cut_copy(model, "", "blocks", blocks, optimizer, depth) as sub:
            order = [p for group in sub.param_groups for p in group["params"]]
            assert [id(p) for p in sub.state] == [id(p) for p in order]
        assert [id(p) for p in optimizer.state] == [id(p) for p in model.parameters()]
