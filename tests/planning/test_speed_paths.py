"""The planner's shortcuts (#11 goal 2) against their exact paths: one measured block per
kind vs every block measured, the windows step without op records vs with them, shadow
replays on one thread, the window recorder as a tracker listener, garbage collection held."""

from __future__ import annotations

import gc

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.devices import get_device
from remat.measure import shadow
from remat.measure.tracked_step import held_gc
from remat.measure.tracker import MemoryTracker
from remat.measure.windows import WindowRecorder, run_windows
from remat.models import build_model, make_batch
from remat.planning.candidates import BlockGroup, Candidate, measure_groups
from remat.planning.context import fake_setup

from .test_candidates import Pyramid

H100 = get_device("h100-80gb")


def _per_block(groups: list[BlockGroup]) -> dict[str, tuple[Candidate, ...]]:
    return {name: group.candidates for group in groups for name in group.names}


def _groups(model: torch.nn.Module, batch: object, *, share: bool) -> list[BlockGroup]:
    setup = fake_setup(model, batch, optimizer=None, blocks=None)
    return measure_groups(setup, H100, share=share, max_composites=2)  # 2: a fast test


def test_identical_blocks_are_measured_once_with_every_block_s_numbers() -> None:
    torch.manual_seed(0)
    model = build_model("gpt-tiny")
    batch = make_batch(model, 2)
    shared = _groups(model, batch, share=True)
    exact = _groups(model, batch, share=False)
    assert [g.names for g in shared] == [("blocks.0", "blocks.1")]
    assert [g.names for g in exact] == [("blocks.0",), ("blocks.1",)]
    assert len(shared[0].candidates) > 5
    # Candidate equality covers parts, saved / forward / backward bytes, FLOPs, ms, bytes.
    assert _per_block(shared) == _per_block(exact)


def test_blocks_of_different_widths_are_not_shared() -> None:
    torch.manual_seed(0)
    model, x = Pyramid(), torch.randn(64, 16)
    shared = _groups(model, x, share=True)
    exact = _groups(model, x, share=False)
    # Widths 16->16 (raw input without grad, then with), 16->32, 32->32 twice: only the
    # last two blocks share measurements.
    assert [g.names for g in shared] == [("layers.0",), ("layers.1",), ("layers.2",),
                                         ("layers.3", "layers.4")]
    assert len(exact) == 5
    assert _per_block(shared) == _per_block(exact)
    per_block = _per_block(shared)
    assert per_block["layers.1"][0].saved_bytes != per_block["layers.3"][0].saved_bytes


def test_windows_without_op_records_equal_windows_with_them() -> None:
    torch.manual_seed(0)
    model = build_model("gpt-tiny")
    batch = make_batch(model, 2)
    setup = fake_setup(model, batch, optimizer=torch.optim.AdamW(model.parameters()),
                       blocks=None)
    fast = run_windows(setup, loss_fn=None)
    exact = run_windows(setup, loss_fn=None, record_ops=True)
    assert fast.ops == () and len(exact.ops) > 100
    assert dict(fast.peaks) == dict(exact.peaks) and fast.order == exact.order
    assert (fast.peak_bytes, dict(fast.peak_breakdown), dict(fast.static)) == \
        (exact.peak_bytes, dict(exact.peak_breakdown), dict(exact.static))
    # The listener sees every op the tracker counts: the largest window is the step's peak.
    assert max(fast.peaks.values()) == fast.peak_bytes
    assert fast.order[:2] == ("pre", "fwd:0") and fast.order[-1] == "optimizer"


def test_window_recorder_reads_the_tracker_after_every_op() -> None:
    tracker = MemoryTracker(record_ops=False)
    windows = WindowRecorder(tracker)
    windows.open("a")
    with tracker:
        x = torch.ones(256)  # 1 KiB
        windows.open("b")
        y = x * 2  # 1 KiB more
        del x, y
        z = torch.ones(64)
    assert windows.peaks == {"a": 1024, "b": 2048} and windows.starts == {"a": 0, "b": 1024}
    assert z.numel() == 64
    try:
        WindowRecorder(tracker)
    except ValueError as error:
        assert "already has an after_op" in str(error)
    else:
        raise AssertionError("a second recorder on one tracker must be refused")


def test_shadow_replays_run_on_one_thread_and_keep_their_values() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen: list[int] = []
        aten = torch.ops.aten
        real = torch.arange(16).reshape(4, 4)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake = mode.from_tensor(real)
        shadow.remember(fake, real)
        with mode:
            low = aten.tril.default(fake)
            best = aten.max.dim(fake, 1)
        original = aten.tril.default

        def spy(*args: object) -> object:
            seen.append(torch.get_num_threads())
            return original(*args)

        spy._schema = original._schema  # type: ignore[attr-defined]
        spy.tags = original.tags  # type: ignore[attr-defined]
        shadow.propagate(spy, (fake,), {}, low)
        shadow.propagate(aten.max.dim, (fake, 1), {}, best)  # a tuple result
        assert seen == [1] and torch.get_num_threads() == 2
        assert torch.equal(shadow._shadow(low), real.tril())  # type: ignore[arg-type]
        values, indices = best
        assert torch.equal(shadow._shadow(values), real.max(1).values)  # type: ignore[arg-type]
        assert torch.equal(shadow._shadow(indices), real.max(1).indices)  # type: ignore[arg-type]
    finally:
        torch.set_num_threads(threads)


def test_held_gc_restores_the_collector() -> None:
    assert gc.isenabled()
    with held_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with held_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # it was off before: left off
    finally:
        gc.enable()
