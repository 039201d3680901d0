"""Accelerator specifications used to judge fit and to predict step time.

Speeds are vendor datasheet numbers for dense (no sparsity) tensor-core math;
``host_link_bytes_per_s`` is the effective host<->device copy rate (PCIe or C2C), which
bounds CPU offload. Capacity is what PyTorch reports for the card, not its marketed size
(NOTE [ Capacity PyTorch reports ]); :func:`current` reads the exact figure of the card
in use. What a process holds outside PyTorch's allocator (CUDA context, NCCL buffers) is
:mod:`remat.device_memory`.

Sources of the speeds: NVIDIA A100 datasheet (2021), H100 datasheet (2023), H200 product
brief (2024), DGX B200 datasheet (2024), L4 datasheet (2023), Ada GPU architecture
whitepaper v2.1 (RTX 4090).

NOTE [ Capacity PyTorch reports ]
    Rule 1. ``DeviceSpec.capacity_bytes`` is the card's total memory as PyTorch reports
    it: ``torch.cuda.get_device_properties(i).total_memory`` (CUDA's
    ``cudaDeviceProp.totalGlobalMem``), the figure an out-of-memory error prints as
    "GPU 0 has a total capacity of N GiB". It is below the marketed size: an H100 80GB
    shows 81559 MiB in ``nvidia-smi`` and 79.11 GiB (81,009 MiB) in PyTorch
    (vllm-project/vllm#27508). Nothing in a step can use more, so every fit is judged
    against it.

    Rule 2. The figure of a card in :data:`DEVICES` is the lowest one found in published
    out-of-memory messages, at the low end of its rounding: "79.11 GiB" (two decimals)
    is any value in [79.105, 79.115) GiB, and remat takes 79.105 GiB. The figure moves by
    up to ~0.2 GiB with the driver version, ECC mode and host (L4s print 22.03 GiB in
    some logs and 21.96 GiB in others), so the low end keeps a predicted fit true on
    every card of that name the sources saw. Implication: on a given card remat may call
    a step that would fit by a few MiB "does not fit"; ``remat.devices.current()`` reads
    the exact capacity of the card in use and removes that slack.

    Figures (device: lowest reported, others seen; where):
      - a100-40gb: 39.50 GiB, 39.59; TianheWu/CoSeR#10 (A100), czh-98/STAR#3.
      - a100-80gb: 79.15 GiB, 79.25; a public training note quoting the message next to
        ``nvidia-smi``'s 81920 MiB (A100 80GB), HiDream-ai/VAREdit#6 and
        levihsu/OOTDiffusion#235 (79.25 GiB on A100).
      - h100-80gb: 79.11 GiB, 79.15, 79.22; vllm-project/vllm#27508 (NVIDIA H100 80GB
        HBM3, 81559 MiB), vllm-project/vllm#10511 (79.22 GiB on H100).
      - h200: 139.72 GiB (card inferred from the size), 139.80, 139.81 (8xH200 nodes);
        public run logs (no issue thread found; the figures recur in independent logs).
      - b200: 178.35 GiB, 178.36; public run logs on 8xB200 nodes (same).
      - l4: 21.96 GiB (SageMaker ml.g6, Cloud Run), 22.03 GiB (GCP g2, Modal); public
        deployment logs (same).
      - rtx-4090: 23.64 GiB, 23.65, 23.68; ali-vilab/VGen#104 and
        3DTopia/Phidias-Diffusion#8 (23.64), MotrixLab/AiOS#29 (23.65),
        zai-org/CogVideo#36 (23.68).
    H100 NVL (94 GB) and GH200 have no entry: no published figure was solid enough.
    ``current()`` reads any H100 (PCIe and NVL included) as ``h100-80gb`` with the card's
    own capacity (the SXM card's speeds, optimistic for the others), and refuses a GH200
    with the fix (register a spec).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from remat.errors import RematError, message

__all__ = ["DEVICES", "DeviceSpec", "current", "get_device", "match_device", "register_device"]

_GIB = 1024**3
_TERA = 10**12
_GB_PER_S = 10**9


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator's memory and speed.

    A spec says what the card is; what a process takes from it (CUDA context, NCCL
    buffers, library workspaces) is :mod:`remat.device_memory`.

    Args:
        name: short id, e.g. ``"h100-80gb"``.
        capacity_bytes: total device memory as PyTorch reports it, bytes
            (``torch.cuda.get_device_properties(i).total_memory``; NOTE [ Capacity
            PyTorch reports ]).
        bf16_flops_per_s: dense bf16 tensor-core peak, FLOP/s.
        fp32_flops_per_s: fp32 peak (non tensor-core), FLOP/s.
        mem_bandwidth_bytes_per_s: device memory bandwidth, bytes/s.
        host_link_bytes_per_s: effective host<->device copy bandwidth, bytes/s.
        compute_capability: ``(major, minor)``, e.g. ``(9, 0)`` for Hopper; PyTorch's
            default cuBLAS workspace depends on it (:func:`remat.device_memory.workspace_bytes`).
            Default: None (unknown: the workspace model then takes the largest default).

    Example:
        >>> DeviceSpec("my-gpu", 24 * 1024**3, 100e12, 20e12, 1e12, 25e9).capacity_bytes
        25769803776
    """

    name: str
    capacity_bytes: int
    bf16_flops_per_s: float
    fp32_flops_per_s: float
    mem_bandwidth_bytes_per_s: float
    host_link_bytes_per_s: float
    compute_capability: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        for field in ("capacity_bytes", "bf16_flops_per_s", "fp32_flops_per_s",
                      "mem_bandwidth_bytes_per_s", "host_link_bytes_per_s"):
            value = getattr(self, field)
            if not value > 0:
                raise ValueError(message(f"DeviceSpec({self.name!r})", f"{field} must be > 0",
                                         {"found": repr(value)}, fix=f"pass {field} > 0"))
        cc = self.compute_capability
        if cc is not None and not (len(cc) == 2 and all(isinstance(v, int) and v >= 0
                                                        for v in cc)):
            raise ValueError(message(
                f"DeviceSpec({self.name!r})", "compute_capability must be (major, minor)",
                {"found": repr(cc)}, fix="pass e.g. compute_capability=(9, 0), or None"))

    def flops_per_s(self, dtype_bytes: int) -> float:
        """Peak FLOP/s for an element size: bf16/fp16 (2 bytes) use tensor cores."""
        return self.bf16_flops_per_s if dtype_bytes <= 2 else self.fp32_flops_per_s


def _reported(gib_hundredths: int) -> int:
    """Bytes at the low end of a capacity printed as ``gib_hundredths / 100`` GiB.

    "79.11 GiB" is any value in [79.105, 79.115) GiB; the low end keeps fits safe
    (NOTE [ Capacity PyTorch reports ], Rule 2).

    Example:
        >>> round(_reported(7911) / 1024**3, 6)
        79.105
    """
    return (2 * gib_hundredths - 1) * _GIB // 200


DEVICES: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        DeviceSpec("a100-40gb", _reported(3950), 312 * _TERA, 19.5 * _TERA,
                   1555 * _GB_PER_S, 25 * _GB_PER_S, (8, 0)),
        DeviceSpec("a100-80gb", _reported(7915), 312 * _TERA, 19.5 * _TERA,
                   2039 * _GB_PER_S, 25 * _GB_PER_S, (8, 0)),
        DeviceSpec("h100-80gb", _reported(7911), 989 * _TERA, 67 * _TERA,
                   3350 * _GB_PER_S, 55 * _GB_PER_S, (9, 0)),
        DeviceSpec("h200", _reported(13972), 989 * _TERA, 67 * _TERA,
                   4800 * _GB_PER_S, 55 * _GB_PER_S, (9, 0)),
        DeviceSpec("b200", _reported(17835), 2250 * _TERA, 80 * _TERA,
                   8000 * _GB_PER_S, 110 * _GB_PER_S, (10, 0)),
        DeviceSpec("l4", _reported(2196), 121 * _TERA, 30.3 * _TERA,
                   300 * _GB_PER_S, 25 * _GB_PER_S, (8, 9)),
        DeviceSpec("rtx-4090", _reported(2364), 165 * _TERA, 82.6 * _TERA,
                   1008 * _GB_PER_S, 25 * _GB_PER_S, (8, 9)),
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


#: CUDA device names (``torch.cuda.get_device_name``) to :data:`DEVICES` keys, first match
#: wins. Word boundaries keep "L40S" off ``l4`` and "GH200" off ``h200``. Every H100
#: (SXM, PCIe, NVL) takes the SXM card's speeds; its capacity is read from the card.
_CARD_NAMES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), key) for pattern, key in (
        (r"\bh200\b", "h200"), (r"\bh100\b", "h100-80gb"), (r"\bb200\b", "b200"),
        (r"\ba100\b", "a100"), (r"\bl4\b", "l4"), (r"\b4090\b", "rtx-4090"),
    ))


def match_device(card_name: str, total_memory: int | None = None) -> DeviceSpec | None:
    """The spec in :data:`DEVICES` whose speeds a CUDA card of this name has, or None.

    Args:
        card_name: the name CUDA gives the card, e.g. ``"NVIDIA H100 80GB HBM3"``.
        total_memory: its capacity, bytes; tells the A100 40GB from the 80GB when the
            name does not. Default: None (an A100 of unknown size is the 40GB one).

    Example:
        >>> match_device("NVIDIA A100-SXM4-80GB", 85_000_000_000).name
        'a100-80gb'
        >>> match_device("NVIDIA L40S") is None
        True
    """
    lowered = card_name.lower()
    for pattern, key in _CARD_NAMES:
        if pattern.search(lowered):
            if key == "a100":
                key = "a100-80gb" if (total_memory or 0) > 60 * _GIB else "a100-40gb"
            return DEVICES[key]
    by_name = lowered.replace(" ", "-")
    return DEVICES.get(by_name)


def current(index: int | None = None) -> DeviceSpec:
    """The spec of the CUDA card in use, with its exact capacity.

    The card's name picks the speeds from :data:`DEVICES` (:func:`match_device`); its
    capacity and compute capability are read from the card, so a fit judged on the
    result has none of the rounding slack of the table (NOTE [ Capacity PyTorch
    reports ]). Only the device properties are read: no CUDA context is created (a
    context costs ~0.3-0.4 GiB of the card; ``torch.cuda.mem_get_info`` would create one,
    unslothai/unsloth-zoo#1053).

    Args:
        index: CUDA device index. Default: None (the current device).

    Returns:
        A :class:`DeviceSpec` named like the table entry it matched.

    Raises:
        RematError: CUDA is not available, the index is out of range, or the card is
            not one remat knows (the message says how to register it).

    Example:
        >>> spec = remat.devices.current()  # doctest: +SKIP
        >>> spec.name, round(spec.capacity_bytes / 2**30, 2)  # doctest: +SKIP
        ('h100-80gb', 79.19)
    """
    api = "remat.devices.current"
    import torch  # lazy: reading the card is the only part of this module that needs it

    if not torch.cuda.is_available():
        raise RematError(message(
            api, "no CUDA device to read",
            {"torch": torch.__version__, "torch built for CUDA": torch.version.cuda},
            fix="run on a machine with a CUDA GPU, or name the card instead: "
                "remat.devices.get_device('h100-80gb')"))
    count = torch.cuda.device_count()
    if index is None:
        index = torch.cuda.current_device()
    if not 0 <= index < count:
        raise RematError(message(api, f"no CUDA device {index}", {"devices": count},
                                 fix=f"pass an index in 0..{count - 1}"))
    props = torch.cuda.get_device_properties(index)
    total = int(props.total_memory)
    spec = match_device(props.name, total)
    if spec is None:
        key = props.name.lower().replace(" ", "-")
        raise RematError(message(
            api, f"unknown GPU {props.name!r}",
            {"capacity": f"{total} bytes", "compute capability": f"{props.major}.{props.minor}",
             "known": ", ".join(sorted(DEVICES))},
            fix="register its speeds under its CUDA name, lower-case with '-' for spaces: "
                f"remat.devices.register_device(DeviceSpec({key!r}, {total}, "
                "bf16_flops_per_s, fp32_flops_per_s, mem_bandwidth_bytes_per_s, "
                "host_link_bytes_per_s))"))
    return replace(spec, capacity_bytes=total,
                   compute_capability=(int(props.major), int(props.minor)))
