"""What a process holds outside PyTorch's allocator, and the workspaces it allocates in it."""

from __future__ import annotations

import pytest

from remat.device_memory import (
    CONTEXT_EAGER_BYTES,
    CONTEXT_LAZY_BYTES,
    OutsideMemory,
    Term,
    Workspaces,
    cublas_workspace_bytes,
    format_terms,
    layout_process_groups,
    nccl_communicator_bytes,
    outside_bytes,
    outside_terms,
    usable_bytes,
    workspace_bytes,
    workspace_terms,
)
from remat.devices import DeviceSpec, get_device

KIB, MIB, GIB = 1024, 1024**2, 1024**3
#: NCCL's default LL + LL128 + Simple buffers of one connection (NVIDIA/nccl src/init.cc)
NCCL_SET = 8 * 512 * 8 * 16 + 120 * 640 * 8 * 8 + 4 * MIB
#: PyTorch's default ":4096:2:16:8" (CublasHandlePool.cpp)
CUBLAS_DEFAULT = 4096 * KIB * 2 + 16 * KIB * 8


@pytest.mark.parametrize("config, expected", [
    (":4096:8", 32 * MIB),
    (":16:8", 128 * KIB),
    (":4096:2:16:8", 8 * MIB + 128 * KIB),
])
def test_cublas_workspace_config_gives_pytorchs_bytes(config: str, expected: int) -> None:
    for card in ("h100-80gb", "a100-80gb"):  # a set value wins over the card's default
        assert cublas_workspace_bytes(card, {"CUBLAS_WORKSPACE_CONFIG": config}) == expected


@pytest.mark.parametrize("config", ["4096:8", "huge", ""])
def test_an_invalid_cublas_workspace_config_is_a_remat_error(config: str) -> None:
    with pytest.raises(ValueError) as info:
        cublas_workspace_bytes("h100-80gb", {"CUBLAS_WORKSPACE_CONFIG": config})
    lines = str(info.value).splitlines()
    assert lines[0] == ("remat.device_memory.cublas_workspace_bytes: "
                        "CUBLAS_WORKSPACE_CONFIG holds no :SIZE:COUNT pair")
    assert lines[-1].startswith("  fix: set it as :SIZE_KiB:COUNT pairs")


def test_the_default_cublas_workspace_depends_on_the_architecture() -> None:
    assert cublas_workspace_bytes("h100-80gb", {}) == 32 * MIB  # compute capability 9.0
    assert cublas_workspace_bytes("h200", {}) == 32 * MIB
    for card in ("a100-40gb", "a100-80gb", "l4", "rtx-4090", "b200"):
        assert cublas_workspace_bytes(card, {}) == CUBLAS_DEFAULT == 8_519_680
    unknown = DeviceSpec("x", GIB, 1e12, 1e11, 1e11, 1e9)
    assert cublas_workspace_bytes(unknown, {}) == 32 * MIB  # the larger one when unknown


def test_workspaces_count_every_handle_and_stream_pair() -> None:
    terms = workspace_terms("h100-80gb", env={})
    assert terms["cublas"].size_bytes == 2 * 32 * MIB  # forward thread + autograd's thread
    assert terms["cublaslt"].size_bytes == 2 * MIB
    assert terms["cudnn"].size_bytes == 0
    assert workspace_bytes("h100-80gb", env={}) == sum(t.size_bytes for t in terms.values())
    assert workspace_bytes("h100-80gb", env={}, streams=2) == 2 * workspace_bytes(
        "h100-80gb", env={})
    assert workspace_bytes("a100-80gb", env={}, threads=1) == CUBLAS_DEFAULT + MIB


def test_cublaslt_workspace_follows_its_variables() -> None:
    big = {"CUBLASLT_WORKSPACE_SIZE": str(64 * 1024)}  # KiB
    capped = workspace_terms("a100-80gb", env=big, threads=1)["cublaslt"].size_bytes
    assert capped == CUBLAS_DEFAULT  # capped at the cuBLAS workspace
    apart = {**big, "TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}
    assert workspace_terms("a100-80gb", env=apart, threads=1)["cublaslt"].size_bytes == 64 * MIB
    shared = {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}
    assert workspace_terms("a100-80gb", env=shared)["cublaslt"].size_bytes == 0


def test_workspace_overrides_win_and_cudnn_takes_its_cap() -> None:
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "CUDNN_CONV_WSCAP_DBG": "256"}
    assert workspace_terms("l4", env=env)["cudnn"].size_bytes == 256 * MIB
    terms = workspace_terms("l4", Workspaces(cublas_bytes=1, cublaslt_bytes=2, cudnn_bytes=3),
                            env=env)
    assert [t.size_bytes for t in terms.values()] == [2, 4, 3]
    assert all(t.source.startswith("override") for t in terms.values())


def test_nccl_estimate_per_communicator() -> None:
    # A100 (24 channels, no NVLS): calibrated on NVIDIA/nccl#964's 688 MiB
    assert nccl_communicator_bytes("a100-80gb", 4, {}) == 24 * 3 * NCCL_SET + 32 * MIB
    assert nccl_communicator_bytes("a100-80gb", 4, {}) == 693.5 * MIB
    ring_tree = 32 * 3 * NCCL_SET + 32 * MIB
    nvls = 16 * (4 * 4 * MIB + 2 * MIB)  # 288 MiB, vllm-project/vllm#9699
    assert nvls == 301_989_888
    assert nccl_communicator_bytes("h100-80gb", 8, {}) == ring_tree + nvls
    assert nccl_communicator_bytes("h100-80gb", 2, {}) == ring_tree  # NVLS needs > 2 ranks
    assert nccl_communicator_bytes("h100-80gb", 8, {"NCCL_NVLS_ENABLE": "0"}) == ring_tree
    assert nccl_communicator_bytes("h100-80gb", 1, {}) == 0


def test_nccl_estimate_reads_nccls_variables() -> None:
    small = {"NCCL_BUFFSIZE": str(1 * MIB), "NCCL_NVLS_ENABLE": "0"}
    per_set = NCCL_SET - 4 * MIB + 1 * MIB
    assert nccl_communicator_bytes("h200", 8, small) == 32 * 3 * per_set + 32 * MIB
    assert nccl_communicator_bytes("b200", 4, {"NCCL_MAX_NCHANNELS": "8",
                                               "NCCL_NVLS_ENABLE": "0"}) == (
        8 * 3 * NCCL_SET + 32 * MIB)
    assert nccl_communicator_bytes("l4", 2, {"NCCL_MIN_NCHANNELS": "4"}) == (
        4 * 3 * NCCL_SET + 32 * MIB)
    with pytest.raises(ValueError, match="^remat.device_memory.nccl_communicator_bytes: "
                                         "NCCL_BUFFSIZE is not an integer"):
        nccl_communicator_bytes("l4", 2, {"NCCL_BUFFSIZE": "4M"})


def test_a_layout_names_its_communicators() -> None:
    assert layout_process_groups() == ()
    assert layout_process_groups(dp=8) == (8,)  # plain DDP/FSDP runs on the default group
    assert layout_process_groups(tp=8, dp=4) == (8, 4, 32)
    assert layout_process_groups(tp=8, dp=4, world_group=False) == (8, 4)
    assert layout_process_groups(tp=2, dp=2, pp=2) == (2, 2, 2, 8)
    with pytest.raises(ValueError, match="^remat.device_memory.layout_process_groups: tp"):
        layout_process_groups(tp=0)


def test_outside_terms_sum_to_the_total_and_overrides_win() -> None:
    groups = layout_process_groups(tp=8, dp=4)
    terms = outside_terms("h100-80gb", env={}, process_groups=groups)
    assert terms["cuda_context"].size_bytes == CONTEXT_LAZY_BYTES == 512 * MIB
    assert terms["nccl"].size_bytes == sum(nccl_communicator_bytes("h100-80gb", n, {})
                                           for n in groups)
    total = outside_bytes("h100-80gb", env={}, process_groups=groups)
    assert total == sum(t.size_bytes for t in terms.values())
    eager = outside_terms("h100-80gb", env={"CUDA_MODULE_LOADING": "EAGER"})
    assert eager["cuda_context"].size_bytes == CONTEXT_EAGER_BYTES == GIB
    mine = OutsideMemory(context_bytes=1, nccl_bytes=2, other_bytes=3)
    assert outside_bytes("h100-80gb", mine, env={"CUDA_MODULE_LOADING": "EAGER"},
                         process_groups=groups) == 6


def test_usable_is_capacity_less_the_outside() -> None:
    card = get_device("h100-80gb")
    groups = (8,)
    held = outside_bytes(card, env={}, process_groups=groups)
    assert usable_bytes(card, env={}, process_groups=groups) == card.capacity_bytes - held
    assert usable_bytes("l4", OutsideMemory(context_bytes=0), env={}) == (
        get_device("l4").capacity_bytes)
    with pytest.raises(ValueError, match="^remat.device_memory.usable_bytes: outside memory"):
        usable_bytes("l4", OutsideMemory(other_bytes=30 * GIB), env={})


def test_overrides_are_checked() -> None:
    with pytest.raises(ValueError, match=r"^OutsideMemory: context_bytes must be an int"):
        OutsideMemory(context_bytes=-1)
    with pytest.raises(ValueError, match=r"^Workspaces: cudnn_bytes must be an int"):
        Workspaces(cudnn_bytes=1.5)  # type: ignore[arg-type]


def test_a_breakdown_prints_one_line_per_term_and_the_total() -> None:
    text = format_terms({"cuda_context": Term(512 * MIB, "estimate"), "nccl": Term(0, "none")})
    assert text.splitlines() == ["cuda_context: 512.00 MiB (estimate)", "nccl: 0 B (none)",
                                 "total: 512.00 MiB"]
