"""Measured recompute cost: every candidate's block forward and backward, timed for real.

On a GPU the planner minimizes measured time, not the roofline: kernels for small
shapes, fused or unfused pointwise ops and launch gaps make real recompute cost
differ from any model of it. On CPU wall time is too noisy to plan with, so
:func:`remat.plan` uses the roofline there unless asked (``cost="measured"``).

NOTE [ Measured cost ]
    For each kind of block, the representative block of the *real* model is run
    forward and backward on the arguments it receives in a step (captured with a
    forward pre-hook on a forward stopped after it), once with each candidate
    applied. Candidates are timed round-robin (one run of each per round, ``warmup``
    untimed rounds, then ``repeats`` timed ones), so drift in clock speed or
    machine load hits all of them alike; each candidate's time is the median of
    its rounds. Its cost is ``max(median - median of "none", 0)``: the time its
    recomputation (or, for offload, its exposed transfers) adds to the block.
    On CUDA the clock is a pair of CUDA events around each run (kernel time).
    Parameters, gradients, buffers and RNG state are restored afterwards, and
    whatever strategy was applied to the model is put back.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch
from torch import nn

from remat.blocks import BlocksSpec, named_blocks
from remat.errors import message
from remat.measure.ledger import first_tensor
from remat.measure.state import preserved_state
from remat.measure.step import model_device
from remat.measure.timing import Clock
from remat.planning.block_run import apply_parts
from remat.planning.candidates import BlockGroup, Candidate, prune_candidates
from remat.planning.capture import capture_inputs, fresh_inputs
from remat.strategies import remove, trial

DEFAULT_REPEATS = 5
DEFAULT_WARMUP = 1


class TimingClock(Protocol):
    """What :func:`time_groups` times with (:class:`remat.measure.timing.Clock`)."""

    def mark(self) -> Any: ...
    def sync(self) -> None: ...
    def elapsed_ms(self, start: Any, end: Any) -> float: ...


def _run_once(block: nn.Module, rep: str, inputs: tuple[tuple[Any, ...], dict[str, Any]],
              clock: TimingClock) -> tuple[Any, Any]:
    """One timed forward and backward of ``block``; returns the clock's two marks."""
    for p in block.parameters():
        p.grad = None
    (args, kwargs), _ = fresh_inputs(rep, inputs)
    start = clock.mark()
    out = block(*args, **kwargs)
    y = first_tensor(out)
    if y is None or not y.requires_grad:
        raise ValueError(message("remat.plan",
                                 f"block {rep!r} returned no tensor that requires grad",
                                 {"so": "its recompute cost cannot be timed"},
                                 fix="select with blocks= modules whose output requires grad"))
    y.backward(torch.ones_like(y))
    end = clock.mark()
    del out, y, args, kwargs
    return start, end


def _time_kind(model: nn.Module, rep: str, block: nn.Module,
               inputs: tuple[tuple[Any, ...], dict[str, Any]], candidates: Sequence[Candidate],
               block_names: Sequence[str], clock: TimingClock, repeats: int,
               warmup: int) -> list[Candidate]:
    samples: list[list[float]] = [[] for _ in candidates]
    for round_ in range(warmup + repeats):
        for i, candidate in enumerate(candidates):
            apply_parts(model, rep, candidate.parts, block_names)
            try:
                start, end = _run_once(block, rep, inputs, clock)
            finally:
                remove(model)
            clock.sync()
            if round_ >= warmup:
                samples[i].append(clock.elapsed_ms(start, end))
    medians = [statistics.median(s) for s in samples]
    base = next((m for c, m in zip(candidates, medians, strict=True) if c.is_none), min(medians))
    return [replace(c, recompute_ms=0.0 if c.is_none else max(m - base, 0.0))
            for c, m in zip(candidates, medians, strict=True)]


def time_groups(
    model: nn.Module,
    batch: Any,
    groups: Sequence[BlockGroup],
    *,
    blocks: BlocksSpec = None,
    repeats: int = DEFAULT_REPEATS,
    warmup: int = DEFAULT_WARMUP,
    clock: TimingClock | None = None,
    prune: bool = True,
    progress: Callable[[str], None] | None = None,
) -> list[BlockGroup]:
    """``groups`` with every candidate's ``recompute_ms`` measured (NOTE [ Measured cost ]).

    The trade-off: the cost is what the recomputation really takes on this device
    (kernels, launches and all), at the price of ``(warmup + repeats)`` forward and
    backward runs of one block per candidate; on a noisy CPU the result is noisy too.

    Args:
        model: the real model (not fake, not on the meta device), in train mode.
        batch: its batch.
        groups: the candidates to time, from :func:`~remat.planning.candidates.measure_groups`
            (bytes are kept as measured there).
        blocks: the ``blocks=`` spec the groups were found with. Default: found.
        repeats: timed rounds per candidate, >= 1. Default: 5.
        warmup: untimed rounds first, >= 0. Default: 1.
        clock: what times the runs. Default: CUDA events on CUDA, ``perf_counter`` else.
        prune: drop candidates another one beats in every number, measured cost
            included. Default: True.
        progress: called with a short description before each kind of block. Default: None.

    Returns:
        The groups, in order, with measured costs (``none`` costs 0).

    Raises:
        ValueError: ``repeats < 1`` or ``warmup < 0``, or a model on the meta device.

    Example:
        >>> groups = time_groups(model, batch, measure_groups(setup, spec, prune=False))
        >>> groups[0].candidates[0].recompute_ms
        0.0
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(message("remat.plan",
                                 "cost timing needs repeats >= 1 and warmup >= 0",
                                 {"repeats": repeats, "warmup": warmup},
                                 fix="pass repeats >= 1 and warmup >= 0"))
    device = model_device(model)
    if device.type == "meta":
        raise ValueError(message("remat.plan", "cost='measured' runs the model, but it is on "
                                 "the meta device",
                                 fix="use cost='roofline' (the default there)"))
    named = named_blocks(model, blocks, api="remat.plan")
    modules = dict(named)
    block_names = [n for n, _ in named]
    reps = [g.names[0] for g in groups]
    unknown = [r for r in reps if r not in modules]
    if unknown:
        raise ValueError(message("remat.plan", "blocks of the measured groups are not blocks "
                                 "of the model", {"not blocks": unknown[:4],
                                                  "model's blocks":
                                                      f"{', '.join(block_names[:4])} ..."},
                                 fix="measure groups of this model's blocks"))
    clock = clock if clock is not None else Clock(device)
    wanted = [(n, m) for n, m in named if n in set(reps)]
    timed: list[BlockGroup] = []
    with preserved_state(model, None, device), trial(model, quiet=False):
        # Cut from the capture forward's graph at once, so its activations are freed.
        inputs = {name: fresh_inputs(name, captured)[0]
                  for name, captured in capture_inputs(model, batch, wanted).items()}
        for group in groups:
            rep = group.names[0]
            if progress is not None:
                progress(f"timing {len(group.candidates)} candidates of {rep}")
            costs = _time_kind(model, rep, modules[rep], inputs[rep], group.candidates,
                               block_names, clock, repeats, warmup)
            if prune:
                costs = prune_candidates(costs)
            timed.append(BlockGroup(group.names, tuple(costs)))
    return timed
