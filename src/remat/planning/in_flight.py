"""Micro-batches in flight: the peak model of a pipeline stage that holds several at once.

NOTE [ Micro-batches in flight ]
    A pipeline schedule runs a stage's forward on several micro-batches before their
    backwards: under GPipe a stage holds all ``m``, under 1F1B the first of ``p`` stages
    holds ``min(m, p - s)`` at stage ``s`` (``remat.distributed.schedule.held_microbatches``
    counts them for each schedule). Rule: the stage's step with ``k`` in flight is ``k``
    forwards of one micro-batch, each graph kept, then the ``k`` backwards
    (``Step(microbatches_in_flight=k)``, :func:`~remat.measure.step.run_step`); its
    worst moment is the first backward, with ``k - 1`` other micro-batches held whole.
    Implication: every window of the one-micro-batch step (NOTE [ Peak model ]) holds,
    on top, ``k - 1`` copies of what one micro-batch keeps from its forward to its
    backward: the saved bytes of every block under the choice, plus ``held_bytes``,
    what no decision changes (the embedding's and the head's saved tensors, the
    stage's output a schedule keeps for the backward). The optimizer's window holds
    none (every backward is done). ``held_bytes`` is measured once on the fake copy:
    the live bytes after one forward less the blocks' saved bytes without
    checkpointing. The peak model then reads ``held_copies = k - 1`` (remat.core.peak),
    still linear in the choice, so the solver's program keeps its form (its prefix
    dynamic program does not apply: every window reads every block).
    What the rule leaves out: a later backward starts with the gradients of the whole
    stage already allocated (1F1B's steady state), where the first backward allocates
    them as it goes. The closed loop measures the stage's step as defined above, so the
    plan fits that step; tests/distributed/test_stage.py checks the schedule's own
    peak against the budget.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from remat.core.peak import PeakModel
from remat.errors import message
from remat.measure.step import LossFn, batch_tensors, forward_held
from remat.measure.tracked_step import held_gc
from remat.measure.tracker import MemoryTracker
from remat.measure.windows import FakeSetup
from remat.planning.candidates import Candidate


def check_in_flight(microbatches_in_flight: Any, *, api: str = "remat.plan") -> int:
    """``microbatches_in_flight`` when it is an integer >= 1.

    Raises:
        ValueError: anything else.
    """
    if isinstance(microbatches_in_flight, bool) or not isinstance(microbatches_in_flight, int) \
            or microbatches_in_flight < 1:
        raise ValueError(message(
            api, "microbatches_in_flight must be an integer >= 1",
            {"found": repr(microbatches_in_flight)},
            fix="pass how many micro-batches the stage holds at once "
                "(remat.distributed.schedule.held_microbatches), 1 without a pipeline"))
    return microbatches_in_flight


def forward_held_bytes(setup: FakeSetup, *, loss_fn: LossFn | None) -> int:
    """Bytes one micro-batch keeps from its forward to its backward (every block
    un-checkpointed), measured by one tracked forward of the fake copy, bytes."""
    model, batch = setup.model, setup.batch
    with setup.mode:
        tracker = MemoryTracker(device=setup.device, blocks=setup.blocks)
        tracker.register_step(model, setup.optimizer, batch_tensors(batch))
        before = tracker.current_bytes
        with held_gc(), tracker:
            tracker.set_phase("forward")
            held = forward_held(model, batch, loss_fn)
            after = tracker.current_bytes
        del held
    return after - before


def in_flight_model(peak_model: PeakModel[Candidate], microbatches_in_flight: int,
                    forward_bytes: int) -> PeakModel[Candidate]:
    """``peak_model`` with ``microbatches_in_flight - 1`` other micro-batches held
    (NOTE [ Micro-batches in flight ]).

    Args:
        peak_model: the calibrated one-micro-batch peak model (held_copies 0).
        microbatches_in_flight: micro-batches the stage holds at its worst moment.
        forward_bytes: :func:`forward_held_bytes` of the step, bytes.

    Example:
        >>> in_flight_model(pm, 3, forward_held_bytes(setup, loss_fn=None)).held_copies
        2
    """
    none_saved = sum(table[0].saved_bytes for table in peak_model.tables)  # "none" first
    return replace(peak_model, held_copies=microbatches_in_flight - 1,
                   held_bytes=max(forward_bytes - none_saved, 0))
