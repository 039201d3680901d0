"""The GPU table holds the capacity PyTorch reports; ``current()`` reads the card in use."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from remat import devices
from remat.devices import DEVICES, DeviceSpec, current, get_device, match_device, register_device
from remat.errors import RematError

GIB = 1024**3

#: device -> (marketed size in GiB, lowest "total capacity of N GiB" published; the
#: sources are in NOTE [ Capacity PyTorch reports ] in remat/devices.py).
CITED = {
    "a100-40gb": (40, 39.50),
    "a100-80gb": (80, 79.15),
    "h100-80gb": (80, 79.11),
    "h200": (141, 139.72),
    "b200": (180, 178.35),
    "l4": (24, 21.96),
    "rtx-4090": (24, 23.64),
}


@pytest.mark.parametrize("name", sorted(CITED))
def test_capacity_is_the_low_end_of_the_cited_figure_and_below_the_marketed_size(
        name: str) -> None:
    nominal_gib, cited_gib = CITED[name]
    capacity = get_device(name).capacity_bytes
    assert capacity < nominal_gib * GIB
    assert abs(capacity - cited_gib * GIB) <= 0.01 * cited_gib * GIB
    # the low end of the two-decimal rounding: fits stay true on every card seen
    assert (cited_gib - 0.005) * GIB - 1 <= capacity <= (cited_gib - 0.005) * GIB


def test_every_known_card_has_its_compute_capability() -> None:
    assert set(CITED) <= set(DEVICES)
    assert all(spec.compute_capability is not None for spec in DEVICES.values())
    assert get_device("h100-80gb").compute_capability == (9, 0)
    assert get_device("b200").compute_capability == (10, 0)


def test_spec_checks_its_compute_capability() -> None:
    with pytest.raises(ValueError, match=r"^DeviceSpec\('x'\): compute_capability"):
        DeviceSpec("x", GIB, 1e12, 1e11, 1e11, 1e9, (9,))  # type: ignore[arg-type]
    assert DeviceSpec("x", GIB, 1e12, 1e11, 1e11, 1e9).compute_capability is None


@pytest.mark.parametrize("card, memory, expected", [
    ("NVIDIA H100 80GB HBM3", 85 * 10**9, "h100-80gb"),
    ("NVIDIA H100 PCIe", 85 * 10**9, "h100-80gb"),
    ("NVIDIA H200", 150 * 10**9, "h200"),
    ("NVIDIA B200", 191 * 10**9, "b200"),
    ("NVIDIA A100-SXM4-40GB", 42 * 10**9, "a100-40gb"),
    ("NVIDIA A100 80GB PCIe", 85 * 10**9, "a100-80gb"),
    ("NVIDIA L4", 23 * 10**9, "l4"),
    ("NVIDIA GeForce RTX 4090", 25 * 10**9, "rtx-4090"),
    ("NVIDIA L40S", 48 * 10**9, None),
    ("NVIDIA GH200 480GB", 100 * 10**9, None),
])
def test_card_names_match_their_spec(card: str, memory: int, expected: str | None) -> None:
    spec = match_device(card, memory)
    assert (spec.name if spec else None) == expected


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, *, name: str, total: int,
               cc: tuple[int, int] = (9, 0), count: int = 2, cur: int = 1) -> list[int]:
    asked: list[int] = []

    def props(index: int) -> SimpleNamespace:
        asked.append(index)
        return SimpleNamespace(name=name, total_memory=total, major=cc[0], minor=cc[1])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: cur)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    return asked


def test_current_reads_the_exact_capacity_and_keeps_the_table_speeds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _fake_cuda(monkeypatch, name="NVIDIA H100 80GB HBM3", total=84_987_740_160)
    spec = current()
    table = get_device("h100-80gb")
    assert asked == [1]  # the current device
    assert spec.name == "h100-80gb" and spec.capacity_bytes == 84_987_740_160
    assert spec.compute_capability == (9, 0)
    assert spec.bf16_flops_per_s == table.bf16_flops_per_s
    assert spec.mem_bandwidth_bytes_per_s == table.mem_bandwidth_bytes_per_s
    assert current(0).capacity_bytes == 84_987_740_160 and asked[-1] == 0


def test_current_without_cuda_names_the_call_and_the_fix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RematError) as info:
        current()
    lines = str(info.value).splitlines()
    assert lines[0] == "remat.devices.current: no CUDA device to read"
    assert lines[-1].startswith("  fix: ") and "get_device('h100-80gb')" in lines[-1]


def test_current_rejects_an_index_out_of_range(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, name="NVIDIA L4", total=23 * 10**9)
    with pytest.raises(RematError, match=r"^remat.devices.current: no CUDA device 5"):
        current(5)


def test_an_unknown_card_is_refused_until_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "DEVICES", dict(DEVICES))
    _fake_cuda(monkeypatch, name="NVIDIA GH200 480GB", total=102_000_000_000)
    with pytest.raises(RematError) as info:
        current()
    text = str(info.value)
    assert text.startswith("remat.devices.current: unknown GPU 'NVIDIA GH200 480GB'")
    assert "register_device(DeviceSpec('nvidia-gh200-480gb', 102000000000" in text
    register_device(DeviceSpec("nvidia-gh200-480gb", 96 * GIB, 989e12, 67e12, 4e12, 450e9))
    spec = current()
    assert spec.name == "nvidia-gh200-480gb" and spec.capacity_bytes == 102_000_000_000
    assert get_device("nvidia-gh200-480gb").capacity_bytes == 96 * GIB
