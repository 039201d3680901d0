"""Capture the arguments each block is called with, and cut them loose for re-running.

The planner measures one representative block per kind on its own (candidates.py);
these helpers record the arguments blocks get in a real forward of the model and
turn them into fresh leaves the block can run on again and again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from remat.errors import BlocksNotFound, message
from remat.measure.ledger import first_tensor
from remat.measure.step import call_model
from remat.measure.tracker import MemoryTracker

BlockInputs = tuple[tuple[Any, ...], dict[str, Any]]
"""``(args, kwargs)`` a block is called with."""


class _Captured(Exception):
    """Stops the capture forward once every wanted block has been reached."""


def _shape_key(value: Any) -> Any:
    if isinstance(value, Tensor):
        return ("T", tuple(value.shape), str(value.dtype), value.requires_grad)
    if isinstance(value, (tuple, list)):
        return tuple(_shape_key(v) for v in value)
    if isinstance(value, Mapping):
        return tuple((k, _shape_key(v)) for k, v in sorted(value.items()))
    return type(value).__name__


def capture_inputs(model: nn.Module, batch: Any, blocks: Sequence[tuple[str, nn.Module]], *,
                   mode: Any = None, tracker: MemoryTracker | None = None
                   ) -> dict[str, BlockInputs]:
    """Arguments each of ``blocks`` is called with, from a forward stopped once all ran.

    The forward stops as soon as every wanted block has been called once, in whatever
    order the model runs them: registration order is only a proxy for forward order,
    and a two-tower model (CLIP runs its vision tower before its text tower, which is
    registered first) calls its stacks in another order.

    Args:
        model: the model (fake or real).
        batch: its batch.
        blocks: the ``(name, module)`` pairs whose arguments are wanted.
        mode: the fake mode, entered around the forward with a tracker (so small
            integer tensors keep their values). Default: none (a real forward).
        tracker: the tracker entered with ``mode``; pass one that records ops to read
            the forward's work from it. Default: one that records none.

    Returns:
        Per block name, its arguments; the dict is in the order the blocks were first
        called (see :func:`in_call_order`).

    Raises:
        BlocksNotFound: some blocks were not called by the forward.
    """
    captured: dict[str, BlockInputs] = {}
    wanted = {name for name, _ in blocks}

    def hook_for(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if name not in captured:
                captured[name] = (tuple(args), dict(kwargs))
            if len(captured) == len(wanted):
                raise _Captured
        return hook

    handles = [m.register_forward_pre_hook(hook_for(n), with_kwargs=True) for n, m in blocks]
    try:
        with contextlib.ExitStack() as stack:
            if mode is not None:
                stack.enter_context(mode)
                # A fake forward branches like the real one only while a tracker runs
                # (NOTE [ Data-dependent branches under fake tensors ] in shadow.py):
                # without it transformers built a 4-D mask that the whole step, tracked,
                # never builds, and every block run kept its converted copy (GPT-NeoX:
                # one hidden state per block, the peak model 1.5 MiB low on 6 layers).
                stack.enter_context(tracker or MemoryTracker(record_ops=False))
            stack.enter_context(torch.enable_grad())
            try:
                call_model(model, batch, api="remat.plan")
            except _Captured:
                pass
    finally:
        for h in handles:
            h.remove()
    missing = [n for n, _ in blocks if n not in captured]
    if missing:
        raise BlocksNotFound(message(
            "remat.plan", "blocks were not called in the model's forward, so they cannot be "
            "planned", {"not called": missing[:4]},
            fix="pass blocks= selecting the modules the forward runs"))
    return captured


def in_call_order(blocks: Sequence[tuple[str, nn.Module]], inputs: Mapping[str, BlockInputs],
                  ) -> list[tuple[str, nn.Module]]:
    """``blocks`` sorted by the order the forward first called them (``inputs``' order).

    The peak model's windows count what the blocks *before* a block saved, so the planner
    must number blocks in forward order, not registration order: the two towers of a
    CLIP model run vision first, though text is registered first.
    """
    order = {name: i for i, name in enumerate(inputs)}
    return sorted(blocks, key=lambda nm: order.get(nm[0], len(order)))


def group_key(block: nn.Module, inputs: BlockInputs) -> Any:
    params = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad)
                   for n, p in block.named_parameters())
    buffers = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in block.named_buffers())
    return (type(block), params, buffers, _shape_key(inputs[0]), _shape_key(inputs[1]))


def tensors_in(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def fresh_inputs(name: str, inputs: BlockInputs,
                 ) -> tuple[BlockInputs, Tensor]:
    """A block's arguments cut from the graph that made them, and its hidden-state input.

    Every tensor becomes a new leaf with the same ``requires_grad`` (the same tensor
    twice stays one leaf), so a block can run forward and backward again and again
    without reaching into the forward that captured its arguments: an encoder-decoder's
    ``encoder_hidden_states`` or T5's shared ``position_bias`` come from other blocks.
    The hidden state is the first tensor argument, the one activations hang from.

    Raises:
        ValueError: the block takes no tensor argument.
    """
    leaves: dict[int, Tensor] = {}

    def cut(value: Any) -> Any:
        if isinstance(value, Tensor):
            if id(value) not in leaves:
                grad = value.requires_grad and value.is_floating_point()
                leaves[id(value)] = value.detach().requires_grad_(grad)
            return leaves[id(value)]
        if isinstance(value, (tuple, list)):
            return type(value)(cut(v) for v in value)
        if isinstance(value, dict):
            return {k: cut(v) for k, v in value.items()}
        return value

    args, kwargs = inputs
    new_args, new_kwargs = tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}
    hidden = first_tensor(new_args) if new_args else first_tensor(new_kwargs)
    if hidden is None:
        raise ValueError(message("remat.plan",
                                 f"block {name!r} takes no tensor argument to plan around",
                                 fix="select with blocks= modules that take the hidden state"))
    return (new_args, new_kwargs), hidden
