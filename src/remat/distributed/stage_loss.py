"""The ``loss_fn`` of a pipeline stage: how a stage's step differs from a whole model's.

:func:`remat.measure.step.run_step` runs a stage's step when given a :class:`StageLoss`
(the output held until its backward, the received gradient, the input gradient sent); the
pipeline planners (:mod:`remat.distributed.stage`, :mod:`remat.distributed.pipeline_rank`)
build one per stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from remat.errors import message


@dataclass(frozen=True)
class StageLoss:
    """The ``loss_fn`` of a pipeline stage: the stage's output stays alive until its backward.

    A ``torch.distributed.pipelining`` stage keeps each micro-batch's output in its
    forward cache until that micro-batch's backward (``PipelineStage.fwd_cache``), so
    its output costs memory that :func:`~remat.measure.step.run_step` (which drops the
    output once the loss exists) does not hold. A stage that is not the last has no loss at all: its
    backward starts from the gradient the next stage sends, a tensor of the output's
    shape that arrives when the backward starts. ``StageLoss`` makes a step run that
    way: the output is held until the backward; without ``loss_fn`` the backward is
    ``torch.autograd.backward(output, ones_like(output))`` with the gradient allocated
    at that moment, as the pipeline's received gradient is.

    In 1F1B's steady state a stage runs its forwards after an earlier micro-batch's
    backward, so every gradient already exists while its micro-batches are in flight;
    ``accumulating=True`` starts the step that way (each missing ``.grad`` allocated as
    zeros before the first forward; the backwards then accumulate into them).

    A stage after the first sends each micro-batch's input gradient back to the previous
    stage; 1F1B sends it asynchronously and keeps it until the send completes, during
    the next micro-batch's work. ``sends_input_grad=True`` makes the step do the same:
    after each backward the inputs' gradients are taken off the inputs (the next
    backward allocates new ones) and held until the next backward has run; with
    ``accumulating`` the step starts with one such gradient in flight (an earlier
    micro-batch's).

    Args:
        loss_fn: ``loss_fn(output, batch) -> scalar`` of the last stage; ``None`` for a
            stage whose output is a hidden state. Default: ``None``.
        accumulating: the gradients exist before the forwards. Default: ``False``.
        sends_input_grad: hold each input gradient through the next backward, as an
            asynchronous send does. Default: ``False``.

    Example:
        >>> run_step(first_stage, tokens, loss_fn=StageLoss())   # output (B, T, D)
        >>> run_step(last_stage, hidden, loss_fn=StageLoss(lambda out, _: out.mean()))
    """

    loss_fn: Callable[[Any, Any], Tensor] | None = None
    accumulating: bool = False
    sends_input_grad: bool = False

    def __call__(self, output: Any, batch: Any) -> Tensor:
        """The scalar loss, or for a hidden-state stage the output tensor itself."""
        if self.loss_fn is not None:
            return self.loss_fn(output, batch)
        if isinstance(output, Tensor):
            return output
        first = output[0] if isinstance(output, (tuple, list)) and output else None
        if isinstance(first, Tensor):
            return first
        raise TypeError(message(
            "remat.run_step", f"a pipeline stage's output of type {type(output).__name__} "
            "has no tensor to backpropagate from",
            fix="return a tensor (or a tuple starting with one) from the stage's forward"))
