"""FSDP under pipeline parallelism: one pipeline rank's bytes over its action list.

NOTE [ FSDP under pipeline parallelism ]
    With ``dp > 1`` pipeline replicas, each stage's blocks and the stage itself (its root:
    the embedding on the first stage, the final norm and head on the last) are
    ``fully_shard``-ed groups over the ``dp`` ranks holding that stage, as torchtitan's
    ``parallelize`` does. ``torch.distributed.pipelining`` changes what FSDP does between
    micro-batches (``torch/distributed/pipelining/stage.py``):

    1. ``backward_maybe_with_nosync``, at every backward of a stage ("If submod is a FSDP
       or replicate module"): ``set_is_last_backward(False)``,
       ``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)``. FSDP's
       ``post_backward`` (``fsdp/_fully_shard/_fsdp_param_group.py``) then skips the
       reduce-scatter (``if not self.reduce_grads``) and does not reshard: the gradient
       stays on the unsharded parameter (``unsharded_param.grad``), and autograd adds
       every later micro-batch's into it. So a stage's gradients are held **unsharded**
       from its first backward to the step's end, whatever ``reshard_after_forward``.
    2. ``perform_reduce_grad``, once after the last backward (``schedules.py`` calls it
       after the action loop): ``set_reshard_after_backward(True)``,
       ``set_requires_gradient_sync(True)`` and each group's ``post_backward``, in the
       state order of the stage's FSDP tree (root first, then the blocks): reshard (free
       the unsharded parameters), allocate the reduce-scatter input (the group's
       unsharded gradients, copied in; ``_fsdp_collectives.py`` ``foreach_reduce``), drop
       the unsharded gradients, reduce-scatter into the sharded gradient (the output,
       ``1/dp`` of it, kept as ``param.grad``).
       ``reduce_scatter_max_input_buffers`` is 1: the previous group's input is freed
       before the next is allocated.
    3. Parameters: with ``reshard_after_forward=False`` (torchtitan's ``"default"``
       policy under PP: ``reshard_after_forward = not pp_enabled``) a group gathered at
       its first forward stays unsharded to ``perform_reduce_grad``: the rank holds its
       chunks' unsharded parameters from their first forward to the step's end, beside
       the shards. With ``reshard_after_forward=True`` each group reshards at the end of
       its forward (``post_forward``), so a forward holds the stage root's parameters and
       one block's at a time; but a backward leaves every group unsharded (1.), and they
       stay so until the chunk's next forward reshards them one by one, or to the step's
       end after the last backward.

    The replay (:func:`fsdp_rank_bytes`) over the rank's actions, at chunk granularity:
    static bytes are the parameter shards (``ceil(x / dp)`` per group) and the optimizer
    state shards (per-element state ``ceil(x / dp)``; step counters whole, one per
    parameter); an ``F`` adds the chunk's unsharded parameters (no reshard) or, with
    reshard, counts what the previous ``B`` left gathered at its start and the root's plus
    the largest block's during it; a ``B`` counts the chunk's parameters and gradients
    unsharded (gradients from the chunk's first ``B``) plus the held micro-batches' saved
    bytes and the chunk's working set; the end replays 2. group by group. With reshard,
    counting the whole chunk gathered through a ``B`` is an upper bound: the blocks
    gather one by one from the last, so early in the backward (where the saved bytes are
    highest) up to the chunk's parameters but the last block's are not yet gathered.
    Not modelled: the all-gather buffers (a group's flat all-gather output and its
    copied-in shard while it gathers), gloo's own copy of a reduce-scatter input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from remat.distributed.schedule import Action


@dataclass(frozen=True)
class FsdpChunk:
    """One pipeline chunk's figures for the replay (bytes per tensor-parallel rank,
    unsharded by FSDP).

    Args:
        saved: one micro-batch's saved activations through the chunk.
        work: the chunk's backward working set.
        root: (parameter, gradient) bytes of the stage root's own group (0, 0 on a chunk
            with only blocks).
        blocks: (parameter, gradient) bytes of each block's group, in order.
        moments: the optimizer's per-element state bytes of the chunk's parameters.
        scalars: the optimizer's scalar state bytes (step counters, not sharded).
    """

    saved: int
    work: int
    root: tuple[int, int]
    blocks: tuple[tuple[int, int], ...]
    moments: int
    scalars: int

    @classmethod
    def of(cls, chunk: Any) -> FsdpChunk:
        """From pipeline.py's per-chunk sums: the blocks' groups, and the root's the rest."""
        root = (chunk.params - sum(p for p, _ in chunk.blocks),
                chunk.grads - sum(g for _, g in chunk.blocks))
        return cls(saved=chunk.saved, work=chunk.work, root=root, blocks=tuple(chunk.blocks),
                   moments=chunk.state - chunk.scalars, scalars=chunk.scalars)

    @property
    def params(self) -> int:
        """Unsharded parameter bytes of the chunk."""
        return self.root[0] + sum(p for p, _ in self.blocks)

    @property
    def grads(self) -> int:
        """Unsharded gradient bytes of the chunk."""
        return self.root[1] + sum(g for _, g in self.blocks)


@dataclass(frozen=True)
class FsdpRank:
    """One pipeline rank's FSDP bytes (NOTE [ FSDP under pipeline parallelism ]).

    Args:
        param_bytes: parameter shards.
        grad_bytes: gradients as held through the step (unsharded, accumulated).
        optimizer_bytes: optimizer state shards.
        gathered_param_bytes: most unsharded parameters held at once.
        peak_bytes: the rank's peak over its actions and the final reduce-scatters.
    """

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    gathered_param_bytes: int
    peak_bytes: int


def _shard(nbytes: int, dp: int) -> int:
    return -(-nbytes // dp)  # ceil: FSDP pads dim 0 to a multiple of dp


def fsdp_rank_bytes(actions: Sequence[Action], chunks: Mapping[int, FsdpChunk], *, dp: int,
                    reshard_after_forward: bool = False) -> FsdpRank:
    """Replay one pipeline rank's actions under FSDP as ``torch.distributed.pipelining``
    runs it (NOTE [ FSDP under pipeline parallelism ]).

    Args:
        actions: the rank's actions, in order.
        chunks: the rank's chunks by chunk index.
        dp: FSDP degree (ranks holding the same stage).
        reshard_after_forward: FSDP's ``reshard_after_forward`` of every group.
            Default: ``False`` (torchtitan's default under pipeline parallelism).

    Example:
        >>> from remat.distributed.schedule import Action
        >>> chunk = FsdpChunk(saved=30, work=5, root=(0, 0), blocks=((40, 40),),
        ...                   moments=80, scalars=0)
        >>> fsdp_rank_bytes([Action(0, "F", 0), Action(0, "B", 0)], {0: chunk},
        ...                 dp=2).peak_bytes  # shards 20 + 40, params 40, grads 40, 30 + 5
        175
    """
    params = sum(_shard(p, dp) for ch in chunks.values() for p, _ in (ch.root, *ch.blocks))
    state = sum(_shard(ch.moments, dp) + ch.scalars for ch in chunks.values())
    base = params + state
    gathered = dict.fromkeys(chunks, 0)
    grads = dict.fromkeys(chunks, 0)
    held = dict.fromkeys(chunks, 0)
    peak = most_gathered = 0

    def moment(extra: int) -> None:
        nonlocal peak, most_gathered
        now = sum(gathered.values())
        most_gathered = max(most_gathered, now)
        live = sum(n * chunks[c].saved for c, n in held.items())
        peak = max(peak, base + now + sum(grads.values()) + live + extra)

    for action in actions:
        c, chunk = action.chunk, chunks[action.chunk]
        if action.kind == "F":
            if reshard_after_forward:
                moment(0)  # what the last B left gathered, before this micro-batch
                held[c] += 1
                gathered[c] = chunk.root[0] + max((p for p, _ in chunk.blocks), default=0)
                moment(0)
                gathered[c] = 0
            else:
                held[c] += 1
                gathered[c] = chunk.params
                moment(0)
        else:
            gathered[c], grads[c] = chunk.params, chunk.grads
            moment(chunk.work)
            held[c] -= 1
    out = 0  # the sharded gradients written so far
    for c, chunk in chunks.items():
        for p, g in (chunk.root, *chunk.blocks):
            gathered[c] -= min(p, gathered[c])
            moment(g + out)  # the group's reduce-scatter input, its gradients copied in
            grads[c] -= g  # freed once copied in; then the output shard
            out += _shard(g, dp)
    return FsdpRank(param_bytes=params,
                    grad_bytes=sum(ch.grads for ch in chunks.values()),
                    optimizer_bytes=state, gathered_param_bytes=most_gathered,
                    peak_bytes=peak)


def plain_rank_bytes(actions: Sequence[Action], chunks: Mapping[int, FsdpChunk], *,
                     dp: int = 1) -> FsdpRank:
    """Replay one pipeline rank's actions without FSDP, or with FSDP and no pipeline.

    Static bytes (NOTE [ Pipeline rank bytes ] in pipeline.py) plus the held
    micro-batches' saved bytes, plus a ``B``'s working set. With ``dp > 1`` (FSDP
    resharding after every forward and backward, as it does outside a pipeline) the
    static bytes are sharded ``ceil(x / dp)`` and the largest block's parameters and
    gradients are counted gathered.

    Args:
        actions: the rank's actions, in order.
        chunks: the rank's chunks by chunk index.
        dp: FSDP degree. Default: 1.

    Example:
        >>> from remat.distributed.schedule import Action
        >>> chunk = FsdpChunk(saved=30, work=5, root=(0, 0), blocks=((40, 40),),
        ...                   moments=80, scalars=0)
        >>> plain_rank_bytes([Action(0, "F", 0), Action(0, "B", 0)], {0: chunk}).peak_bytes
        195
    """
    params = sum(ch.params for ch in chunks.values())
    grads = sum(ch.grads for ch in chunks.values())
    state = sum(ch.moments + ch.scalars for ch in chunks.values())
    gathered = 0
    if dp > 1:
        gathered = max(p for ch in chunks.values() for p, _ in ch.blocks)
        params, grads, state = _shard(params, dp), _shard(grads, dp), _shard(state, dp)
    static = params + grads + state + 2 * gathered  # the running block's params and grads
    held = dict.fromkeys(chunks, 0)
    peak = static
    for action in actions:
        held[action.chunk] += action.kind == "F"
        live = sum(n * chunks[c].saved for c, n in held.items())
        peak = max(peak, static + live + (chunks[action.chunk].work if action.kind == "B"
                                          else 0))
        held[action.chunk] -= action.kind == "B"
    return FsdpRank(param_bytes=params, grad_bytes=grads, optimizer_bytes=state,
                    gathered_param_bytes=gathered, peak_bytes=peak)
