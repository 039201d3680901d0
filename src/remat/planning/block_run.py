"""Run one block forward and backward under a candidate's decisions, tracked.

See NOTE [ Who keeps a hidden state ] for what counts as the block's saved bytes, NOTE
[ Gradient of the block output ] for how the backward is driven, and NOTE [ Memory
windows ] in ``measure/windows.py`` for the windows the run is cut into.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from remat.blocks import NamedBlocks, Sublayer
from remat.core.op_record import OpRecord
from remat.errors import message
from remat.measure.ledger import first_tensor
from remat.measure.tracked_step import held_gc
from remat.measure.tracker import MemoryTracker
from remat.measure.windows import FakeSetup, WindowRecorder
from remat.planning.capture import BlockInputs, fresh_inputs, tensors_in
from remat.strategies import Part, apply_decisions, remove
from remat.strategies.apply import quiet_warnings
from remat.strategies.builtin import NoCheckpoint
from remat.strategies.op_graph import OpGraph, block_graphs


@dataclass(frozen=True)
class BlockRun:
    """What one block's tracked forward and backward measured (bytes; its ops), and when
    each pass peaked (NOTE [ Peak moments ] in measure/windows.py) and in which phase
    backward did."""

    saved_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    ops: tuple[OpRecord, ...]
    forward_peak_at: tuple[int, int] | None = None
    backward_peak_at: tuple[int, int] | None = None
    backward_peak_phase: str = "backward"


def apply_parts(model: nn.Module, name: str, parts: Sequence[Part],
                block_names: Sequence[str]) -> None:
    """Apply a candidate's ``parts`` to block ``name`` of ``model`` (undo with ``remove``)."""
    decisions = {f"{name}.{path}" if path else name: d for path, d in parts
                 if not isinstance(d, NoCheckpoint)}
    with quiet_warnings():  # sub-layer paths resolve under the block (NOTE [ Decision keys ])
        apply_decisions(model, decisions, blocks=NamedBlocks(tuple(block_names)))


# NOTE [ Gradient of the block output ]
#   In the whole step, the gradient of a block's output is made by the next block's
#   backward and freed by autograd as soon as this block's backward has used it. Passing
#   a gradient tensor to ``backward()`` would keep it alive through the whole backward,
#   over-counting the working set of candidates whose peak comes late. So the block's
#   output is reduced to a scalar through a fixed weight instead: autograd makes the
#   output's gradient itself and frees it as it would in the step. That gradient is
#   counted in this window rather than the previous one, the same for every candidate,
#   and the peak model's calibration (remat/core/peak.py) absorbs the constant. The backward window
#   starts once the block's input and output are dropped (NOTE [ Who keeps a hidden
#   state ]), so ``backward_peak_bytes`` is the backward's high-water mark above the
#   memory without the block's input, its output and anything the block keeps, plus
#   ``saved_bytes``: the input counts only when the block keeps it, as in the step.


# NOTE [ Who keeps a hidden state ]
#   In the whole step, block i's output is block i+1's input, and it stays alive for
#   backward only if some graph keeps it: un-checkpointed bf16 Llama blocks keep only the
#   fp32 upcast of their input (RMSNorm), checkpointed ones (``full``, block-wide
#   ``ops``) keep their input itself, fp32 norms keep it either way. So each hidden state
#   is attributed to the block that keeps it, which makes the peak model's sums additive
#   per block: a candidate's ``saved_bytes`` is what its graph keeps, its input counted
#   only if its graph keeps the input, its output only if its own graph keeps the output.
#   ``run_block`` runs the block on a clone of the captured input (a storage of its own
#   and not a leaf: AccumulateGrad would hold a leaf), builds the scalar loss (which keeps
#   the weight, not the output: verified), then drops every reference to the input and
#   the output. What the tracker still counts (its ledger sees a storage die exactly when
#   its memory is freed, NOTE [ Storage identity and frees ] in ledger.py) less the
#   memory before the forward without the input, the weight and the loss is the saved
#   bytes. The block's other inputs (masks, position embeddings shared by all blocks)
#   stay referenced and are never counted. A checkpointed block holds them until its
#   backward, though, and one that no block's graph keeps (Hugging Face decoders pass
#   ``position_ids``, a ``(1, s)`` int64 tensor, to every layer, which uses the rotary
#   tables instead) would otherwise die at the end of forward: while any checkpointed
#   block's backward is to come, the step holds ``8 s`` bytes more than the peak model
#   (one tensor however many blocks hold it: not additive, so not modelled; the closed
#   loop's measurement of the plan sees it). Measuring with the output alive and the input
#   pre-existing instead would under-predict every bf16 window by one hidden state per
#   checkpointed block before it.


def _swap(value: Any, old: Tensor, new: Tensor) -> Any:
    """``value`` with every occurrence of ``old`` (by identity) replaced by ``new``."""
    return tree_map(lambda v: new if v is old else v, value)


def run_block(setup: FakeSetup, name: str, block: nn.Module,
               inputs: BlockInputs, parts: Sequence[Part],
               attribution: Sequence[tuple[str, Sublayer]] = ()) -> BlockRun:
    """Forward and backward of one block under ``parts``, tracked (see module docstring)."""
    apply_parts(setup.model, name, parts, [n for n, _ in setup.blocks])
    try:
        with setup.mode:
            (args, kwargs), leaf = fresh_inputs(name, inputs)
            # See NOTE [ Who keeps a hidden state ]: the block's input gets a storage of
            # its own, not a leaf (AccumulateGrad would hold a leaf), so that the tracker
            # sees it freed unless the block's graph keeps it.
            x = leaf.clone()
        args, kwargs = _swap(args, leaf, x), _swap(kwargs, leaf, x)
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
                raise ValueError(message(
                    "remat.plan", f"block {name!r} returned no tensor that requires grad",
                    {"so": "there is nothing to checkpoint in it"},
                    fix="select with blocks= modules whose output requires grad"))
            # See NOTE [ Gradient of the block output ].
            with torch.no_grad():
                weights.append(torch.ones_like(y))
            tracker.register(weights, "other")  # made under the tracker: counted already
            weight_bytes = weights[0].untyped_storage().nbytes()
            loss = (y * weights[0]).sum()
            # See NOTE [ Who keeps a hidden state ]: drop every reference to the block's
            # input and output; what is still alive is what the block's graph keeps.
            x_bytes = x.untyped_storage().nbytes()
            args, kwargs = _swap(args, x, leaf), _swap(kwargs, x, leaf)
            del out, y, x
            saved = (tracker.current_bytes - (windows.starts["fwd"] - x_bytes)
                     - weight_bytes - loss.untyped_storage().nbytes())
            tracker.set_phase("backward")
            windows.open("bwd")
            loss.backward()
            del loss
        return BlockRun(
            saved_bytes=saved,
            forward_peak_bytes=windows.peaks["fwd"] - windows.starts["fwd"],
            backward_peak_bytes=windows.peaks["bwd"] - windows.starts["bwd"] + saved,
            ops=tracker.ops,
            forward_peak_at=windows.moments["fwd"],
            backward_peak_at=windows.moments["bwd"],
            backward_peak_phase=windows.phases["bwd"],
        )
    finally:
        remove(setup.model)
        for p in block.parameters():
            p.grad = None


def record_graphs(setup: FakeSetup, name: str, block: nn.Module, inputs: BlockInputs,
                  sublayers: dict[str, Sublayer]) -> dict[str, OpGraph]:
    """The block's and its sub-layers' op graphs (``remat.strategies.op_graph``), recorded
    by one forward on the fake copy; empty where the forward cannot be followed."""
    with setup.mode:
        (args, kwargs), leaf = fresh_inputs(name, inputs)
        x = leaf.clone()
    args, kwargs = _swap(args, leaf, x), _swap(kwargs, leaf, x)
    try:
        with held_gc(), setup.mode:
            return block_graphs(block, args, kwargs, sublayers)
    except (RuntimeError, NotImplementedError):
        return {}  # ranked by own recompute time only
