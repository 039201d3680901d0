"""Pipeline schedules: each rank's actions, and what a schedule keeps in flight.

NOTE [ Pipeline schedules ]
    A pipeline of ``p`` ranks runs ``m`` micro-batches; with ``v`` virtual stages per
    rank (interleaved schedules) the model is cut into ``p * v`` chunks of consecutive
    blocks and rank ``r`` holds chunks ``r, r + p, ..., r + (v - 1) p``. Each rank runs
    a list of actions, ``F`` (forward of one micro-batch through one chunk) and ``B``
    (its backward). Between a chunk's ``F`` and ``B`` for a micro-batch, that chunk
    keeps the micro-batch's saved activations, so a rank holds, at any point of its
    list, the saved activations of every ``(chunk, micro-batch)`` forwarded and not yet
    backwarded. The lists are those of ``torch.distributed.pipelining``:

    * ``"gpipe"`` (``ScheduleGPipe``): all ``F`` then all ``B``: every rank holds ``m``.
    * ``"1f1b"`` (``Schedule1F1B``): rank ``r`` runs ``min(m, p - r)`` forwards, then
      alternates; it holds ``min(m, p - r)``: the first rank ``p`` (at ``m >= p``), the
      last one.
    * ``"interleaved-1f1b"`` (``ScheduleInterleaved1F1B``, Narayanan et al. 2021 with
      PyTorch's rounds of ``m // max(1, m // p)`` micro-batches): rank ``r`` warms up
      with ``min((v - 1) * round + 2 (p - 1 - r), m v)`` forwards, then alternates ``F``,
      ``B``; it holds up to one more chunk-micro-batch than its warm-up.

    :func:`schedule_actions` writes the lists (``tests/distributed/test_pipeline.py`` checks
    them against PyTorch's own ``pipeline_order``); :func:`held_microbatches` counts the
    most chunk-micro-batches a rank holds. The count is what a stage's plan must budget
    for: its peak is the stage's static bytes, plus that many micro-batches' saved
    activations, plus one backward's working set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from remat.errors import message

Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b")


@dataclass(frozen=True)
class Action:
    """One pipeline action: forward (``"F"``) or backward (``"B"``) of one micro-batch
    through one chunk (``chunk = local_stage * stages + rank``)."""

    chunk: int
    kind: Literal["F", "B"]
    microbatch: int


def check_schedule(api: str, schedule: str, stages: int, microbatches: int,
                   virtual_stages: int) -> None:
    """Raise a ValueError naming ``api`` unless the schedule and its counts go together."""
    if schedule not in SCHEDULES:
        raise ValueError(message(api, f"unknown schedule {schedule!r}",
                                 {"schedules": ", ".join(SCHEDULES)},
                                 fix="pass one of those"))
    for name, value in (("stages", stages), ("microbatches", microbatches),
                        ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(message(api, f"{name} must be a positive int", {name: value},
                                     fix=f"pass {name}=1 or more"))
    if schedule != "interleaved-1f1b" and virtual_stages != 1:
        raise ValueError(message(api, f"{schedule} runs one stage per rank",
                                 {"virtual_stages": virtual_stages},
                                 fix="pass virtual_stages=1, or schedule='interleaved-1f1b'"))
    if schedule == "interleaved-1f1b":
        rounds = max(1, microbatches // stages)
        if microbatches % rounds:
            raise ValueError(message(
                api, "interleaved 1F1B needs the micro-batches to be a multiple of its rounds",
                {"microbatches": microbatches, "stages": stages,
                 "rounds": f"{rounds} (max(1, microbatches // stages))"},
                fix=f"pass microbatches={rounds * (microbatches // rounds)} or a multiple of "
                    f"{stages}"))


def _interleaved(rank: int, stages: int, microbatches: int, virtual: int) -> list[Action]:
    rounds = max(1, microbatches // stages)
    per_round = microbatches // rounds
    total = virtual * microbatches
    warmup = min((virtual - 1) * per_round + 2 * (stages - 1 - rank), total)

    def forward_chunk(step: int) -> int:
        return ((step // per_round) % virtual) * stages + rank

    def backward_chunk(step: int) -> int:
        return (virtual - 1 - ((step - warmup) // per_round) % virtual) * stages + rank

    fwd: dict[int, int] = {}
    bwd: dict[int, int] = {}
    out: list[Action] = []

    def add(kind: Literal["F", "B"], chunk: int) -> None:
        counter = fwd if kind == "F" else bwd
        out.append(Action(chunk, kind, counter.get(chunk, 0)))
        counter[chunk] = counter.get(chunk, 0) + 1

    for step in range(total + warmup):
        if step < warmup:
            add("F", forward_chunk(step))
        elif step < total:
            add("F", forward_chunk(step))
            add("B", backward_chunk(step))
        else:
            add("B", backward_chunk(step))
    return out


def schedule_actions(schedule: str, *, stages: int, microbatches: int,
                     virtual_stages: int = 1) -> tuple[tuple[Action, ...], ...]:
    """Each pipeline rank's actions in the order it runs them (idle slots left out).

    Args:
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved-1f1b"``.
        stages: pipeline ranks ``p``.
        microbatches: micro-batches per step ``m``.
        virtual_stages: chunks per rank ``v`` (interleaved only). Default: 1.

    Returns:
        One tuple of :class:`Action` per rank.

    Example:
        >>> [a.kind for a in schedule_actions("1f1b", stages=2, microbatches=3)[0]]
        ['F', 'F', 'B', 'F', 'B', 'B']
    """
    check_schedule("remat.distributed.schedule.schedule_actions", schedule, stages,
                   microbatches, virtual_stages)
    ranks: list[tuple[Action, ...]] = []
    for rank in range(stages):
        if schedule == "interleaved-1f1b":
            ranks.append(tuple(_interleaved(rank, stages, microbatches, virtual_stages)))
            continue
        fwd = [Action(rank, "F", i) for i in range(microbatches)]
        bwd = [Action(rank, "B", i) for i in range(microbatches)]
        if schedule == "gpipe":
            ranks.append(tuple(fwd + bwd))
            continue
        warmup = min(microbatches, stages - rank)
        order = fwd[:warmup]
        for i in range(microbatches - warmup):
            order += [bwd[i], fwd[warmup + i]]
        ranks.append(tuple(order + bwd[microbatches - warmup:]))
    return tuple(ranks)


def chunk_holds(actions: Sequence[Action]) -> tuple[tuple[Action, dict[int, int]], ...]:
    """Per action of one rank's list (in order), the micro-batches each of its chunks holds
    while the action runs: at an ``F`` those before it, at a ``B`` its own included (a
    chunk's ``F`` of a micro-batch holds it until that micro-batch's ``B``).

    Example:
        >>> [h for _, h in chunk_holds(schedule_actions("1f1b", stages=2, microbatches=2)[0])]
        [{0: 0}, {0: 1}, {0: 2}, {0: 1}]
    """
    held = dict.fromkeys(sorted({a.chunk for a in actions}), 0)
    out: list[tuple[Action, dict[int, int]]] = []
    for action in actions:
        out.append((action, dict(held)))
        held[action.chunk] += 1 if action.kind == "F" else -1
    return tuple(out)


def held_microbatches(schedule: str, *, stages: int, microbatches: int,
                      virtual_stages: int = 1) -> tuple[int, ...]:
    """Per pipeline rank, the most chunk-micro-batches forwarded and not yet backwarded.

    NOTE [ Pipeline schedules ]. Under ``"1f1b"`` this is ``min(m, p - r)``; under
    ``"gpipe"`` ``m``. A stage planned for one micro-batch holds this many times its
    saved activations at once, so its plan must budget for that count (the trade-off
    of a deeper pipeline: fewer bubbles, more activations held on the first ranks).

    Args:
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved-1f1b"``.
        stages: pipeline ranks ``p``.
        microbatches: micro-batches per step ``m``.
        virtual_stages: chunks per rank ``v`` (interleaved only; each unit is one
            chunk, ``1/v`` of the rank's blocks). Default: 1.

    Example:
        >>> held_microbatches("1f1b", stages=4, microbatches=8)
        (4, 3, 2, 1)
    """
    return tuple(max(sum(held.values()) + (action.kind == "F")
                     for action, held in chunk_holds(actions))
                 for actions in schedule_actions(schedule, stages=stages,
                                                 microbatches=microbatches,
                                                 virtual_stages=virtual_stages))
