"""One pipeline rank's stage chunks planned together, for the one budget of its card.

Under an interleaved schedule (``ScheduleInterleaved1F1B``) a rank runs ``v`` chunks of
the model (stages ``rank, rank + p, ...``). They share the rank's card, so they share its
budget: :func:`plan_rank` picks one plan per chunk so that the rank's peak over the
schedule fits, with the least recompute in total.

Example::

    >>> from remat.distributed.pipeline_rank import plan_rank
    >>> chunks = [LlamaStage(model, stage_index=i, stages=4).train() for i in (rank, rank + 2)]
    >>> rank_plan = plan_rank(chunks, [micro_in(i) for i in (rank, rank + 2)], budget="75%",
    ...                       schedule="interleaved-1f1b", rank=rank, stages=2,
    ...                       microbatches=4, virtual_stages=2)
    >>> for chunk, plan in zip(chunks, rank_plan.plans):
    ...     remat.apply(chunk, plan)

NOTE [ Rank peak over the schedule ]
    A rank runs its action list (``remat.distributed.schedule.schedule_actions``): ``F``
    (forward of one micro-batch through one chunk) and ``B`` (its backward). Between a
    chunk's ``F`` and ``B`` of a micro-batch the chunk keeps that micro-batch's saved
    tensors and its output (the schedule's forward cache), ``held_bytes`` under the
    chunk's plan (:func:`held_by_chunk` counts, per action, the micro-batches each chunk
    holds). Rule: the rank's bytes during an action are

    * the static bytes of all its chunks (NOTE [ Static bytes ] in remat/core/cost.py)
      less their gradients: parameters, buffers, optimizer state, one micro-batch
      input each; plus each chunk's gradients from its first ``B`` on (a
      step starts with none, ``zero_grad(set_to_none=True)``; the first ``B`` allocates
      them while it runs: counted whole during it, an upper bound);
    * the sum over its chunks of (micro-batches held x ``held_bytes``), the running
      action's own micro-batch included at a ``B``, excluded at an ``F``;
    * the running action's transient: at an ``F`` the forward's peak above its start
      (``forward_bytes``, its own held bytes included), at a ``B`` the backward's and
      recompute's peak above the held state (``backward_bytes``: the output gradient,
      the recomputed tensors, the input's and the parameters' gradients in the making);
    * the sends not yet waited for (NOTE [ Sends held ]).

    The rank's peak is the most over its actions. Each figure is measured once per chunk
    and plan by one tracked forward and backward of the chunk's fake copy (on CPU a fake
    step's bytes are a real one's, NOTE [ Closed loop on the fake copy ]). Not counted:
    receive buffers (a received input or output gradient lands in a buffer the schedule
    allocated at its first step, so the model's ``B``, which allocates its output
    gradient, is up to one boundary tensor high) and kernel scratch the dispatcher does
    not see.

NOTE [ Sends held ]
    A sent tensor stays alive until the schedule waits for its send.
    ``ScheduleInterleaved1F1B`` (PyTorch's runtime schedules) waits for every send at the
    step's end, so each ``B`` leaves its micro-batch's output (sent forward, a stage
    before the last; the ``B`` drops it from the forward cache) and its input gradient
    (sent back, a stage after the first) alive to the end: by then a rank of ``v``
    chunks holds up to ``2 v m`` boundary tensors. ``ScheduleGPipe`` waits for the
    backward sends at the end (the input gradients stay); ``Schedule1F1B`` waits for
    each before the next (one in flight, as ``StageLoss(sends_input_grad=True)`` has it).
    tests/distributed/test_stage.py measures the interleaved case on gloo.

NOTE [ Choosing the chunks' plans ]
    Each chunk gets a small Pareto set of plans: the empty plan, and ``remat.plan`` of
    the chunk (with the most micro-batches it holds at once in flight) at budgets from
    its un-checkpointed peak down to the least it reaches, evenly spaced, distinct
    plans kept. Every combination (one plan per chunk; at most ``(levels + 2) ** v`` of
    them, a few dozen) is scored by the rank peak rule above; the cheapest in recompute
    (``Plan.recompute_ms`` summed) whose peak fits wins, the lower peak on ties. The
    rank's un-checkpointed peak (every chunk's empty plan) is what ``"75%"`` is of.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.core.budget import Budget, BudgetLike, parse_budget
from remat.core.cost import static_bytes
from remat.distributed.schedule import Action, chunk_holds, schedule_actions
from remat.distributed.stage_loss import StageLoss
from remat.errors import BudgetTooSmall, message, names_the_call
from remat.measure.ledger import categorized
from remat.measure.step import LossFn, batch_tensors, clear_grads, forward_held
from remat.measure.tracked_step import held_gc
from remat.measure.tracker import MemoryTracker
from remat.measure.windows import FakeSetup
from remat.planning.plans import Plan
from remat.strategies import trial

__all__ = ["ChunkBytes", "RankPlan", "held_by_chunk", "plan_rank", "rank_peak_bytes"]

API = "remat.distributed.pipeline_rank.plan_rank"
#: Budgets per chunk between its least reachable and its un-checkpointed peak
#: (NOTE [ Choosing the chunks' plans ]), the empty plan besides.
LEVELS = 3


@dataclass(frozen=True)
class ChunkBytes:
    """One chunk's bytes under one plan (NOTE [ Rank peak over the schedule ]), bytes.

    Args:
        static_bytes: its static bytes (NOTE [ Static bytes ] in remat/core/cost.py):
            parameters, buffers, gradients, optimizer state and one micro-batch input.
        grad_bytes: the gradients of its trainable parameters, part of ``static_bytes``.
        held_bytes: what one micro-batch keeps from its ``F`` to its ``B``.
        forward_bytes: an ``F``'s peak above its start (its held bytes included).
        backward_bytes: a ``B``'s peak above the bytes alive when it starts.
        sent_output_bytes: the output an ``F`` sends to the next stage (0 for the
            last stage, whose loss is computed where it runs). Default: 0.
        sent_grad_bytes: the input gradient a ``B`` sends back (0 for the first stage).
            Default: 0.
        recompute_ms: the plan's recompute cost per micro-batch, ms. Default: 0.
    """

    static_bytes: int
    grad_bytes: int
    held_bytes: int
    forward_bytes: int
    backward_bytes: int
    sent_output_bytes: int = 0
    sent_grad_bytes: int = 0
    recompute_ms: float = 0.0

    def __post_init__(self) -> None:
        sizes = (self.static_bytes, self.grad_bytes, self.held_bytes, self.forward_bytes,
                 self.backward_bytes, self.sent_output_bytes, self.sent_grad_bytes)
        if min(sizes) < 0 or not self.recompute_ms >= 0:
            raise ValueError(message("ChunkBytes", "bytes and recompute_ms must be >= 0",
                                     {"bytes": sizes, "recompute_ms": self.recompute_ms},
                                     fix="pass one chunk's measured figures"))
        if self.grad_bytes > self.static_bytes:
            raise ValueError(message("ChunkBytes", "grad_bytes exceeds static_bytes",
                                     {"grad_bytes": self.grad_bytes,
                                      "static_bytes": self.static_bytes},
                                     fix="static_bytes counts the gradients too"))

    @property
    def before_backward_bytes(self) -> int:
        """The static bytes before the chunk's first ``B``: ``static_bytes`` less its
        gradients (a step starts with none)."""
        return self.static_bytes - self.grad_bytes


@dataclass(frozen=True)
class RankPlan:
    """The plans of one pipeline rank's chunks, chosen together for one budget.

    Args:
        plans: one :class:`~remat.Plan` per chunk, in the order the chunks were given.
        chunk_bytes: each chosen plan's :class:`ChunkBytes`.
        budget_bytes: the rank's budget, bytes.
        peak_bytes: the rank's peak over its schedule under ``plans`` (NOTE [ Rank peak
            over the schedule ]), bytes.
        no_checkpoint_peak_bytes: the same with every chunk's empty plan, bytes.
        recompute_ms: the plans' recompute per micro-batch through all chunks, ms.
    """

    plans: tuple[Plan, ...]
    chunk_bytes: tuple[ChunkBytes, ...]
    budget_bytes: int
    peak_bytes: int
    no_checkpoint_peak_bytes: int
    recompute_ms: float

    def __post_init__(self) -> None:
        if len(self.plans) != len(self.chunk_bytes) or self.peak_bytes > self.budget_bytes:
            raise ValueError(message(
                "RankPlan", "one ChunkBytes per plan, and a peak within the budget",
                {"plans": len(self.plans), "chunk_bytes": len(self.chunk_bytes),
                 "peak_bytes": self.peak_bytes, "budget_bytes": self.budget_bytes},
                fix="build it with plan_rank"))


def held_by_chunk(schedule: str, *, rank: int, stages: int, microbatches: int,
                  virtual_stages: int = 1) -> tuple[tuple[Action, Mapping[int, int]], ...]:
    """Per action of ``rank`` (in order), the micro-batches each of its chunks holds while
    the action runs: at an ``F`` those before it, at a ``B`` its own included.

    A chunk's ``F`` of a micro-batch adds one held micro-batch until that micro-batch's
    ``B`` through the chunk (NOTE [ Rank peak over the schedule ]).

    Args:
        schedule, stages, microbatches, virtual_stages: the pipeline, as for
            :func:`remat.distributed.schedule.schedule_actions`.
        rank: the pipeline rank, ``0 .. stages - 1``.

    Example:
        >>> [dict(h) for _, h in held_by_chunk("1f1b", rank=0, stages=2, microbatches=2)]
        [{0: 0}, {0: 1}, {0: 2}, {0: 1}]
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < stages:
        raise ValueError(message("remat.distributed.pipeline_rank.held_by_chunk",
                                 "rank must be in 0 .. stages - 1",
                                 {"rank": rank, "stages": stages},
                                 fix="pass the pipeline rank whose actions to count"))
    return chunk_holds(schedule_actions(schedule, stages=stages, microbatches=microbatches,
                                        virtual_stages=virtual_stages)[rank])


def rank_peak_bytes(moments: Sequence[tuple[Action, Mapping[int, int]]],
                    chunk_bytes: Mapping[int, ChunkBytes], *, schedule: str) -> int:
    """The rank's peak over its actions (NOTE [ Rank peak over the schedule ]), bytes.

    Args:
        moments: :func:`held_by_chunk` of the rank.
        chunk_bytes: per chunk (stage index), its bytes under its plan.
        schedule: the schedule the moments are of (its sends, NOTE [ Sends held ]).

    Example:
        >>> rank_peak_bytes(held_by_chunk("gpipe", rank=0, stages=1, microbatches=2),
        ...                 {0: ChunkBytes(14, 4, 3, 5, 6)}, schedule="gpipe")
        26
    """
    static = sum(c.before_backward_bytes for c in chunk_bytes.values())
    peak = static
    backwarded: set[int] = set()
    sent: dict[int, int] = {}  # bytes of each chunk's sends not yet waited for
    for action, held in moments:
        chunk = chunk_bytes[action.chunk]
        if action.kind == "B":
            backwarded.add(action.chunk)  # its first B allocates the gradients
        grads = sum(chunk_bytes[c].grad_bytes for c in backwarded)
        live = sum(n * chunk_bytes[c].held_bytes for c, n in held.items())
        work = chunk.forward_bytes if action.kind == "F" else chunk.backward_bytes
        peak = max(peak, static + grads + live + sum(sent.values()) + work)
        if action.kind == "B":
            sent[action.chunk] = _sent_after_backward(schedule, chunk,
                                                      sent.get(action.chunk, 0))
    return peak


def _sent_after_backward(schedule: str, chunk: ChunkBytes, before: int) -> int:
    """A chunk's unwaited sends after one more ``B`` (NOTE [ Sends held ])."""
    if schedule == "1f1b":  # the previous send is waited for; this one is in flight
        return chunk.sent_grad_bytes
    if schedule == "gpipe":  # every input gradient, waited for at the step's end
        return before + chunk.sent_grad_bytes
    # the runtime schedules wait for every send at the step's end: the output, released
    # from the forward cache by this B, and the input gradient stay until then
    return before + chunk.sent_output_bytes + chunk.sent_grad_bytes


def measure_chunk(setup: FakeSetup, plan: Plan, loss_fn: LossFn, *,
                  sent_grad_bytes: int = 0) -> ChunkBytes:
    """:class:`ChunkBytes` of one forward and backward of the chunk's fake copy with
    ``plan`` applied (NOTE [ Rank peak over the schedule ]); the copy is restored.

    Args:
        setup: the chunk's fake copy (``PlanContext.setup``).
        plan: the chunk's plan.
        loss_fn: the chunk's :class:`~remat.distributed.stage_loss.StageLoss`.
        sent_grad_bytes: the input gradient a ``B`` sends back, bytes (the real
            micro-batch's inputs that require grad). Default: 0.
    """
    model, batch = setup.model, setup.batch
    with trial(model, plan.decisions, blocks=plan.blocks, within=setup.mode):
        clear_grads(model)
        tracker = MemoryTracker(device=setup.device, blocks=setup.blocks)
        tracker.register_step(model, setup.optimizer, batch_tensors(batch))
        static = static_bytes(categorized(tracker.current_breakdown))  # no gradients yet
        try:
            with held_gc(), tracker, torch.enable_grad():
                for p in model.parameters():
                    if p.requires_grad:
                        p.grad = torch.zeros_like(p)  # the steady state's gradients
                base = tracker.current_bytes
                tracker.set_phase("forward")
                root, output = forward_held(model, batch, loss_fn)
                held = tracker.current_bytes - base
                sent_output = tracker.bytes_of([root]) if output is not None \
                    and isinstance(loss_fn, StageLoss) and loss_fn.loss_fn is None else 0
                tracker.set_phase("backward")
                start = tracker.current_bytes
                if isinstance(loss_fn, StageLoss) and loss_fn.loss_fn is None:
                    # the next chunk's gradient, arriving as the backward starts
                    torch.autograd.backward(root, torch.ones_like(root))
                else:
                    root.backward()
                del root, output
                peaks = tracker.phase_peaks
        finally:
            clear_grads(model)
            for t in batch_tensors(batch):
                t.grad = None
    backward = max(peaks[p].peak_bytes for p in ("backward", "recompute") if p in peaks)
    grads = base - static  # made above, not by backward: not the tracker's gradients
    return ChunkBytes(static_bytes=static + grads, grad_bytes=grads, held_bytes=held,
                      forward_bytes=peaks["forward"].peak_bytes - base,
                      backward_bytes=backward - start, sent_output_bytes=sent_output,
                      sent_grad_bytes=sent_grad_bytes,
                      recompute_ms=plan.recompute_ms)


def _pareto(chunk: nn.Module, micro_batch: Any, loss_fn: LossFn, in_flight: int,
            levels: int, plan_kwargs: Mapping[str, Any]) -> list[tuple[Plan, ChunkBytes]]:
    """The chunk's candidate plans and their bytes (NOTE [ Choosing the chunks' plans ])."""
    from remat.planning.context import prepare
    from remat.planning.planner import derived_budgets, plan

    prep = {k: plan_kwargs[k] for k in ("optimizer", "blocks", "device", "cost")
            if k in plan_kwargs}
    ctx = prepare(chunk, micro_batch, loss_fn=loss_fn, microbatches_in_flight=in_flight,
                  stand_in=False, **prep)
    assert ctx.setup is not None

    def at(budget: int) -> Plan:
        with derived_budgets():  # a share of the rank's budget
            return plan(chunk, micro_batch, budget=budget, loss_fn=loss_fn,
                        microbatches_in_flight=in_flight, context=ctx, **plan_kwargs)

    top = ctx.no_checkpoint_peak_bytes
    plans = [at(2 * top)]  # above the un-checkpointed peak: the empty plan
    low = top
    try:
        plans.append(at(1))  # only a chunk that allocates nothing fits one byte
    except BudgetTooSmall as error:
        low = error.min_peak_bytes
    try:
        plans.append(at(low))
    except BudgetTooSmall as error:  # the allocator's peak of that choice is a little higher
        low = error.min_peak_bytes
        plans.append(at(low))
    for i in range(1, levels):
        budget = low + (top - low) * i // levels
        try:
            plans.append(at(budget))
        except BudgetTooSmall:
            continue
    sent = sum(t.numel() * t.element_size() for t in batch_tensors(micro_batch)
               if t.requires_grad)
    out: dict[tuple[tuple[str, str], ...], tuple[Plan, ChunkBytes]] = {}
    for p in plans:
        key = tuple(sorted((k, repr(v)) for k, v in p.decisions.items()))
        if key not in out:
            out[key] = (p, measure_chunk(ctx.setup, p, loss_fn, sent_grad_bytes=sent))
    return list(out.values())


@names_the_call(API)
def plan_rank(chunks: Sequence[nn.Module], micro_batches: Sequence[Any], *,
              budget: BudgetLike | Budget, schedule: str, rank: int, stages: int,
              microbatches: int, virtual_stages: int, loss_fn: LossFn | None = None,
              levels: int = LEVELS, **plan_kwargs: Any) -> RankPlan:
    """Plans for the chunks one pipeline rank runs, chosen together for its one budget.

    Planning each chunk for its own budget (:func:`~remat.distributed.stage.plan_stage`)
    ignores that a rank's chunks share a card, and that they hold their micro-batches at
    different moments of the schedule. This plans them jointly: the rank's peak is
    modeled over its whole action list (NOTE [ Rank peak over the schedule ]) for every
    combination of a few plans per chunk, and the least recompute that fits wins (NOTE
    [ Choosing the chunks' plans ]). It costs one ``remat.prepare`` and about
    ``levels + 2`` closed-loop plans per chunk; the model leaves out receive buffers and
    kernel scratch, so measure the schedule's peak once (tests/distributed/test_stage.py
    does) and keep a margin.

    Args:
        chunks: the rank's chunk modules (train mode), stage ``rank + i * stages`` at
            index ``i``, e.g. :class:`~remat.distributed.stage.LlamaStage`.
        micro_batches: one micro-batch of each chunk's input (token ids for stage 0, a
            hidden state requiring grad for later ones).
        budget: the rank's peak on its card: bytes, ``"12GiB"``, or ``"75%"`` of the
            rank's un-checkpointed peak over the schedule.
        schedule, stages, microbatches, virtual_stages: the pipeline (``stages`` ranks).
        rank: this pipeline rank, ``0 .. stages - 1``.
        loss_fn: the last stage's ``loss_fn(output, micro_batch) -> scalar``. Default:
            ``None`` (its output's mean).
        levels: budgets tried per chunk between its least and its un-checkpointed peak.
            Default: 3.
        **plan_kwargs: passed on to :func:`remat.plan` (``blocks``, ``device``, ``cost``,
            ``optimizer`` for a one-chunk rank).

    Returns:
        A :class:`RankPlan`: ``plans[i]`` for ``chunks[i]``, ``peak_bytes <= budget_bytes``.

    Raises:
        ValueError: ``len(chunks)`` or ``len(micro_batches)`` is not ``virtual_stages``,
            a bad rank, or ``levels < 1``.
        BudgetTooSmall: no combination fits; the message gives the least rank peak.

    Example:
        >>> rank_plan = plan_rank(chunks, micro_batches, budget="75%",
        ...                       schedule="interleaved-1f1b", rank=0, stages=2,
        ...                       microbatches=4, virtual_stages=2)
        >>> rank_plan.peak_bytes <= rank_plan.budget_bytes
        True
    """
    from remat.distributed.stage import stage_loss

    if len(chunks) != virtual_stages or len(micro_batches) != virtual_stages:
        raise ValueError(message(
            API, "one chunk and one micro-batch per virtual stage",
            {"chunks": len(chunks), "micro_batches": len(micro_batches),
             "virtual_stages": virtual_stages},
            fix=f"pass the rank's chunks (stages {rank}, {rank} + {stages}, ...) and one "
                "input micro-batch for each"))
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
        raise ValueError(message(API, "levels must be an integer >= 1", {"levels": levels},
                                 fix="pass levels=3 (the default) or so"))
    moments = held_by_chunk(schedule, rank=rank, stages=stages, microbatches=microbatches,
                            virtual_stages=virtual_stages)
    ids = [rank + v * stages for v in range(virtual_stages)]
    options = []
    for chunk_id, chunk, micro in zip(ids, chunks, micro_batches, strict=True):
        in_flight = max(max(h[chunk_id] for _, h in moments), 1)
        chunk_loss = stage_loss(schedule, stage_index=chunk_id,
                                chunks=stages * virtual_stages, in_flight=in_flight,
                                microbatches=microbatches, loss_fn=loss_fn)
        options.append(_pareto(chunk, micro, chunk_loss, in_flight, levels, plan_kwargs))
    empty = dict(zip(ids, (o[0][1] for o in options), strict=True))
    no_checkpoint = rank_peak_bytes(moments, empty, schedule=schedule)
    static = sum(c.static_bytes for c in empty.values())
    budget_bytes = parse_budget(budget).resolve(no_checkpoint, static_bytes=static)
    best: tuple[float, int, tuple[tuple[Plan, ChunkBytes], ...]] | None = None
    least = no_checkpoint
    for combo in itertools.product(*options):
        peak = rank_peak_bytes(moments, dict(zip(ids, (b for _, b in combo), strict=True)),
                               schedule=schedule)
        least = min(least, peak)
        cost = sum(p.recompute_ms for p, _ in combo)
        if peak <= budget_bytes and (best is None or (cost, peak) < best[:2]):
            best = (cost, peak, combo)
    if best is None:
        raise BudgetTooSmall(message(
            API, "no combination of the chunks' plans fits the rank's budget",
            {"budget": f"{budget_bytes:,} B", "least rank peak": f"{least:,} B",
             "un-checkpointed rank peak": f"{no_checkpoint:,} B",
             "chunks": f"{len(ids)} (stages {', '.join(map(str, ids))})"},
            fix=f"raise the budget to {least:,} B or more, use more micro-batches of "
                "fewer samples, or more pipeline ranks"),
            budget_bytes=budget_bytes, min_peak_bytes=least)
    cost, peak, combo = best
    return RankPlan(plans=tuple(p for p, _ in combo), chunk_bytes=tuple(b for _, b in combo),
                    budget_bytes=budget_bytes, peak_bytes=peak,
                    no_checkpoint_peak_bytes=no_checkpoint, recompute_ms=cost)
