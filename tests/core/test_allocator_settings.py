"""AllocatorSettings: PYTORCH_CUDA_ALLOC_CONF parsed as torch 2.13's parseArgs parses it, the
environment read in its order, and the size rules (round_size, get_allocation_size)."""

from __future__ import annotations

import pytest

from remat.core.allocator_settings import AllocatorSettings

MiB = 1 << 20


def test_defaults_are_torch_s() -> None:
    s = AllocatorSettings.parse("")
    assert s == AllocatorSettings()
    assert not s.expandable_segments and s.max_split_size_bytes is None
    assert s.large_segment_size_bytes == 20 * MiB and s.non_split_rounding_bytes == 20 * MiB
    assert s.roundup_power2_divisions == (0,) * 16 and s.garbage_collection_threshold == 0
    assert s.conf == ""


def test_the_keys_the_model_uses() -> None:
    s = AllocatorSettings.parse(
        " expandable_segments : True , max_split_size_mb:128,max_non_split_rounding_mb:40,"
        "garbage_collection_threshold:0.8,per_process_memory_fraction:0.5,"
        "large_segment_size_mb:32")
    assert s.expandable_segments and s.max_split_size_bytes == 128 * MiB
    assert s.max_non_split_rounding_bytes == 40 * MiB
    assert s.garbage_collection_threshold == 0.8 and s.per_process_memory_fraction == 0.5
    assert s.large_segment_size_bytes == 32 * MiB
    assert s.segment_size(3 * MiB) == 32 * MiB  # 1-10 MiB requests open a large segment
    assert AllocatorSettings.parse(s.conf) == s


def test_keys_it_does_not_model_are_checked_and_ignored() -> None:
    conf = ("backend:native,release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:False,"
            "pinned_num_register_threads:8,pinned_use_background_threads:True,"
            "graph_capture_record_stream_reuse:False,throw_on_cudamalloc_oom:True")
    assert AllocatorSettings.parse(conf) == AllocatorSettings()
    assert AllocatorSettings.parse("backend:cudaMallocAsync").backend == "cudaMallocAsync"


def test_roundup_power2_divisions_like_torch_s_own_test() -> None:
    # c10/test/core/AllocatorConfig_test.cpp (allocator_config_test): the same string, the
    # same division per size.
    s = AllocatorSettings.parse(
        "roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]")
    expected = {32: 8, 64: 8, 128: 2, 256: 4, 512: 2, 1024: 4, 2048: 1, 4096: 1}
    assert {mb: s.divisions_for(mb * MiB) for mb in expected} == expected
    assert s.divisions_for(100) == 8  # below 1 MiB: the first interval
    assert AllocatorSettings.parse("roundup_power2_divisions:4").roundup_power2_divisions \
        == (4,) * 16
    tail = AllocatorSettings.parse("roundup_power2_divisions:[>:2]").roundup_power2_divisions
    assert tail == (0,) + (2,) * 15  # '>' first fills from the interval after the first
    assert AllocatorSettings.parse(s.conf) == s


@pytest.mark.parametrize(("conf", "size", "rounded"), [
    ("", 1, 512),                                        # kMinBlockSize
    ("", 513, 1024),
    ("", 5 * MiB + 1, 5 * MiB + 512),
    ("roundup_power2_divisions:4", 1200, 1536),          # not above 512 x 4: 512 steps
    ("roundup_power2_divisions:4", 5000, 5120),          # 4096 + 1024
    ("roundup_power2_divisions:4", 9 * MiB, 10 * MiB),   # 8 MiB + 2 MiB steps
    ("roundup_power2_divisions:4", 8 * MiB, 8 * MiB),    # a power of two stays
    ("roundup_power2_divisions:[256:1,512:2,>:8]", 600 * MiB, 768 * MiB),
    ("roundup_power2_divisions:[256:1,512:2,>:8]", 300 * MiB, 300 * MiB),
])
def test_round_size(conf: str, size: int, rounded: int) -> None:
    assert AllocatorSettings.parse(conf).round_size(size) == rounded


@pytest.mark.parametrize(("block", "segment"), [
    (512, 2 * MiB), (MiB, 2 * MiB), (MiB + 512, 20 * MiB), (10 * MiB - 512, 20 * MiB),
    (10 * MiB, 10 * MiB), (11 * MiB, 12 * MiB), (100 * MiB + 512, 102 * MiB),
])
def test_segment_size(block: int, segment: int) -> None:
    assert AllocatorSettings().segment_size(block) == segment


@pytest.mark.parametrize(("conf", "what"), [
    ("expandable_segment:True", "unrecognized key 'expandable_segment'"),
    ("expandable_segments:true", "must be True or False"),
    ("expandable_segments", "expected ':'"),
    ("expandable_segments:", "expected a value"),
    ("expandable_segments:True;max_split_size_mb:128", "must be True or False"),
    ("max_split_size_mb:10", "too small, must be >= 20"),
    ("large_segment_size_mb:64,max_split_size_mb:32", "too small, must be >= 64"),
    ("max_non_split_rounding_mb:5", "too small"),
    ("large_segment_size_mb:10", "must be > 10"),
    ("max_split_size_mb:-1", "non-negative integer"),
    ("max_split_size_mb:12.5", "non-negative integer"),
    ("garbage_collection_threshold:1.0", "in (0.0, 1.0)"),
    ("garbage_collection_threshold:abc", "must be a number"),
    ("per_process_memory_fraction:1.5", "in [0, 1]"),
    ("roundup_power2_divisions:3", "power of 2"),
    ("roundup_power2_divisions:0", "power of 2"),
    ("roundup_power2_divisions:[64:3]", "powers of 2 or 0"),
    ("roundup_power2_divisions:[100:2]", "intervals must be powers of 2"),
    ("roundup_power2_divisions:[64:2", "missing its ']'"),
    ("backend:tcmalloc", "unknown allocator backend"),
    ("max_split_size_mb:128 expandable_segments:True", "non-negative integer"),
])
def test_bad_settings_say_what_and_how_to_fix(conf: str, what: str) -> None:
    with pytest.raises(ValueError) as info:
        AllocatorSettings.parse(conf)
    text = str(info.value)
    assert text.startswith("AllocatorSettings.parse: ") and what in text, text
    assert repr(conf) in text and "\n  fix: " in text


def test_settings_built_directly_are_checked() -> None:
    with pytest.raises(ValueError, match=r"^AllocatorSettings: max_split_size_bytes must be"):
        AllocatorSettings(max_split_size_bytes=MiB)
    with pytest.raises(ValueError, match="roundup_power2_divisions must be 16"):
        AllocatorSettings(roundup_power2_divisions=(4,))
    with pytest.raises(ValueError, match="garbage_collection_threshold"):
        AllocatorSettings(garbage_collection_threshold=1.0)
    with pytest.raises(TypeError, match="conf must be a string"):
        AllocatorSettings.parse(None)  # type: ignore[arg-type]


def test_from_env_reads_the_first_variable_set_as_torch_does() -> None:
    # AcceleratorAllocatorConfig::instance(): PYTORCH_CUDA_ALLOC_CONF, then
    # PYTORCH_HIP_ALLOC_CONF, then PYTORCH_ALLOC_CONF; only the first one set is parsed.
    both = {"PYTORCH_ALLOC_CONF": "expandable_segments:True",
            "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}
    s = AllocatorSettings.from_env(both)
    assert s.max_split_size_bytes == 64 * MiB and not s.expandable_segments
    assert AllocatorSettings.from_env({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}) \
        .expandable_segments
    assert AllocatorSettings.from_env({"PYTORCH_HIP_ALLOC_CONF": "max_split_size_mb:32",
                                       "PYTORCH_ALLOC_CONF": "expandable_segments:True"}) \
        == AllocatorSettings.parse("max_split_size_mb:32")
    assert AllocatorSettings.from_env({"PYTORCH_CUDA_ALLOC_CONF": "",  # set, though empty
                                       "PYTORCH_ALLOC_CONF": "expandable_segments:True"}) \
        == AllocatorSettings()
    assert AllocatorSettings.from_env({}) == AllocatorSettings()
    with pytest.raises(ValueError, match=r"^AllocatorSettings.from_env: cannot read "
                                         r"PYTORCH_ALLOC_CONF\n  PYTORCH_ALLOC_CONF: 'bogus:1'"):
        AllocatorSettings.from_env({"PYTORCH_ALLOC_CONF": "bogus:1"})
