"""Long planning work reports progress: candidates, closed-loop rounds, batch
sizes, manual strategies; nothing is reported (and nothing costs) when nobody listens."""

from __future__ import annotations

from remat.compare.frontier import frontier
from remat.models import build_model, make_batch
from remat.planning import ThroughputSearch, plan, plan_throughput
from remat.progress import report, reporting


def test_plan_reports_each_stage_and_candidate() -> None:
    model = build_model("gpt-tiny")
    events: list[tuple[str, int, int]] = []
    with reporting(lambda step, done, total: events.append((step, done, total))):
        result = plan(model, make_batch(model, 2), budget="90%")
    steps = [step for step, _, _ in events]
    assert "fake copy" in steps and "memory windows of the whole step" in steps
    assert any(s.startswith("blocks.0: ") for s in steps)  # candidates, by block and label
    assert "closed loop, round 1" in steps
    assert all(0 <= done <= total for _, done, total in events)
    with reporting(lambda step, done, total: events.append((step, done, total))):
        frontier(model, make_batch(model, 2), result)
    assert {"none", "full", "every:2"} <= {s for s, _, _ in events}


def test_throughput_search_reports_batch_sizes() -> None:
    model = build_model("gpt-tiny")
    seen: list[str] = []
    with reporting(lambda step, done, total: seen.append(step)):
        plan_throughput(model, lambda n: make_batch(model, n), budget="100%",
                        search=ThroughputSearch(max_batch_size=2))
    assert "batch size 1" in seen and "batch size 2" in seen


def test_report_without_a_listener_is_a_no_op() -> None:
    report("nothing listens", 1, 2)  # must not raise
    inner: list[str] = []
    with reporting(lambda step, done, total: inner.append(step)):
        report("outer", 0, 1)
        with reporting(lambda step, done, total: inner.append("inner:" + step)):
            report("nested", 0, 1)
        report("outer again", 1, 1)
    assert inner == ["outer", "inner:nested", "outer again"]
