"""Run one block forward and backward under a candidate's decisions, tracked.

See NOTE [ Gradient of the block output ] for how the backward is driven, and NOTE
[ Memory windows ] in ``_sim.py`` for the windows the run is cut into.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from remat.measure.ledger import first_tensor
from remat.measure.tracked import held_gc
from remat.measure.tracker import MemoryTracker, OpRecord
from remat.planning._sim import FakeSetup, WindowRecorder, quiet
from remat.planning.capture import BlockInputs, fresh_inputs, tensors_in
from remat.planning.plans import NamedBlocks
from remat.strategies import Part, apply_decisions, remove

__all__ = ["BlockRun", "apply_parts", "run_block"]


@dataclass(frozen=True)
class BlockRun:
    """What one block's tracked forward and backward measured (bytes; its ops)."""

    saved_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    ops: tuple[OpRecord, ...]


def apply_parts(model: nn.Module, name: str, parts: Sequence[Part],
                block_names: Sequence[str]) -> None:
    """Apply a candidate's ``parts`` to block ``name`` of ``model`` (undo with ``remove``)."""
    decisions = {f"{name}.{path}" if path else name: d for path, d in parts if d.kind != "none"}
    if any(key != name for key in decisions):
        spec = NamedBlocks(tuple(decisions))
    else:
        spec = NamedBlocks(tuple(block_names))
    with quiet():
        apply_decisions(model, decisions, blocks=spec)


# NOTE [ Gradient of the block output ]
#   In the whole step, the gradient of a block's output is made by the next block's
#   backward and freed by autograd as soon as this block's backward has used it. Passing
#   a gradient tensor to ``backward()`` would keep it alive through the whole backward,
#   over-counting the working set of candidates whose peak comes late. So the block's
#   output is reduced to a scalar through a fixed weight instead: autograd makes the
#   output's gradient itself and frees it as it would in the step. That gradient is
#   counted in this window rather than the previous one, the same for every candidate,
#   and the peak model's calibration (peak.py) absorbs the constant.


def run_block(setup: FakeSetup, name: str, block: nn.Module,
               inputs: BlockInputs, parts: Sequence[Part],
               attribution: Sequence[tuple[str, nn.Module]] = ()) -> BlockRun:
    """Forward and backward of one block under ``parts``, tracked (see module docstring)."""
    apply_parts(setup.model, name, parts, [n for n, _ in setup.blocks])
    try:
        with setup.mode:
            (args, kwargs), x = fresh_inputs(name, inputs)
        for p in block.parameters():
            p.grad = None
        tracker = MemoryTracker(device=setup.device, blocks=list(attribution) or [(name, block)])
        tracker.register_model(block)
        tracker.register([x, *tensors_in(args), *tensors_in(kwargs)], "other")
        windows = WindowRecorder(tracker)
        weights: list[Tensor] = []
        with held_gc(), setup.mode, tracker, torch.enable_grad():
            windows.open("fwd")
            out = block(*args, **kwargs)
            windows.open("saved")
            y = first_tensor(out)
            if y is None or not y.requires_grad:
                raise ValueError(
                    f"remat.plan: block {name!r} returned no tensor that requires grad, so "
                    "there is nothing to checkpoint in it"
                )
            # See NOTE [ Gradient of the block output ].
            with torch.no_grad():
                weights.append(torch.ones_like(y))
            tracker.register(weights, "other")
            loss = (y * weights[0]).sum()
            del out, y
            tracker.set_phase("backward")
            windows.open("bwd")
            loss.backward()
            del loss
        saved = windows.starts["saved"] - windows.starts["fwd"]
        return BlockRun(
            saved_bytes=saved,
            forward_peak_bytes=windows.peaks["fwd"] - windows.starts["fwd"],
            backward_peak_bytes=windows.peaks["bwd"] - windows.starts["bwd"] + saved,
            ops=tracker.ops,
        )
    finally:
        remove(setup.model)
        for p in block.parameters():
            p.grad = None
