"""allocator_peak: exact bytes of known allocation patterns, quiet output."""

from __future__ import annotations

import pytest
import torch

from remat.measure.allocator import AllocatorPeak, _in_order, allocator_peak

MiB = 1 << 20


def test_known_pattern_exact() -> None:
    def step() -> None:
        a = torch.empty(MiB // 4)  # 1 MiB of float32
        del a
        b = torch.empty(MiB // 8)  # 512 KiB
        c = torch.empty(MiB // 8)  # 512 KiB
        del b, c

    peak = allocator_peak(step)
    assert peak.peak_bytes == MiB
    assert peak.end_bytes == 0
    assert peak.device == "cpu"
    assert peak.events == 6


def test_overlapping_allocations_add_up() -> None:
    def step() -> None:
        a = torch.empty(MiB // 4)
        b = torch.empty(MiB // 8)
        del a
        c = torch.empty(MiB // 16)
        del b, c

    assert allocator_peak(step).peak_bytes == MiB + MiB // 2


def test_returned_value_is_freed_and_survivors_are_end_bytes() -> None:
    keep: list[torch.Tensor] = []

    def step() -> torch.Tensor:
        keep.append(torch.empty(MiB // 8))
        return torch.empty(MiB // 4)

    peak = allocator_peak(step)
    assert peak.peak_bytes == MiB + MiB // 2
    assert peak.end_bytes == MiB // 2


def test_preexisting_memory_is_excluded() -> None:
    big = torch.empty(4 * MiB)

    def step() -> None:
        a = torch.empty(MiB // 4)
        del a

    assert allocator_peak(step).peak_bytes == MiB
    del big


def test_training_step_peak_is_positive() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 1))
    x = torch.randn(32, 64)

    def step() -> None:
        model(x).sum().backward()

    peak = allocator_peak(step)
    # at least the gradients (which survive) and the ReLU output saved for backward
    grads = sum(p.numel() * 4 for p in model.parameters())
    assert peak.end_bytes == grads
    assert peak.peak_bytes >= grads + 32 * 256 * 4


def test_no_profiler_noise(capfd: pytest.CaptureFixture[str]) -> None:
    allocator_peak(lambda: torch.empty(16))
    out, err = capfd.readouterr()
    assert "USDT" not in out + err
    assert "profiler_st" not in out + err


def test_other_output_is_kept(capfd: pytest.CaptureFixture[str]) -> None:
    import os

    allocator_peak(lambda: os.write(2, b"user line\n"))
    _, err = capfd.readouterr()
    assert "user line" in err


def test_validation() -> None:
    with pytest.raises(ValueError, match="peak_bytes must be >= 0"):
        AllocatorPeak(peak_bytes=-1, baseline_bytes=0, end_bytes=0, device="cpu")
    with pytest.raises(ValueError, match="end_bytes"):
        AllocatorPeak(peak_bytes=1, baseline_bytes=0, end_bytes=2, device="cpu")
    with pytest.raises(ValueError, match="device must be"):
        allocator_peak(lambda: None, device="meta")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pattern() -> None:
    def step() -> None:
        a = torch.empty(MiB // 4, device="cuda")
        del a
        b = torch.empty(MiB // 8, device="cuda")
        c = torch.empty(MiB // 8, device="cuda")
        del b, c

    assert allocator_peak(step, device="cuda").peak_bytes == MiB


def test_marks_split_phases() -> None:
    from remat.measure.allocator import mark

    def step() -> None:
        a = torch.empty(MiB // 4)  # 1 MiB
        mark("backward")
        b = torch.empty(MiB // 2)  # 2 MiB
        del a, b
        mark("optimizer")
        c = torch.empty(MiB // 8)
        del c

    peak = allocator_peak(step)
    assert peak.mark_bytes == {"backward": MiB, "optimizer": 0}
    assert peak.phase_peak_bytes == {"start": MiB, "backward": 3 * MiB, "optimizer": MiB // 2}
    assert peak.peak_phase == "backward"
    assert peak.peak_bytes == 3 * MiB
    mark("outside")  # no window: nothing happens


def test_equal_timestamps_follow_the_allocators_running_total() -> None:
    # alloc 8 KB, then (same clock tick, tree order reversed) free an older 4 KB block
    # after allocating another 8 KB: the true order is +8192 -> +8192 -> -4096.
    raw = [(10, 4096, 4096, None), (20, 8192, 12288, None),
           (30, -4096, 16384, None), (30, 8192, 20480, None), (40, 0, None, "mark")]
    deltas = [delta for _, delta, *_ in _in_order(raw)]
    assert deltas == [4096, 8192, 8192, -4096, 0]
    running = [sum(deltas[: k + 1]) for k in range(len(deltas))]
    assert max(running) == 20480  # read in tree order, the free first: 16384


def test_first_group_with_equal_timestamps_starts_where_the_chain_starts() -> None:
    raw = [(5, -100, 900, None), (5, 1000, 1000, None)]  # true: +1000 then -100
    assert [d for _, d, *_ in _in_order(raw)] == [1000, -100]


def test_a_block_from_an_earlier_window_freed_in_this_one_does_not_count() -> None:
    # NOTE [ Frees of older blocks ]: a block allocated while an earlier profiler ran has
    # a known size; freed inside this window it must not lower this step's figure.
    leftover = [torch.empty(1 << 10)]  # 4 KiB
    allocator_peak(lambda: leftover.append(torch.empty(1 << 12)))  # sized by a profiler
    old = leftover.pop()  # 16 KiB, allocated in that earlier window

    def step() -> None:
        nonlocal old
        del old  # frees the older block
        a = torch.empty(1 << 12)  # 16 KiB: the step's own high-water mark
        del a

    assert allocator_peak(step).peak_bytes == 1 << 14


def test_a_profiler_of_marks_only_sees_every_event_a_full_one_sees() -> None:
    """NOTE [ What the allocator peak includes ]: observing only ``record_function`` ranges
    leaves the allocator's events as the profiler of every op records them."""
    from torch.profiler import ProfilerActivity, profile

    from remat.measure import allocator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
    x = torch.randn(16, 32)

    def step() -> None:
        loss = model(x).square().mean()
        allocator.mark("backward")
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    allocator._active.append(allocator._cpu_mark)
    try:
        full = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with full:
            step()
        scoped = allocator._cpu_profile(step)
    finally:
        allocator._active.pop()
    full_events = allocator._cpu_events(full.profiler.kineto_results, torch.device("cpu"))
    scoped_events = allocator._cpu_events(scoped, torch.device("cpu"))
    assert len(scoped_events) == len(full_events) > 20
    assert [(d, n) for _, d, n in scoped_events] == [(d, n) for _, d, n in full_events]
    assert "backward" in {n for _, _, n in scoped_events}
