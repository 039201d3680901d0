"""One training step, the way every measurement in remat runs it."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from remat.blocks import BlocksSpec, named_blocks
from remat.distributed.stage_loss import StageLoss
from remat.errors import (
    BatchRejected,
    BlocksNotFound,
    RematError,
    RematWarning,
    current_call,
    message,
)

Batch = Tensor | tuple[Any, ...] | list[Any] | Mapping[str, Any]
LossFn = Callable[[Any, Any], Tensor]
PhaseCallback = Callable[[str], None]


def batch_tensors(batch: Any) -> list[Tensor]:
    """Every tensor in a batch (a tensor, or nested mappings / tuples / lists of them)."""
    if isinstance(batch, Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in batch_tensors(v)]
    if isinstance(batch, (tuple, list)):
        return [t for v in batch for t in batch_tensors(v)]
    return []


def clear_grads(model: nn.Module) -> None:
    """Drop every parameter's ``.grad`` (``zero_grad(set_to_none=True)`` without an optimizer)."""
    for p in model.parameters():
        p.grad = None


def call_model(model: nn.Module, batch: Any, *, api: str | None = None) -> Any:
    """Run ``model`` on ``batch``: ``model(**batch)`` for a mapping, ``model(*batch)`` for a
    tuple or list, ``model(batch)`` for a tensor.

    See NOTE [ A batch the model rejects ].

    Raises:
        TypeError: any other batch type.
        BatchRejected: the model raised on the batch (the model's exception chained).
    """
    api = current_call(api or "remat.run_step")  # the call the user made, where marked
    if isinstance(batch, Mapping):
        call, run = "model(**batch)", lambda: model(**batch)
    elif isinstance(batch, (tuple, list)):
        call, run = "model(*batch)", lambda: model(*batch)
    elif isinstance(batch, Tensor):
        call, run = "model(batch)", lambda: model(batch)
    else:
        raise TypeError(message(
            api, "batch must be a Tensor, a tuple/list of arguments or a dict of keyword "
            "arguments", {"found": type(batch).__name__},
            fix="pass the inputs your model's forward takes"))
    try:
        return run()
    except (TypeError, KeyError, ValueError, IndexError, RuntimeError) as exc:
        if not _rejects_the_batch(exc, batch):
            raise
        raise BatchRejected(message(
            api, f"the model raised {type(exc).__name__} when remat called it on the batch",
            {"call": f"{call} on {type(model).__name__}",
             "batch": describe_batch(batch),
             "model's error": str(exc).strip().splitlines()[0] if str(exc).strip() else "",
             },
            fix="pass a batch the model's forward takes as called above (a dict's keys "
                "become keyword arguments, a tuple's items positional ones, with the dtypes "
                "the model expects); the model's own error is chained above")) from exc


# NOTE [ A batch the model rejects ]
#     remat calls the user's model itself, so when the model raises on the batch the
#     user must learn how remat called it (which keys, which shapes) or they cannot
#     tell a wrong batch from a bug. A TypeError or KeyError (an unknown or missing
#     argument or key) always becomes BatchRejected; a ValueError, IndexError or
#     RuntimeError (a wrong dtype, a shape the model refuses) does on real tensors
#     only: on a fake copy those also mean "fake tensors cannot run this op" (data-
#     dependent shapes), which the planner handles itself. remat's own errors and an
#     out-of-memory error pass through unchanged.
def _rejects_the_batch(exc: BaseException, batch: Any) -> bool:
    if isinstance(exc, (RematError, torch.OutOfMemoryError)):
        return False
    if isinstance(exc, (TypeError, KeyError)):
        return True
    from torch._subclasses.fake_tensor import is_fake
    return not any(is_fake(t) for t in batch_tensors(batch))


def describe_batch(batch: Any) -> str:
    """Each input of ``batch`` as ``name: dtype[shape]`` (``[i]`` for a positional one)."""
    def one(value: Any) -> str:
        if isinstance(value, Tensor):
            return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
        return type(value).__name__
    if isinstance(batch, Mapping):
        return ", ".join(f"{key}: {one(value)}" for key, value in batch.items()) or "{}"
    if isinstance(batch, (tuple, list)):
        return ", ".join(f"[{i}]: {one(value)}" for i, value in enumerate(batch)) or "()"
    return one(batch)


def default_loss(output: Any, *, api: str | None = None) -> Tensor:
    """The loss remat trains on when no ``loss_fn`` is given.

    ``output.loss`` when the output has one that is not None (Hugging Face and
    remat's models); else the first element of a tuple/list output (reduced by a
    float32 mean if it is not a scalar); else ``output.float().mean()`` of a tensor
    output; else the mean of ``output.logits``, with a warning when the output has a
    ``loss`` field left None (NOTE [ A batch without labels ]).

    Raises:
        TypeError: none of the above applies; pass ``loss_fn``.
    """
    loss = getattr(output, "loss", None)
    if isinstance(loss, Tensor):
        return loss
    if hasattr(output, "loss") and isinstance(getattr(output, "logits", None), Tensor):
        # NOTE [ A batch without labels ]
        #     A Hugging Face model computes its loss only when the batch has labels;
        #     without them its output's ``loss`` is None and remat trains on the
        #     logits' mean, which holds no cross-entropy: no float32 copy of the logits,
        #     no softmax, often the step's largest tensors. A plan made that way is low
        #     for the job that trains with labels, so say so.
        warnings.warn(message(
            current_call(api or "remat.run_step"),
            f"the model's output ({type(output).__name__}) has no loss: the batch has no "
            "labels, so remat measures a step whose loss is the logits' mean",
            {"misses": "the loss the job trains with (a cross-entropy's float32 logits "
                       "and softmax are often the step's largest tensors)"},
            fix="put the labels in the batch (labels=input_ids for a causal LM), or pass "
                "loss_fn=lambda output, batch: ... computing the job's loss"),
            RematWarning, stacklevel=2)
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        first = output[0]
        return first if first.numel() == 1 else first.float().mean()
    if isinstance(output, Tensor):
        return output.float().mean()
    logits = getattr(output, "logits", None)
    if isinstance(logits, Tensor):
        return logits.float().mean()
    raise TypeError(message(
        current_call(api or "remat.run_step"),
        f"cannot derive a loss from a model output of type {type(output).__name__}",
        {"why": "no .loss, not a tensor or a tuple starting with one"},
        fix="pass loss_fn=lambda output, batch: ..."))


@dataclass(frozen=True)
class Accumulating:
    """The ``loss_fn`` of a gradient-accumulation micro-step after the first: the step
    starts with every gradient held.

    A job that steps its optimizer every ``k`` micro-batches (``zero_grad`` every ``k``
    steps) runs micro-steps 2 to ``k`` with the gradients of the ones before them alive
    through the whole forward and backward, so their peak sits up to the gradients'
    bytes above a step that starts without gradients, the step remat measures
    otherwise. With this ``loss_fn`` :func:`run_step` allocates every missing ``.grad``
    as zeros before the forward (the backward then accumulates into them) and computes
    the loss as ``loss_fn`` does; a step with an optimizer is the ``k``-th micro-step,
    the highest of them. ``remat.plan(..., accumulating=True)`` and
    ``remat.profile(..., accumulating=True)`` wrap the loss in it (:func:`step_loss`).

    Args:
        loss_fn: ``loss_fn(output, batch) -> scalar``. Default: :func:`default_loss`.

    Example:
        >>> run_step(model, batch, loss_fn=Accumulating())  # gradients held from the start
    """

    loss_fn: LossFn | None = None

    def __call__(self, output: Any, batch: Any) -> Tensor:
        """The scalar loss, as ``loss_fn`` (or :func:`default_loss`) gives it."""
        return self.loss_fn(output, batch) if self.loss_fn is not None else default_loss(output)


def is_accumulating(loss_fn: LossFn | None) -> bool:
    """Whether a step run with ``loss_fn`` (:func:`step_loss`'s) starts with its gradients
    held: an :class:`Accumulating` loss, or a :class:`StageLoss` with ``accumulating``."""
    return isinstance(loss_fn, Accumulating) or (isinstance(loss_fn, StageLoss)
                                                 and loss_fn.accumulating)


def warn_zeroed_gradients(model: nn.Module, *, accumulating: bool, api: str,
                          stacklevel: int = 4) -> None:
    """Warn where every gradient of ``model`` is allocated and zero and ``accumulating`` is
    off: the state ``optimizer.zero_grad(set_to_none=False)`` leaves, whose loop starts
    every step with the gradients held, as an accumulation micro-step does, above the
    step measured without ``accumulating``. Gradients a step left set (not zero) or
    cleared to ``None`` say nothing of the loop and are not warned about. ``stacklevel``:
    as for :func:`warnings.warn`, from this function (the user's call, past its marker).
    """
    if accumulating:
        return
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    held = [g for g in grads if g is not None]
    if not grads or len(held) < len(grads) or any(bool(torch.any(g)) for g in held):
        return
    warnings.warn(message(
        api, "every gradient of the model is allocated and zero",
        {"why": "a loop that zeroes gradients in place (optimizer.zero_grad("
                "set_to_none=False)) starts every step with them, "
                f"{sum(g.nbytes for g in held):,} B above the step measured without "
                "accumulating=True"},
        fix="pass accumulating=True to measure and plan that step, or zero the gradients "
            "with set_to_none=True (PyTorch's default)"), RematWarning, stacklevel=stacklevel)


def step_loss(loss_fn: LossFn | None, *, accumulating: bool, api: str) -> LossFn | None:
    """``loss_fn`` as a step runs it: unchanged, or with ``accumulating`` for a step that
    starts with its gradients held (a pipeline stage's :class:`StageLoss` with
    ``accumulating=True``, any other loss in :class:`Accumulating`).

    Raises:
        TypeError: ``accumulating`` is not a bool.
    """
    if not isinstance(accumulating, bool):
        raise TypeError(message(
            api, "accumulating must be True or False", {"found": repr(accumulating)},
            fix="pass accumulating=True for a job that steps its optimizer every few "
                "micro-batches (gradient accumulation), else leave it out"))
    if not accumulating or isinstance(loss_fn, Accumulating):
        return loss_fn
    if isinstance(loss_fn, StageLoss):
        return replace(loss_fn, accumulating=True)
    return Accumulating(loss_fn)


def forward_held(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> tuple[Tensor, Any]:
    """One forward of :func:`run_step`: the tensor its backward starts from (the loss, or
    a :class:`StageLoss` stage's output) and what stays alive until then (the output)."""
    output = call_model(model, batch)
    loss = loss_fn(output, batch) if loss_fn is not None else default_loss(output)
    if isinstance(loss_fn, StageLoss) and loss_fn.loss_fn is None:
        if not loss.requires_grad:
            raise ValueError(message(
                "remat.run_step", "the stage's output does not require grad, so there is "
                "nothing to backpropagate", fix="unfreeze the stage's parameters"))
        return loss, output
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise ValueError(message(
            "remat.run_step", "the loss must be a scalar Tensor",
            {"found": f"{type(loss).__name__}"
                      f"{tuple(loss.shape) if isinstance(loss, Tensor) else ''}"},
            fix="return a scalar from loss_fn (e.g. reduce it with .mean())"))
    if not loss.requires_grad:
        raise ValueError(message(
            "remat.run_step", "the loss does not require grad, so there is nothing to "
            "backpropagate", fix="unfreeze parameters, or do not detach in loss_fn"))
    return loss, output if isinstance(loss_fn, StageLoss) else None


def _backward(root: Tensor, loss_fn: LossFn | None) -> None:
    if isinstance(loss_fn, StageLoss) and loss_fn.loss_fn is None:
        # The next stage's gradient, allocated as it arrives (see StageLoss).
        torch.autograd.backward(root, torch.ones_like(root))
    else:
        root.backward()


def run_step(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    on_phase: PhaseCallback | None = None,
    microbatches_in_flight: int = 1,
) -> Tensor:
    """Run one training step: forward, loss, backward and, with an optimizer, its update.

    This is the step remat measures, times and simulates, so that all three agree
    on what a step is. Gradients accumulate into ``.grad`` as usual; with an
    optimizer they are stepped and then cleared with ``zero_grad(set_to_none=True)``
    (so the next step starts without gradient memory, as in a training loop).
    The model's output is dropped once the loss is computed, as in
    ``model(**batch).loss.backward()``: a loop that keeps its logits alive through
    backward holds them on top of what remat measures (a pipeline stage does:
    :class:`StageLoss`). With an :class:`Accumulating` loss the step starts with every
    gradient held, as a gradient-accumulation micro-step after the first does.

    With ``microbatches_in_flight=k`` the step is a pipeline stage's worst moment:
    ``k`` forwards of ``batch`` (one micro-batch), each graph kept, then the ``k``
    backwards in the same order, as a schedule holds ``k`` micro-batches before its
    first backward (NOTE [ Micro-batches in flight ] in planning/in_flight.py).

    Args:
        model: the model, in train mode.
        batch: a tensor (``model(batch)``), a tuple/list (``model(*batch)``) or a dict
            (``model(**batch)``).
        loss_fn: ``loss_fn(output, batch) -> scalar Tensor``. Default: ``output.loss``
            when present, else a mean of the output (see :func:`default_loss`).
        optimizer: stepped after backward when given. Default: ``None``.
        on_phase: called with ``"forward"``, ``"backward"``, ``"optimizer"`` (only with an
            optimizer) as each phase starts and ``"end"`` when the step is done; the
            tracker and the timers hook in here. Default: ``None``.
        microbatches_in_flight: forwards run before the first backward. Default: 1.

    Returns:
        The loss, detached (the first micro-batch's; a hidden-state stage's output).

    Raises:
        ValueError: the loss does not require grad (model in eval mode under no_grad,
            frozen parameters, or a loss_fn that detaches).

    Example:
        >>> model = torch.nn.Linear(8, 1)
        >>> loss = run_step(model, torch.randn(4, 8))
        >>> model.weight.grad.shape
        torch.Size([1, 8])
    """
    stage = loss_fn if isinstance(loss_fn, StageLoss) else None
    if isinstance(loss_fn, Accumulating) or stage is not None and stage.accumulating:
        for p in model.parameters():  # the gradients held from the step's start
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    if on_phase is not None:
        on_phase("forward")
    inputs = [t for t in batch_tensors(batch) if t.requires_grad and t.is_leaf] \
        if stage is not None and stage.sends_input_grad else []
    # in the steady state an earlier micro-batch's input gradient is still being sent
    sent = [torch.zeros_like(t) for t in inputs] if stage is not None and stage.accumulating \
        else []
    with torch.enable_grad():
        held = [forward_held(model, batch, loss_fn) for _ in range(microbatches_in_flight)]
        # the first loss is returned; a hidden state's storage must not outlive its backward
        first = held[0][0] if held[0][0].numel() == 1 else None
        if on_phase is not None:
            on_phase("backward")
        while held:
            root, output = held.pop(0)  # its output (StageLoss) is released with it
            _backward(root, loss_fn)
            del root, output
            # the previous send completes; this micro-batch's input gradient is in flight
            sent = [t.grad for t in inputs if t.grad is not None]
            for t in inputs:
                t.grad = None
        del sent
    if optimizer is not None:
        if on_phase is not None:
            on_phase("optimizer")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if on_phase is not None:
        on_phase("end")
    return first.detach() if first is not None else torch.zeros(())


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (CPU for a model without parameters).

    Example:
        >>> model_device(torch.nn.Linear(2, 2))
        device(type='cpu')
    """
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def check_runnable(model: nn.Module, *, api: str, simulate: bool = False) -> None:
    """Refuse a training step that cannot run here: gradients off, or a meta-device model.

    Args:
        model: the model.
        api: the public API, for the message.
        simulate: the step runs on fake tensors (a meta model is fine). Default: False.

    Raises:
        RematError: gradients are disabled (``torch.no_grad()``, ``torch.inference_mode()``).
        ValueError: the model is on the meta device and ``simulate`` is False.
    """
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        context = "torch.inference_mode()" if torch.is_inference_mode_enabled() \
            else "torch.no_grad()"
        raise RematError(message(
            api, "gradients are disabled here", {"active": context,
                                                 "needs": "a training step with a backward pass"},
            fix=f"call {api} outside {context}"))
    if not simulate and any(p.device.type == "meta" for p in model.parameters()):
        hint = ("pass simulate=True to run it on fake tensors" if api != "remat.validate" else
                "validation compares real gradients, so materialize it first "
                "(model.to_empty(device=...) and load its weights); to measure a meta model "
                "use remat.profile(..., simulate=True)")
        raise ValueError(message(
            api, f"{type(model).__name__} is on the meta device",
            {"why": "its tensors hold no data, so a step cannot run for real"}, fix=hint))


@dataclass(frozen=True, eq=False)
class Step:
    """What one training step is: the model, its batch, loss and optimizer, and its blocks.

    The value every stage passes along (measure, planning, validation), so the
    arguments that define a step travel together and the blocks are found once.

    Args:
        model: the model.
        batch: a tensor, a tuple/list of arguments or a dict of keyword arguments.
        loss_fn: ``loss_fn(output, batch) -> scalar``. Default: :func:`default_loss`.
        optimizer: stepped in the step when given. Default: ``None``.
        blocks: the ``blocks=`` spec (class, classes or predicate). Default: found.
        microbatches_in_flight: forwards before the first backward (a pipeline stage's
            step, see :func:`run_step`). Default: 1.

    Example:
        >>> step = Step(model, batch)
        >>> [name for name, _ in step.blocks_found()][:2]
        ['blocks.0', 'blocks.1']
    """

    model: nn.Module
    batch: Any
    loss_fn: LossFn | None = None
    optimizer: torch.optim.Optimizer | None = None
    blocks: BlocksSpec = None
    microbatches_in_flight: int = 1
    _found: dict[str, list[tuple[str, nn.Module]]] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise TypeError(message("remat", "model must be an nn.Module",
                                    {"found": type(self.model).__name__},
                                    fix="pass a torch.nn.Module"))
        if not callable(self.batch) and not isinstance(self.batch, (Tensor, Mapping, tuple, list)):
            raise TypeError(message(
                "remat", "batch must be a Tensor, a tuple/list of arguments or a dict of "
                "keyword arguments", {"found": type(self.batch).__name__,
                                      "called as": "model(batch), model(*batch), model(**batch)"},
                fix="pass the inputs your model's forward takes"))
        if isinstance(self.microbatches_in_flight, bool) or \
                not isinstance(self.microbatches_in_flight, int) or self.microbatches_in_flight < 1:
            raise ValueError(message(
                "remat", "microbatches_in_flight must be a positive integer",
                {"found": repr(self.microbatches_in_flight)},
                fix="pass the micro-batches a pipeline schedule holds at once (1 without one)"))
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise TypeError(message("remat", "loss_fn must be callable",
                                    {"found": type(self.loss_fn).__name__},
                                    fix="pass loss_fn=lambda output, batch: scalar"))

    @property
    def device(self) -> torch.device:
        """The model's device (see :func:`model_device`)."""
        return model_device(self.model)

    def blocks_found(self, *, api: str = "remat", required: bool = True
                     ) -> list[tuple[str, nn.Module]]:
        """The model's blocks as ``(qualified_name, module)``, found once per step.

        Args:
            api: the public API to prefix errors with. Default: ``"remat"``.
            required: raise when no block is found; else return ``[]`` (a model without
                repeated blocks still has a profile). Default: ``True``.

        Raises:
            BlocksNotFound: no block found and ``required`` (or an explicit ``blocks=``
                that matches nothing).
        """
        if "blocks" not in self._found:
            try:
                self._found["blocks"] = named_blocks(self.model, self.blocks, api=api)
            except BlocksNotFound:
                if required or self.blocks is not None:
                    raise
                return []
        return self._found["blocks"]

    def block_names(self, *, api: str = "remat") -> list[str]:
        """The blocks' qualified names, in forward order."""
        return [name for name, _ in self.blocks_found(api=api)]

    def with_batch(self, batch: Any) -> Step:
        """The same step on another batch (blocks are found again: the model is the same,
        but the copy is cheap and keeps the value immutable)."""
        return replace(self, batch=batch)

    def with_model(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                   batch: Any = None) -> Step:
        """The same step on another model (a fake copy, say), optimizer and batch."""
        return replace(self, model=model, optimizer=optimizer,
                       batch=self.batch if batch is None else batch)

    def run(self, on_phase: PhaseCallback | None = None) -> Tensor:
        """Run the step once (:func:`run_step`); returns the detached loss."""
        return run_step(self.model, self.batch, loss_fn=self.loss_fn, optimizer=self.optimizer,
                        on_phase=on_phase, microbatches_in_flight=self.microbatches_in_flight)
