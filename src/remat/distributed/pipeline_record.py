"""One simulated step attributed per place, for the pipeline rows.

:func:`record_step` runs one tracked step (one tensor-parallel rank's when the model is
parallelized) with every block and the modules outside the blocks as attribution units;
:func:`cut_stack` and :func:`expand_record` let a uniform stack be simulated cut to three
blocks. NOTE [ Pipeline rank bytes ] in pipeline.py says what the rows make of it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from remat.errors import RematWarning

if TYPE_CHECKING:
    from remat.measure.tracker import MemoryTracker


@dataclass
class Record:
    """What one simulated step gives per place (a block's name, or a module outside the
    blocks): saved bytes per attribution unit, the backward working set and recompute
    time per place; per parameter name, its bytes and its gradient's on the rank, and
    the optimizer's per-element and scalar state bytes; the step's own peak."""

    saved: dict[str, int]
    rest: int
    work: dict[str | None, int]
    recompute_ms: dict[str | None, float]
    params: dict[str, tuple[int, int]]
    state: dict[str, tuple[int, int]]
    peak: int


def _place(unit: str | None, blocks: set[str]) -> str | None:
    name = unit
    while name:
        if name in blocks:
            return name
        name = name.rpartition(".")[0]
    return unit


def _outside_units(model: nn.Module, blocks: Sequence[str]) -> set[str]:
    """The largest modules outside every block (each child of the root or of a block's
    ancestor that is neither): the embedding, final norm and head, however nested."""
    ancestors = {""} | {b.rpartition(".")[0] for b in blocks}
    for name in list(ancestors):
        while name:
            name = name.rpartition(".")[0]
            ancestors.add(name)
    block_set = set(blocks)
    return {n for n, _ in model.named_modules() if n and n not in ancestors
            and n not in block_set and n.rpartition(".")[0] in ancestors}


def _nbytes(t: torch.Tensor | None) -> int:
    from remat.distributed.sharded import local_tensor

    if t is None:
        return 0
    local = local_tensor(t)  # a DTensor's shard: this rank's bytes
    return local.numel() * local.element_size()


def record_step(setup: Any, strategy: str, batch_size: int, seq_len: int,
            blocks: Sequence[str], device: str) -> Record:
    """One simulated step of ``setup`` with every block and the modules outside them
    attributed (one tensor-parallel rank's step when ``setup``'s model is parallelized)."""
    from remat.devices import get_device
    from remat.measure.profile import WarmFake
    from remat.measure.roofline import op_roofline_ms
    from remat.measure.step import Step, clear_grads
    from remat.measure.tracked_step import tracked_step
    from remat.simulate.sim_setup import Autocast
    from remat.strategies import apply, remove

    batch = setup.batch_fn(batch_size, seq_len)
    warm = WarmFake(Step(setup.model, batch, loss_fn=setup.loss_fn,
                         optimizer=setup.optimizer, blocks=setup.blocks), batch, prepare=remove)
    inner = warm.model.model if isinstance(warm.model, Autocast) else warm.model
    with warnings.catch_warnings():
        # TP's redistribution hooks inside a checkpointed block replay the same
        # collectives in recompute (NOTE [ Order: tensor parallel, then checkpoint ])
        warnings.simplefilter("ignore", RematWarning)
        apply(inner, strategy)
    modules = dict(inner.named_modules())
    names = (set(blocks) & set(modules)) | _outside_units(inner, blocks)
    block_set = set(blocks)
    work: dict[str | None, int] = {}
    named = list(inner.named_parameters(remove_duplicate=False))
    grads: dict[str, int] = {}

    def after_op(tracker: MemoryTracker) -> None:
        if tracker.phase == "optimizer" and not grads:  # the step's gradients, all there
            grads.update((n, _nbytes(p.grad)) for n, p in named)
        if tracker.phase in ("backward", "recompute"):
            now = tracker.current_breakdown
            place = _place(tracker.current_unit, block_set)
            work[place] = max(work.get(place, 0),
                              now.get("backward", 0) + now.get("recompute", 0))

    with warm.mode, warnings.catch_warnings():
        warnings.simplefilter("ignore", RematWarning)  # recompute re-enters the units' hooks
        clear_grads(warm.model)
        tracker = tracked_step(warm._step(batch),
                               [(n, modules[n]) for n in sorted(names, key=len)],
                               after_op=after_op).tracker
    if not grads:  # no optimizer: the gradients stay after the step
        grads.update((n, _nbytes(p.grad)) for n, p in named)
    spec = get_device(device)
    recompute: dict[str | None, float] = {}
    for op in tracker.ops:
        if op.phase == "recompute":
            place = _place(op.block, block_set)
            recompute[place] = recompute.get(place, 0.0) + op_roofline_ms(op, spec)
    state: dict[str, tuple[int, int]] = {}
    opt_state = warm.optimizer.state if warm.optimizer is not None else {}
    for n, p in named:
        values = [v for v in opt_state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        state[n] = (sum(_nbytes(v) for v in values if v.dim() > 0),
                    sum(_nbytes(v) for v in values if v.dim() == 0))
    saved = tracker.block_saved_bytes
    return Record(saved=dict(saved), rest=tracker.activation_bytes - sum(saved.values()),
                   work=work, recompute_ms=recompute,
                   params={n: (_nbytes(p), grads.get(n, 0)) for n, p in named},
                   state=state, peak=tracker.peak_bytes)


def expand_record(record: Record, blocks: Sequence[str], depth: int) -> Record:
    """A record of the stack cut to ``depth`` blocks, as the full stack's: block ``i``
    takes the cut stack's first, last or (all between) second block's figures."""
    n = len(blocks)

    def rep(i: int) -> int:
        return 0 if i == 0 else depth - 1 if i == n - 1 else 1

    def rename(name: str, i: int) -> str:
        cut = blocks[rep(i)]
        return blocks[i] + name[len(cut):]

    def under(name: str | None, j: int) -> bool:
        return name is not None and (name == blocks[j] or name.startswith(blocks[j] + "."))

    def spread(values: dict[Any, Any]) -> dict[Any, Any]:
        out = {k: v for k, v in values.items() if not any(under(k, j) for j in range(depth))}
        for i in range(n):
            j = rep(i)
            out.update({rename(k, i): v for k, v in values.items() if under(k, j)})
        return out

    return Record(saved=spread(record.saved), rest=record.rest, work=spread(record.work),
                   recompute_ms=spread(record.recompute_ms), params=spread(record.params),
                   state=spread(record.state), peak=record.peak)


CUT_DEPTH = 3  # first, a middle and the last block (NOTE [ Pipeline rank bytes ])


@contextmanager
def cut_stack(model: nn.Module, depth: int) -> Iterator[None]:
    """``model``'s uniform stack of blocks cut to its first ``depth`` (NOTE [ Pipeline
    rank bytes ]) for the context, when it has one longer than ``depth``."""
    from remat.simulate.fast_rows import uniform_stack

    stack = uniform_stack(model, None)
    if stack is None or len(stack[2]) <= depth:
        yield
        return
    owner, attr, modules = stack
    whole = getattr(owner, attr)
    setattr(owner, attr, type(whole)(*modules[:depth]) if isinstance(whole, nn.Sequential)
            else nn.ModuleList(modules[:depth]))
    try:
        yield
    finally:
        setattr(owner, attr, whole)
