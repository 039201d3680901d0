"""What recomputation costs: roofline time of the recomputed ops, and a step-time model.

On CPU, wall time is too noisy to plan with (and says nothing about the GPU the
plan is for), so every cost is a roofline time on a device spec: H100 figures
when no GPU is present, the GPU's own figures when it is one remat knows.

NOTE [ Step-time model ]
    ``predicted_step_ms`` sums, over every op of the step, ``max(roofline time,
    launch floor)``. The roofline alone (``remat.measure.roofline``) scales
    linearly with the batch, which would make every batch size equally fast; on
    a real GPU each eager op also costs a fixed launch/dispatch time of a few
    microseconds (PyTorch eager dispatch plus a CUDA kernel launch, ~3-10 us per
    op on recent GPUs), which is what makes larger batches faster per sample and
    lets them pay for recomputation. :data:`LAUNCH_FLOOR_MS` is that floor. Ops
    that move no data (views) launch nothing and cost nothing. Recompute cost,
    the planner's objective, is the pure roofline (no floor), as the benchmark
    measures it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from remat.core.op_record import OpRecord
from remat.devices import DEVICES, DeviceSpec, get_device
from remat.measure.roofline import op_roofline_ms

#: The device whose figures costs use when the model is not on a known GPU.
DEFAULT_COST_DEVICE = "h100-80gb"
#: Fixed time per executed (data-moving) op in the step-time model, ms (NOTE [ Step-time model ]).
LAUNCH_FLOOR_MS = 0.005

_GPU_NAMES: tuple[tuple[str, str], ...] = (
    ("h200", "h200"), ("h100", "h100-80gb"), ("b200", "b200"), ("a100", "a100-80gb"),
    ("l4", "l4"), ("4090", "rtx-4090"),
)


def cost_device(model_device: torch.device | str | None = None,
                device: str | DeviceSpec | None = None) -> DeviceSpec:
    """The device spec costs are computed for.

    Args:
        model_device: where the model lives; a known CUDA GPU gives its own spec.
        device: an explicit device name or spec (wins). Default: None.

    Example:
        >>> cost_device("cpu").name
        'h100-80gb'
    """
    if device is not None:
        return get_device(device)
    dev = torch.device(model_device) if model_device is not None else torch.device("cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(dev).lower()
        for key, spec in _GPU_NAMES:
            if key in name:
                if spec == "a100-80gb" and torch.cuda.get_device_properties(dev).total_memory \
                        < 60 * 1024**3:
                    spec = "a100-40gb"
                return DEVICES[spec]
    return DEVICES[DEFAULT_COST_DEVICE]


def recompute_ms(ops: Iterable[OpRecord], device: DeviceSpec) -> float:
    """Roofline time of the ops run while recomputing, ms."""
    return sum(op_roofline_ms(op, device) for op in ops if op.phase == "recompute")


def step_ms(ops: Iterable[OpRecord], device: DeviceSpec, *,
            launch_floor_ms: float = LAUNCH_FLOOR_MS) -> float:
    """Predicted time of a step from its ops, ms (see NOTE [ Step-time model ]).

    Example:
        >>> step_ms(remat.profile(model, batch, timing=False).ops, get_device("h100-80gb"))
    """
    total = 0.0
    for op in ops:
        if op.flops == 0 and op.read_bytes == 0 and op.write_bytes == 0:
            continue
        total += max(op_roofline_ms(op, device), launch_floor_ms)
    return total
