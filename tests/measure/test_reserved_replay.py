"""The tracker's allocation log, replayed through the caching allocator model: complete (its
unrounded live bytes are the tracker's peak), and what it reserves on real CPU steps and on
a program built to fragment."""

from __future__ import annotations

import pytest
import torch

from loading import load_measure_helper
from remat.core.allocator_replay import AllocationLog, replay
from remat.core.allocator_settings import AllocatorSettings
from remat.measure.reserved import reserved_of_step
from remat.measure.step import Step
from remat.measure.tracked_step import tracked_step
from remat.measure.tracker import MemoryTracker
from tiny_nets import D, net

MiB = 1 << 20
hf_tiny = load_measure_helper("hf_tiny")


def _complete(tracker: MemoryTracker) -> AllocationLog:
    """The log reaches the tracker's peak exactly, however it is replayed."""
    log = tracker.allocations
    assert log.live_peak_bytes == tracker.peak_bytes
    assert replay(log.as_events()).peak_requested_bytes == tracker.peak_bytes
    return log


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_a_training_step_s_log_is_complete(optimizer: str) -> None:
    model = net()
    opt = (torch.optim.Adam(model.parameters()) if optimizer == "adam"
           else torch.optim.SGD(model.parameters(), lr=0.1))
    step = Step(model, torch.randn(4096, D), loss_fn=lambda out, _: out, optimizer=opt)
    for first in (True, False):  # a first step (Adam's state made in it), then a steady one
        tracker = tracked_step(step, step.blocks_found()).tracker
        log = _complete(tracker)
        kinds = [kind for _, _, kind, _ in log.preexisting]
        assert kinds[:8] == ["params"] * 8 and kinds[-1] == "batch"
        assert ("optimizer_state" in kinds) == (optimizer == "adam" and not first)
        assert log.optimizer_start is not None
        assert all(kind != "optimizer" for _, _, kind, _ in log.events[:log.optimizer_start])
        assert {stream for *_, stream in log.events} == {0}
        p = reserved_of_step(tracker)
        # the activations (4096 x 256 floats, 4 MiB) are in the large pool: whole segments
        assert p.reserved_bytes >= p.peak_allocated_bytes >= tracker.peak_bytes
        assert p.reserved_bytes % (2 * MiB) == 0 and p.reserved_bytes >= 20 * MiB
        assert p.peak_requested_bytes == tracker.peak_bytes or first
        if optimizer == "sgd":  # nothing changes between steps: the same segments serve both
            assert p.steady_reserved_bytes == p.first_step_reserved_bytes
            assert p.steady_allocated_bytes == p.first_step_allocated_bytes


def test_a_hugging_face_step_s_log_is_complete() -> None:
    # residual streams summed by the engine in place (NOTE [ Allocation log ], 3.), a
    # storage resized, the loss's float32 upcast: the log still reaches the tracker's peak
    model, batch = hf_tiny.build_hf("llama")
    step = Step(model, batch, optimizer=torch.optim.AdamW(model.parameters()))
    for _ in range(2):
        tracker = tracked_step(step, step.blocks_found()).tracker
        _complete(tracker)
        p = reserved_of_step(tracker, "expandable_segments:True")
        assert p.reserved_bytes >= p.peak_allocated_bytes >= tracker.peak_bytes
        assert p.settings_conf == "expandable_segments:True"


def test_every_kind_of_storage_event_is_logged() -> None:
    w = torch.randn(64, 64)  # made before the step and not registered: found when used
    tracker = MemoryTracker()
    with tracker:
        x = torch.randn(8, 64)
        y = x @ w
        c = torch.empty(0)
        torch.add(y, y, out=c)  # c resized from 0 to 2 KiB: a new allocation
        s = torch.ops.aten._safe_softmax(torch.randn(2, 4, 32, 32), -1)  # modelled scratch
        del x, y, c, s
    log = _complete(tracker)
    assert [(n, kind) for _, n, kind, _ in log.preexisting] == [(64 * 64 * 4, "other")]
    sizes = [n for _, n, _, _ in log.events]
    assert sizes.count(2048) == 3 and 8452 in sizes and -8452 in sizes  # y, out=, scratch
    assert sum(sizes) == 0 and log.optimizer_start is None


def test_the_log_ends_when_the_tracker_is_left() -> None:
    model = torch.nn.Linear(512, 512)
    x = torch.randn(1024, 512)
    tracker = MemoryTracker()
    tracker.register_model(model)
    tracker.register([x], "batch")
    with tracker:
        model(x).sum().backward()
    log = tracker.allocations
    del x  # the batch is freed after the step: not the step's
    assert tracker.allocations == log
    assert [kind for _, _, kind, _ in log.preexisting] == ["params", "params", "batch"]
    p = reserved_of_step(log)  # the steady step still has its batch
    assert p.steady_allocated_bytes is not None and p.steady_allocated_bytes >= 3 * MiB


def _fragmenting_program() -> MemoryTracker:
    tracker = MemoryTracker()
    with tracker:
        a1, a2, a3 = (torch.empty(6 * MiB, dtype=torch.uint8) for _ in range(3))
        del a1, a3  # a 6 MiB hole, and 8 MiB at the segment's end
        b = torch.empty(12 * MiB, dtype=torch.uint8)  # fits neither
        del a2, b
    return tracker


def test_fragmentation_reserves_more_than_is_allocated() -> None:
    tracker = _fragmenting_program()
    assert tracker.peak_bytes == 18 * MiB
    p = reserved_of_step(tracker)
    # three 6 MiB blocks share one 20 MiB segment (kLargeBuffer); freeing the first and the
    # last leaves 6 and 8 MiB free around the middle one, so 12 MiB opens a segment of its
    # own: 32 MiB reserved for 18 allocated
    assert (p.first_step_reserved_bytes, p.peak_allocated_bytes) == (32 * MiB, 18 * MiB)
    assert p.fragmentation_bytes == 14 * MiB
    assert p.steady_reserved_bytes == 32 * MiB and p.segment_count == 2
    # 30 MiB is enough for the bytes, not for the segments: the middle block pins the first
    tight = reserved_of_step(tracker, capacity_bytes=30 * MiB)
    assert tight.out_of_memory_step == "first" and tight.out_of_memory is not None
    oom = tight.out_of_memory
    assert (oom.requested_bytes, oom.allocated_bytes, oom.reserved_bytes) == (
        12 * MiB, 6 * MiB, 20 * MiB)
    assert oom.reserved_unallocated_bytes == 14 * MiB
    # expandable segments grow the one segment by a 20 MiB page from the free 8 MiB at its
    # end: no second segment, but 40 MiB mapped
    expandable = reserved_of_step(tracker, AllocatorSettings(expandable_segments=True))
    assert (expandable.reserved_bytes, expandable.segment_count) == (40 * MiB, 1)


def test_reserved_of_step_takes_a_tracker_or_a_log() -> None:
    tracker = _fragmenting_program()
    assert reserved_of_step(tracker.allocations) == reserved_of_step(tracker)
    with pytest.raises(TypeError, match="MemoryTracker or an AllocationLog"):
        reserved_of_step([])  # type: ignore[arg-type]


@pytest.mark.parametrize("conf", [
    "max_split_size_mb:20", "max_split_size_mb:10", "expandable_segments:true",
    "expandable_segments:True,max_split_size_mb:128", "roundup_power2_divisions:3",
    "roundup_power2_divisions:[64:8,128:2,>:1]", "roundup_power2_divisions:[100:2]",
    "roundup_power2_divisions:[64:3]", "garbage_collection_threshold:1.0",
    "garbage_collection_threshold:0.5", "large_segment_size_mb:10",
    "large_segment_size_mb:64,max_split_size_mb:32", "max_non_split_rounding_mb:30",
])
def test_the_parser_accepts_what_torch_accepts(conf: str) -> None:
    # torch's own parser (c10's AcceleratorAllocatorConfig, in this CPU build too)
    setter = torch._C._accelerator_setAllocatorSettings
    try:
        try:
            setter(conf)
            torch_accepts = True
        except (ValueError, RuntimeError):
            torch_accepts = False
    finally:
        setter("large_segment_size_mb:20,expandable_segments:False")  # torch's defaults
    try:
        AllocatorSettings.parse(conf)
        ours = True
    except ValueError:
        ours = False
    assert ours == torch_accepts
