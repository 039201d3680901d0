"""The caching allocator model, rule by rule (NOTE [ CUDA caching allocator model ] in
remat/core/caching_allocator.py): each case is worked out from
c10/cuda/CUDACachingAllocator.cpp by hand, then random programs keep the invariants."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.core.allocator_replay import AllocationLog, predict_step_reserved, replay
from remat.core.allocator_settings import AllocatorSettings
from remat.core.caching_allocator import AllocatorOutOfMemory, CachingAllocatorModel
from remat.errors import RematError

MiB = 1 << 20


def model(conf: str = "", capacity_bytes: int | None = None) -> CachingAllocatorModel:
    return CachingAllocatorModel(AllocatorSettings.parse(conf), capacity_bytes)


def parts(m: CachingAllocatorModel) -> list[list[tuple[int, str]]]:
    """Each segment's blocks in MiB (fractions kept), unmapped tails left out."""
    return [[(size / MiB, state) for size, state in seg[3] if state != "unmapped"]
            for seg in m.segments()]


@pytest.mark.parametrize(("request_bytes", "block", "segment", "small"), [
    (1, 512, 2 * MiB, True),                   # kMinBlockSize, a kSmallBuffer segment
    (1000, 1024, 2 * MiB, True),
    (MiB, MiB, 2 * MiB, True),                 # kSmallSize: still the small pool
    (MiB + 1, MiB + 512, 20 * MiB, False),     # large pool: a kLargeBuffer segment
    (9 * MiB, 9 * MiB, 20 * MiB, False),
    (10 * MiB - 1, 10 * MiB, 10 * MiB, False),  # rounds to kMinLargeAlloc: its own segment
    (11 * MiB + 1, 12 * MiB, 12 * MiB, False),  # kRoundLarge; a rest <= 1 MiB stays on it
])
def test_pool_and_segment_of_a_request(request_bytes: int, block: int, segment: int,
                                       small: bool) -> None:
    m = model()
    assert m.malloc("a", request_bytes) == block == m.allocated_bytes
    assert m.reserved_bytes == segment and m.requested_bytes == request_bytes
    [(stream, mapped, is_small, _)] = m.segments()
    assert (stream, mapped, is_small) == (0, segment, small)


def test_splitting_and_best_fit() -> None:
    m = model()
    m.malloc("a", 4 * MiB)  # a 20 MiB segment, split: 16 MiB rest > kSmallSize
    m.malloc("b", 8 * MiB)  # from the rest, split again
    m.free("a")
    assert parts(m) == [[(4, "free"), (8, "allocated"), (8, "free")]]
    # best fit takes the 4 MiB block; its 1 MiB rest is not > kSmallSize, so no split
    assert m.malloc("c", 3 * MiB) == 4 * MiB
    assert parts(m) == [[(4, "allocated"), (8, "allocated"), (8, "free")]]
    assert (m.reserved_bytes, m.allocated_bytes, m.requested_bytes) == (20 * MiB, 12 * MiB,
                                                                         11 * MiB)
    m.malloc("d", 1000)  # the small pool splits any rest >= 512 B
    assert parts(m)[1] == [(1024 / MiB, "allocated"), (2 - 1024 / MiB, "free")]


def test_freed_blocks_merge_and_only_whole_free_segments_are_released() -> None:
    m = model()
    for key in "abc":
        m.malloc(key, 6 * MiB)
    m.free("a")
    m.free("c")
    assert parts(m) == [[(6, "free"), (6, "allocated"), (8, "free")]]
    m.empty_cache()  # the segment is split: nothing goes back
    assert m.reserved_bytes == 20 * MiB and m.cached_free_bytes == 14 * MiB
    m.free("b")
    assert parts(m) == [[(20, "free")]]
    assert m.largest_free_block_bytes == 20 * MiB
    m.empty_cache()
    assert (m.reserved_bytes, m.segment_count, m.segments()) == (0, 0, [])
    assert m.peak_reserved_bytes == 20 * MiB and m.peak_allocated_bytes == 18 * MiB


def test_a_freed_block_is_reused_only_by_its_stream() -> None:
    m = model()
    m.malloc("a", 1000, stream=0)
    m.free("a")
    m.malloc("b", 1000, stream=1)  # a side stream: a segment of its own
    assert m.reserved_bytes == 4 * MiB and m.segment_count == 2
    m.malloc("c", 1000, stream=0)  # the main stream's cached block
    assert m.reserved_bytes == 4 * MiB
    assert sorted(seg[0] for seg in m.segments()) == [0, 1]
    m.free("b")
    m.malloc("d", 1000, stream=0)  # stream 1's free block is not stream 0's
    assert parts(m)[0][:2] == [(1024 / MiB, "allocated"), (1024 / MiB, "allocated")]


def test_oversize_blocks_with_max_split_size() -> None:
    m = model("max_split_size_mb:64")
    m.malloc("big", 100 * MiB)
    m.free("big")
    assert m.malloc("small", 30 * MiB) == 30 * MiB  # below max_split: not from the 100 MiB
    assert m.reserved_bytes == 130 * MiB
    assert m.malloc("near", 90 * MiB) == 100 * MiB  # within kLargeBuffer: whole, unsplit
    m.free("near")
    m.malloc("far", 70 * MiB)  # 100 >= 70 + 20: a new segment
    assert m.reserved_bytes == 200 * MiB
    rounding = model("max_split_size_mb:64,max_non_split_rounding_mb:40")
    rounding.malloc("big", 100 * MiB)
    rounding.free("big")
    assert rounding.malloc("far", 70 * MiB) == 100 * MiB and rounding.reserved_bytes == 100 * MiB
    unlimited = model()  # without max_split_size the big block is split
    unlimited.malloc("big", 100 * MiB)
    unlimited.free("big")
    assert unlimited.malloc("small", 30 * MiB) == 30 * MiB
    assert unlimited.reserved_bytes == 100 * MiB


def test_power_of_two_divisions_round_blocks() -> None:
    m = model("roundup_power2_divisions:[256:1,512:2,>:8]")
    assert m.malloc("a", 600 * MiB + 1) == 768 * MiB  # 512 MiB + 256 MiB steps
    assert m.reserved_bytes == 768 * MiB and m.requested_bytes == 600 * MiB + 1
    assert m.malloc("b", 300 * MiB) == 300 * MiB  # one division: 2 MiB rounding only


def test_expandable_segments_grow_by_pages() -> None:
    m = model("expandable_segments:True")
    assert m.malloc("a", 3 * MiB) == 3 * MiB
    assert m.reserved_bytes == 20 * MiB  # one large_segment_size page
    m.malloc("b", 30 * MiB)  # the free 17 MiB plus one more page, in the same segment
    assert m.reserved_bytes == 40 * MiB and m.segment_count == 1
    assert parts(m) == [[(3, "allocated"), (30, "allocated"), (7, "free")]]
    m.malloc("s", 1000)  # the small pool's segment grows by 2 MiB pages
    assert m.reserved_bytes == 42 * MiB and m.segment_count == 2
    default = model()
    for key, size in (("a", 3 * MiB), ("b", 30 * MiB)):
        default.malloc(key, size)
    assert default.reserved_bytes == 50 * MiB and default.segment_count == 2
    m.free("b")
    m.empty_cache()  # the whole free pages go back: [20, 40) MiB
    assert m.reserved_bytes == 22 * MiB
    assert parts(m)[0] == [(3, "allocated"), (17, "free")]
    m.free("a")
    m.free("s")
    m.empty_cache()
    assert (m.reserved_bytes, m.segment_count) == (0, 0)


def test_expandable_best_fit_spares_the_growing_end() -> None:
    m = model("expandable_segments:True")
    m.malloc("a", 6 * MiB)
    m.malloc("b", 10 * MiB)  # [a 6][b 10][4 free | unmapped ...]
    m.free("a")
    # the 4 MiB block could grow into the unmapped range, so best fit counts it as that
    # large and takes the 6 MiB block (get_free_block's expandable_size)
    m.malloc("c", 3 * MiB)
    assert parts(m) == [[(3, "allocated"), (3, "free"), (10, "allocated"), (4, "free")]]


def test_release_and_retry_when_the_capacity_is_reached() -> None:
    m = model(capacity_bytes=40 * MiB)
    m.malloc("a", 15 * MiB)  # 16 MiB segments
    m.malloc("b", 15 * MiB)
    m.free("a")
    m.malloc("c", 20 * MiB)  # 32 + 20 > 40: the cached 16 MiB segment goes, then it fits
    assert (m.reserved_bytes, m.segment_count, m.alloc_retries) == (36 * MiB, 2, 1)


def test_out_of_memory_reports_torch_s_figures() -> None:
    m = model(capacity_bytes=40 * MiB)
    m.malloc("x", 2 * MiB)  # keeps its 20 MiB segment from going back
    with pytest.raises(AllocatorOutOfMemory) as info:
        m.malloc("y", 30 * MiB)
    oom = info.value.oom
    assert (oom.requested_bytes, oom.allocation_bytes, oom.allocated_bytes, oom.reserved_bytes,
            oom.capacity_bytes) == (30 * MiB, 30 * MiB, 2 * MiB, 20 * MiB, 40 * MiB)
    assert oom.reserved_unallocated_bytes == 18 * MiB and oom.free_bytes == 20 * MiB
    assert isinstance(info.value, RematError) and isinstance(info.value, RuntimeError)
    text = str(info.value)
    assert text.startswith("CachingAllocatorModel.malloc: out of memory")
    assert "18.00 MiB is reserved by PyTorch but unallocated" in text and "fix: " in text
    assert "y" not in m and m.allocated_bytes == 2 * MiB  # the model is still usable
    assert m.malloc("z", 10 * MiB) == 10 * MiB  # fits the 18 MiB free block


def test_release_available_cached_blocks_with_max_split_size() -> None:
    m = model("max_split_size_mb:64", capacity_bytes=200 * MiB)
    m.malloc("a", 100 * MiB)
    m.malloc("b", 80 * MiB)
    m.free("a")
    m.free("b")
    # 30 MiB may not use the cached oversize blocks; a new segment is over the capacity:
    # the smallest oversize block >= max_split_size (80 MiB) goes, nothing else
    m.malloc("c", 30 * MiB)
    assert (m.reserved_bytes, m.alloc_retries, m.largest_free_block_bytes) == (
        130 * MiB, 0, 100 * MiB)
    n = model("max_split_size_mb:64", capacity_bytes=200 * MiB)
    for key, size in (("a", 100 * MiB), ("b", 80 * MiB)):
        n.malloc(key, size)
    n.free("a")
    n.free("b")
    n.malloc("c", 150 * MiB)  # no block is large enough: the largest go until enough
    assert (n.reserved_bytes, n.segment_count, n.alloc_retries) == (150 * MiB, 1, 0)


def test_garbage_collection_releases_the_oldest_cached_segments() -> None:
    def run(conf: str) -> CachingAllocatorModel:
        m = model(conf, capacity_bytes=100 * MiB)
        for key, size in (("a", 30 * MiB), ("b", 40 * MiB)):
            m.malloc(key, size)
            m.free(key)
        m.malloc("c", 44 * MiB)  # 70 reserved + 44 > 100 without collection
        return m

    gc = run("garbage_collection_threshold:0.5,per_process_memory_fraction:1.0")
    # reserved 70 MiB > 0.5 x 100: the blocks at least as old as the average go ("a", age 2
    # get_free_block calls against 1), which brings it under the threshold
    assert (gc.reserved_bytes, gc.largest_free_block_bytes, gc.alloc_retries) == (
        84 * MiB, 40 * MiB, 0)
    for conf in ("", "garbage_collection_threshold:0.5"):  # no fraction set: no collection
        plain = run(conf)
        assert (plain.reserved_bytes, plain.alloc_retries) == (44 * MiB, 1)


def test_a_memory_fraction_limits_reserved_bytes() -> None:
    m = model("per_process_memory_fraction:0.5", capacity_bytes=100 * MiB)
    m.malloc("a", 40 * MiB)
    with pytest.raises(AllocatorOutOfMemory) as info:
        m.malloc("b", 20 * MiB)
    assert info.value.oom.capacity_bytes == 50 * MiB


def test_bad_calls() -> None:
    m = model()
    m.malloc("a", 0)  # no block, as torch's null pointer
    assert "a" in m and m.block_bytes("a") == 0 and m.reserved_bytes == 0
    with pytest.raises(ValueError, match="already allocated"):
        m.malloc("a", 1)
    with pytest.raises(ValueError, match="size_bytes must be >= 0"):
        m.malloc("b", -1)
    m.free("a")
    with pytest.raises(KeyError, match="'a' is not allocated"):
        m.free("a")
    with pytest.raises(ValueError, match="native caching allocator"):
        model("backend:cudaMallocAsync")


# ---- random programs -------------------------------------------------------------------

_SIZES = st.one_of(st.integers(1, 4096), st.integers(4097, 2 * MiB),
                   st.integers(MiB, 24 * MiB), st.integers(24 * MiB, 90 * MiB))
_CONFS = ["", "expandable_segments:True", "max_split_size_mb:32", "roundup_power2_divisions:4",
          "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
          "expandable_segments:True,roundup_power2_divisions:[1:2,>:4]"]


def _check(m: CachingAllocatorModel, live: dict[int, int]) -> None:
    segments = m.segments()
    assert m.reserved_bytes >= m.allocated_bytes >= m.requested_bytes == sum(live.values())
    assert m.allocated_bytes == sum(m.block_bytes(k) for k in live)
    assert m.reserved_bytes == sum(seg[1] for seg in segments)
    assert m.allocated_bytes == sum(size for seg in segments for size, state in seg[3]
                                    if state == "allocated")
    assert m.peak_reserved_bytes >= m.reserved_bytes and m.segment_count == len(segments)
    for seg in segments:  # free neighbours are always merged
        states = [state for _, state in seg[3]]
        assert all(a != b or a == "allocated" for a, b in itertools.pairwise(states))


@settings(max_examples=80, deadline=None)
@given(conf=st.sampled_from(_CONFS),
       capacity=st.sampled_from([None, 64 * MiB, 160 * MiB]),
       program=st.lists(st.tuples(st.booleans(), st.integers(0, 50), _SIZES,
                                  st.integers(0, 1)), max_size=50))
def test_random_programs_keep_the_invariants(
        conf: str, capacity: int | None, program: list[tuple[bool, int, int, int]]) -> None:
    m = model(conf, capacity)
    live: dict[int, int] = {}
    for key, (allocate, pick, size, stream) in enumerate(program):
        if allocate or not live:
            try:
                m.malloc(key, size, stream)
                live[key] = size
            except AllocatorOutOfMemory as error:
                assert capacity is not None
                assert error.oom.reserved_bytes <= error.oom.capacity_bytes
        else:
            gone = sorted(live)[pick % len(live)]
            m.free(gone)
            del live[gone]
        _check(m, live)
        if capacity is not None:
            assert m.reserved_bytes <= capacity
    for key in list(live):
        m.free(key)
    _check(m, {})
    # every block went back to its pool: no segment holds an allocated block
    assert all(state != "allocated" for seg in m.segments() for _, state in seg[3])
    m.empty_cache()
    assert (m.reserved_bytes, m.segment_count, m.allocated_bytes) == (0, 0, 0)


# ---- replay and the step prediction ---------------------------------------------------------

def test_replay_reports_peaks_and_stops_at_out_of_memory() -> None:
    events = [("a", 3 * MiB, 0), ("b", 3 * MiB, 0), ("a", -3 * MiB, 0), ("c", 40 * MiB, 0)]
    r = replay(events)
    assert (r.peak_reserved_bytes, r.peak_allocated_bytes, r.peak_requested_bytes) == (
        60 * MiB, 43 * MiB, 43 * MiB)
    assert r.fits and r.events_replayed == 4 and r.segment_count == 2
    assert r.fragmentation_bytes == 17 * MiB and r.headroom_bytes(64 * MiB) == 4 * MiB
    oom = replay(events, "expandable_segments:True", capacity_bytes=40 * MiB)
    assert not oom.fits and oom.events_replayed == 3 and oom.out_of_memory is not None
    assert oom.out_of_memory.requested_bytes == 40 * MiB
    assert replay(events, "expandable_segments:True").peak_reserved_bytes == 60 * MiB


def test_first_step_creates_the_optimizer_state_late() -> None:
    # params 4 MiB and Adam-like state 8 MiB before the step; the step's activations (12 MiB)
    # are freed before the optimizer phase, which allocates a 1 MiB temporary.
    log = AllocationLog(
        preexisting=((0, 4 * MiB, "params", 0), (1, 8 * MiB, "optimizer_state", 0)),
        events=((2, 12 * MiB, "forward", 0), (2, -12 * MiB, "forward", 0),
                (3, MiB, "optimizer", 0), (3, -MiB, "optimizer", 0)),
        optimizer_start=2)
    p = predict_step_reserved(log)
    # first: one 20 MiB segment holds params and activations, then the state (Rule 2),
    # plus the small pool's 2 MiB; steady: the state is there, so the activations need
    # a 12 MiB segment of their own (Rule 3)
    assert (p.first_step_reserved_bytes, p.steady_reserved_bytes) == (22 * MiB, 34 * MiB)
    assert (p.first_step_allocated_bytes, p.steady_allocated_bytes) == (16 * MiB, 24 * MiB)
    assert p.reserved_bytes == 34 * MiB and p.fragmentation_bytes == 10 * MiB
    assert p.peak_requested_bytes == log.live_peak_bytes == 24 * MiB
    assert p.fits and p.fits_in(34 * MiB) and not p.fits_in(33 * MiB)
    assert p.headroom_bytes(40 * MiB) == 6 * MiB
    early = AllocationLog(log.preexisting, log.events)  # no optimizer phase: state at start
    assert predict_step_reserved(early).first_step_reserved_bytes == 34 * MiB


def test_what_the_first_step_leaves_is_not_created_again() -> None:
    # a first step's log: the optimizer state is created in the step and never freed
    log = AllocationLog(
        preexisting=((0, 4 * MiB, "params", 0),),
        events=((1, 12 * MiB, "forward", 0), (1, -12 * MiB, "forward", 0),
                (2, 8 * MiB, "optimizer", 0)),
        optimizer_start=2)
    p = predict_step_reserved(log)
    assert (p.first_step_reserved_bytes, p.steady_reserved_bytes) == (20 * MiB, 32 * MiB)
    assert p.peak_requested_bytes == 24 * MiB  # the steady step holds the state throughout
    tight = predict_step_reserved(log, capacity_bytes=24 * MiB)
    assert tight.out_of_memory_step == "steady" and tight.steady_reserved_bytes is None
    assert not tight.fits and tight.reserved_bytes == 20 * MiB


def test_allocation_log_checks_itself() -> None:
    with pytest.raises(ValueError, match="optimizer_start is outside the events"):
        AllocationLog(events=((1, 8, "forward", 0),), optimizer_start=2)
    with pytest.raises(ValueError, match="bytes > 0"):
        AllocationLog(preexisting=((1, 0, "params", 0),))
    log = AllocationLog(((0, 10, "params", 0),), ((0, -10, "params", 0), (1, 5, "forward", 0)))
    assert log.as_events() == [(("pre", 0), 10, 0), (("pre", 0), -10, 0), (1, 5, 0)]
    assert replay(log.as_events()).peak_requested_bytes == log.live_peak_bytes == 10
