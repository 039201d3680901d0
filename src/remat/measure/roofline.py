"""Roofline time of recorded ops on a device: compute-bound or memory-bound, op by op.

Each op takes ``max(flops / peak_flops, bytes_moved / bandwidth)`` (Williams,
Waterman & Patterson 2009, "Roofline: an insightful visual performance model"):
a matmul is limited by the FLOP rate of its dtype (bf16/fp16 on tensor cores,
fp32 otherwise), a pointwise op or a norm by memory bandwidth. FLOPs alone would
make recomputing pointwise ops look free; on a GPU they cost real time. Launch
overheads and overlap between ops are ignored, so this is a lower bound.
"""

from __future__ import annotations

from collections.abc import Iterable

from remat.core.op_record import PHASES, OpRecord
from remat.devices import DeviceSpec, get_device
from remat.errors import message


def op_roofline_ms(op: OpRecord, device: DeviceSpec, *, dtype_bytes: int | None = None) -> float:
    """Roofline time of one op, in ms (see the module docstring).

    ``dtype_bytes`` overrides the op's element size when choosing the FLOP peak.
    """
    size = op.dtype_bytes if dtype_bytes is None else dtype_bytes
    compute_s = op.flops / device.flops_per_s(size) if op.flops else 0.0
    memory_s = (op.read_bytes + op.write_bytes) / device.mem_bandwidth_bytes_per_s
    return max(compute_s, memory_s) * 1e3


def roofline_ms(
    ops: Iterable[OpRecord],
    device: DeviceSpec | str,
    *,
    phases: Iterable[str] | None = None,
    dtype_bytes: int | None = None,
) -> float:
    """Sum of per-op roofline times, in ms.

    Args:
        ops: op records, e.g. ``remat.profile(...).ops``.
        device: a :class:`~remat.devices.DeviceSpec` or a known device name
            (``"h100-80gb"``, ...).
        phases: only ops of these phases (``"forward"``, ``"backward"``, ``"recompute"``,
            ``"optimizer"``). Default: all.
        dtype_bytes: element size that picks the FLOP peak for every op (2: bf16/fp16
            tensor cores, 4: fp32), e.g. to price a float32 CPU measurement as a bf16
            GPU run; bytes moved are taken as recorded. Default: each op's own
            ``dtype_bytes``.

    Raises:
        ValueError: an unknown phase or device name.

    Example:
        >>> from remat.devices import DEVICES
        >>> mm = OpRecord("aten.mm", "forward", flops=2 * 4096**3, read_bytes=2 * 2 * 4096**2,
        ...               write_bytes=2 * 4096**2, dtype_bytes=2)
        >>> round(roofline_ms([mm], DEVICES["h100-80gb"]), 4)  # 137 GFLOP at 989 TFLOP/s
        0.139
    """
    spec = get_device(device)
    wanted: frozenset[str] | None = None
    if phases is not None:
        wanted = frozenset(phases)
        unknown = sorted(wanted - set(PHASES))
        if unknown:
            raise ValueError(message("remat.measure.roofline_ms", f"unknown phase(s) {unknown}",
                                     fix=f"pass phases from {PHASES}"))
    return sum(
        op_roofline_ms(op, spec, dtype_bytes=dtype_bytes)
        for op in ops if wanted is None or op.phase in wanted
    )
