"""The memory timeline: series that sum to the tracker's live bytes, the exact peak, phases."""

from __future__ import annotations

from pathlib import Path

import torch
from typer.testing import CliRunner

import remat
from remat.cli import app
from remat.core.op_record import PHASES
from remat.measure.tracker import MemoryTracker
from remat.models import build_model, make_batch
from remat.report.timeline import timeline_series


def _profile(strategy: str) -> remat.Profile:
    torch.manual_seed(0)
    model = build_model("gpt-tiny")
    remat.apply(model, strategy)
    opt = torch.optim.AdamW(model.parameters())
    return remat.profile(model, make_batch(model, 2), optimizer=opt, timing=False)


def test_series_sum_to_live_bytes_and_peak_is_exact() -> None:
    for strategy in ("none", "full"):
        prof = _profile(strategy)
        timeline = prof.timeline
        assert timeline is not None and len(timeline.live_bytes) >= len(prof.ops)
        series = timeline_series(timeline)
        for i, live in enumerate(timeline.live_bytes):
            assert sum(v[i] for v in series.values()) == live
        assert max(timeline.live_bytes) == prof.peak_bytes
        peak = timeline.peak_index
        by_category: dict[str, int] = {}
        for (category, _block), values in timeline.series().items():
            by_category[category] = by_category.get(category, 0) + values[peak]
        assert {k: v for k, v in by_category.items() if v} == {
            k.value: v for k, v in prof.peak_breakdown.items()}
        assert {k for k in series if k.startswith("activations blocks.")} == {
            "activations blocks.0", "activations blocks.1"}


def test_live_bytes_match_the_tracker_read_after_every_op() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    x = torch.randn(4, 8)
    read: list[int] = []
    tracker = MemoryTracker(after_op=lambda: read.append(tracker.current_bytes))
    tracker.register_model(model)
    tracker.register([x], "batch")
    registered = len(tracker.timeline.live_bytes)  # one sample per register call
    with tracker:
        loss = model(x).sum()
        tracker.set_phase("backward")
        loss.backward()
    live = tracker.timeline.live_bytes
    assert live[registered:] == tuple(read)
    assert max(live) == tracker.peak_bytes


def test_phases_cover_the_samples_in_order() -> None:
    timeline = _profile("full").timeline
    assert timeline is not None
    spans = timeline.phase_spans()
    assert spans[0][1] == 0 and spans[-1][2] == len(timeline.live_bytes)
    assert all(a[2] == b[1] for a, b in zip(spans, spans[1:], strict=False))
    main = [p for p, _, _ in spans if p != "recompute"]
    assert list(dict.fromkeys(main)) == ["forward", "backward", "optimizer"]
    assert "recompute" in {p for p, _, _ in spans} and set(timeline.phases) <= set(PHASES)


def test_cli_writes_a_png(tmp_path: Path) -> None:
    out = tmp_path / "memory.png"
    result = CliRunner().invoke(app, ["profile", "--model", "gpt-tiny", "--batch", "1",
                                      "--repeats", "1", "--timeline", str(out),
                                      "--timeline-with", "full"])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_live_bytes_match_the_tracker_when_the_engine_sums_gradients() -> None:
    # y feeds two ops: its gradient is an engine sum, counted as the real engine does it
    # (NOTE [ Gradient accumulation in place ] in tracker.py); the timeline follows.
    lin = torch.nn.Linear(8, 16)
    x = torch.randn(4, 8)
    read: list[int] = []
    tracker = MemoryTracker(after_op=lambda: read.append(tracker.current_bytes))
    tracker.register_model(lin)
    tracker.register([x], "batch")
    with tracker:
        y = lin(x)
        loss = (y + y.relu()).sum()
        tracker.set_phase("backward")
        loss.backward()
    live = tracker.timeline.live_bytes
    assert live[-len(read):] == tuple(read)
    assert max(live) == tracker.peak_bytes
    series = timeline_series(tracker.timeline)
    for i, value in enumerate(live):
        assert sum(v[i] for v in series.values()) == value
