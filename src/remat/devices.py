"""Accelerator specifications used to judge fit and to predict step time.

Figures are vendor datasheet numbers for dense (no sparsity) tensor-core math;
memory is what the card reports as total device memory. ``host_link_bytes_per_s``
is the effective host<->device copy rate (PCIe or C2C), which bounds CPU offload.

Sources: NVIDIA A100 datasheet (2021), H100 datasheet (2023), H200 product brief
(2024), DGX B200 datasheet (2024), L4 datasheet (2023), Ada GPU architecture
whitepaper v2.1 (RTX 4090).
"""

from __future__ import annotations

from dataclasses import dataclass

from remat.errors import message

__all__ = ["DEVICES", "DeviceSpec", "get_device", "register_device"]

_GIB = 1024**3
_TERA = 10**12
_GB_PER_S = 10**9


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator's memory and speed.

    Args:
        name: short id, e.g. ``"h100-80gb"``.
        memory_bytes: device memory in bytes.
        bf16_flops_per_s: dense bf16 tensor-core peak, FLOP/s.
        fp32_flops_per_s: fp32 peak (non tensor-core), FLOP/s.
        mem_bandwidth_bytes_per_s: device memory bandwidth, bytes/s.
        host_link_bytes_per_s: effective host<->device copy bandwidth, bytes/s.

    Example:
        >>> DeviceSpec("my-gpu", 24 * 1024**3, 100e12, 20e12, 1e12, 25e9).memory_bytes
        25769803776
    """

    name: str
    memory_bytes: int
    bf16_flops_per_s: float
    fp32_flops_per_s: float
    mem_bandwidth_bytes_per_s: float
    host_link_bytes_per_s: float

    def __post_init__(self) -> None:
        for field in ("memory_bytes", "bf16_flops_per_s", "fp32_flops_per_s",
                      "mem_bandwidth_bytes_per_s", "host_link_bytes_per_s"):
            value = getattr(self, field)
            if not value > 0:
                raise ValueError(message(f"DeviceSpec({self.name!r})", f"{field} must be > 0",
                                         {"found": repr(value)}, fix=f"pass {field} > 0"))

    def flops_per_s(self, dtype_bytes: int) -> float:
        """Peak FLOP/s for an element size: bf16/fp16 (2 bytes) use tensor cores."""
        return self.bf16_flops_per_s if dtype_bytes <= 2 else self.fp32_flops_per_s


DEVICES: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        DeviceSpec("a100-40gb", 40 * _GIB, 312 * _TERA, 19.5 * _TERA, 1555 * _GB_PER_S,
                   25 * _GB_PER_S),
        DeviceSpec("a100-80gb", 80 * _GIB, 312 * _TERA, 19.5 * _TERA, 2039 * _GB_PER_S,
                   25 * _GB_PER_S),
        DeviceSpec("h100-80gb", 80 * _GIB, 989 * _TERA, 67 * _TERA, 3350 * _GB_PER_S,
                   55 * _GB_PER_S),
        DeviceSpec("h200", 141 * 10**9, 989 * _TERA, 67 * _TERA, 4800 * _GB_PER_S,
                   55 * _GB_PER_S),
        DeviceSpec("b200", 180 * 10**9, 2250 * _TERA, 80 * _TERA, 8000 * _GB_PER_S,
                   110 * _GB_PER_S),
        DeviceSpec("l4", 24 * _GIB, 121 * _TERA, 30.3 * _TERA, 300 * _GB_PER_S,
                   25 * _GB_PER_S),
        DeviceSpec("rtx-4090", 24 * _GIB, 165 * _TERA, 82.6 * _TERA, 1008 * _GB_PER_S,
                   25 * _GB_PER_S),
    )
}


def register_device(spec: DeviceSpec) -> None:
    """Add or replace a device in :data:`DEVICES` (user extension point)."""
    DEVICES[spec.name] = spec


def get_device(name: str | DeviceSpec) -> DeviceSpec:
    """Look a device up by name (case-insensitive), or pass a spec through.

    Raises:
        ValueError: unknown name; the message lists the known ones.
    """
    if isinstance(name, DeviceSpec):
        return name
    key = name.lower().replace("_", "-")
    if key not in DEVICES:
        raise ValueError(message(
            "remat", f"unknown device {name!r}", {"known": ", ".join(sorted(DEVICES))},
            fix="pass a known device, or add one with "
                "remat.devices.register_device(DeviceSpec(...))"))
    return DEVICES[key]
