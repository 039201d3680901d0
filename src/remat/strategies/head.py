"""The chunked output head: the output projection and the next-token loss over chunks of
tokens, each chunk's logits recomputed in backward.

At long context the output projection (hidden -> vocabulary) and its cross entropy hold
the largest tensors of a step: ``tokens x vocab`` logits, upcast to float32 for the loss,
the log-softmax the loss saves, and their gradients. Block strategies never touch them (the
head runs after the last block). Here the head and the loss run on ``chunks`` slices of the
tokens, each under non-reentrant ``torch.utils.checkpoint``: a chunk keeps only its hidden
states (a view of the last hidden state, alive anyway), so at most one chunk's logits exist
at a time, in forward and in backward.

NOTE [ Chunked head ]
    Rule 1. The loss is the model's own, reproduced exactly: the same ops on the same rows
    (``lm_head`` in the model's dtype, Gemma2's ``final_logit_softcapping`` in that dtype,
    ``.float()``, cross entropy with ``ignore_index``), summed per chunk and divided once
    by the number of non-ignored targets (or the ``num_items_in_batch`` a Hugging Face
    trainer passes). Only the order of the sums differs, so the loss and every gradient
    match the model's to float rounding. Targets are the labels shifted by one with the
    ignore index appended (Hugging Face's ``ForCausalLMLoss``); the built-in models'
    ``logits[:, :-1]`` against ``labels[:, 1:]`` is the same sum, since the appended
    target is ignored.
    Rule 2. The model's forward runs as it is, with ``labels`` held back: the instance
    ``forward`` (a :class:`~remat.strategies.runtime.BoundForward`, picklable) gives the
    output head a forward for the length of the call that records its input and returns
    an empty ``(..., 0)`` tensor, so the forward builds no logits and computes no loss.
    The loss is then computed from the recorded input, and the output carries it with
    ``logits=None``. Without labels the model runs untouched (full logits, for
    generation and evaluation).
    Rule 3. What cannot be reproduced is refused, never approximated: a model whose loss
    is not next-token cross entropy (apply time), a head that is not a plain
    ``nn.Linear``, a forward that calls the head more than once, labels that do not line
    up with the head's input (``logits_to_keep``), or logits changed after the head other
    than by ``final_logit_softcapping`` (the output's logits are then not the empty tensor
    the head returned; Cohere's ``logit_scale``, for one) (run time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from remat.errors import StrategyError, message
from remat.recompute import recomputing
from remat.strategies.runtime import BoundForward

#: The decision key of the output head in a plan's decisions (NOTE [ Decision keys ]).
HEAD_KEY = "<head>"
IGNORE_INDEX = -100  # Hugging Face's and the built-in models' ignored label

_STATE = "_remat_head"  # on the model: HeadInfo
_PREV_FORWARD = "_remat_head_prev_forward"  # an instance forward the model already had
_RECORDED = "_remat_head_recorded"  # on the output head, during one call: its inputs
_API = "chunked_head"


@dataclass(frozen=True)
class HeadInfo:
    """What the chunked head installed on a model (kept in the model's ``__dict__``).

    Args:
        chunks: slices of the tokens the head and the loss run on, >= 1.
        label: the decision it implements, e.g. ``"chunked_head:8"``.
    """

    chunks: int
    label: str


def output_head(model: nn.Module) -> nn.Module | None:
    """The model's output projection: ``get_output_embeddings()`` (Hugging Face), else its
    ``lm_head`` attribute (the built-in models), else ``None``."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else getattr(model, "lm_head", None)
    return head if isinstance(head, nn.Module) else None


def _loss_kind(model: nn.Module) -> str | None:
    """Why the model's loss is next-token cross entropy, or ``None`` when it is not known."""
    from remat.models.gpt import GPT
    from remat.models.llama import Llama

    if isinstance(model, (GPT, Llama)):
        return "built-in"
    name = type(model).__name__
    loss_function = getattr(model, "loss_function", None)
    if loss_function is None or not (name.endswith("ForCausalLM") or (
            name.endswith("LMHeadModel") and "DoubleHeads" not in name)):
        return None
    from transformers.loss.loss_utils import ForCausalLMLoss

    return "hf" if loss_function is ForCausalLMLoss else None


def check_head(model: nn.Module, *, api: str = "remat.apply") -> None:
    """Refuse a model whose output head and loss the chunked head cannot reproduce.

    Raises:
        StrategyError: no plain ``nn.Linear`` output head, or a loss that is not
            next-token cross entropy (NOTE [ Chunked head ], Rule 3).
    """
    head = output_head(model)
    if head is None or type(head) is not nn.Linear:
        raise StrategyError(message(
            api, f"chunked_head needs a plain nn.Linear output head on {type(model).__name__}",
            {"found": "no output head (get_output_embeddings() / lm_head)" if head is None
             else f"{type(head).__name__}"},
            fix="use chunked_head on a causal LM whose lm_head is an nn.Linear"))
    if _loss_kind(model) is None:
        custom = getattr(model, "_loss_function", None)
        raise StrategyError(message(
            api, f"chunked_head cannot reproduce the loss of {type(model).__name__}",
            {"supported": "Hugging Face *ForCausalLM / *LMHeadModel with the default "
                          "ForCausalLMLoss, remat's built-in GPT and Llama",
             **({"loss_function": repr(custom)} if custom is not None else {})},
            fix="use chunked_head on a causal LM trained with next-token cross entropy"))


def install_head(model: nn.Module, *, chunks: int, label: str) -> None:
    """Make ``model``'s forward compute its head and loss in ``chunks`` (NOTE [ Chunked
    head ]); replaces a chunked head already there.

    Raises:
        StrategyError: see :func:`check_head`.
    """
    check_head(model)
    uninstall_head(model)
    previous = model.__dict__.get("forward")
    if previous is not None:
        model.__dict__[_PREV_FORWARD] = previous
    model.__dict__["forward"] = BoundForward(model, _chunked_forward)
    model.__dict__[_STATE] = HeadInfo(chunks=chunks, label=label)


def head_of(model: nn.Module) -> HeadInfo | None:
    """The chunked head installed on ``model``, or ``None``."""
    info = model.__dict__.get(_STATE)
    return info if isinstance(info, HeadInfo) else None


def uninstall_head(model: nn.Module) -> None:
    """Give ``model`` its own forward back (no-op when no chunked head is installed)."""
    if model.__dict__.pop(_STATE, None) is None:
        return
    model.__dict__.pop("forward", None)
    previous = model.__dict__.pop(_PREV_FORWARD, None)
    if previous is not None:
        model.__dict__["forward"] = previous


def head_attributes(model: nn.Module) -> dict[str, Any]:
    """The instance attributes the chunked head put on ``model``, to put back after
    :func:`uninstall_head` (``model.__dict__.update(saved)``)."""
    if head_of(model) is None:
        return {}
    keys = ("forward", _STATE, _PREV_FORWARD)
    return {k: model.__dict__[k] for k in keys if k in model.__dict__}


def _inner_forward(model: nn.Module) -> Callable[..., Any]:
    previous = model.__dict__.get(_PREV_FORWARD)
    if previous is not None:
        return previous  # type: ignore[no-any-return]
    return type(model).forward.__get__(model)  # type: ignore[no-any-return]


def _take_labels(inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[Tensor | None, tuple[Any, ...]]:
    """The call's ``labels`` (by keyword or position), and the arguments without them."""
    if "labels" in kwargs:
        return kwargs.pop("labels"), args
    names = [p.name for p in inspect.signature(inner).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if "labels" in names and names.index("labels") < len(args):
        at = names.index("labels")
        return args[at], (*args[:at], None, *args[at + 1:])
    return None, args


def _recording_forward(head: nn.Module, hidden: Tensor) -> Tensor:
    """The output head's forward during a chunked call: record, build no logits."""
    empty = hidden.new_empty(*hidden.shape[:-1], 0)  # (..., 0)
    head.__dict__[_RECORDED].append((hidden, empty))
    return empty


def _refuse(model: nn.Module, what: str, facts: dict[str, Any], fix: str) -> StrategyError:
    return StrategyError(message(f"{type(model).__name__}.forward with {_API}", what,
                                 facts, fix=fix))


def _chunked_forward(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    inner = _inner_forward(model)
    labels, args = _take_labels(inner, args, kwargs)
    info = head_of(model)
    if labels is None or info is None:
        return inner(*args, **kwargs)
    head = output_head(model)
    assert isinstance(head, nn.Linear)  # checked at install time
    had = head.__dict__.get("forward")
    head.__dict__[_RECORDED] = []
    head.__dict__["forward"] = BoundForward(head, _recording_forward)
    try:
        out = inner(*args, **kwargs)
        recorded: list[tuple[Tensor, Tensor]] = head.__dict__[_RECORDED]
    finally:
        head.__dict__.pop(_RECORDED, None)
        head.__dict__.pop("forward", None)
        if had is not None:
            head.__dict__["forward"] = had
    if len(recorded) != 1:
        raise _refuse(model, f"the forward called the output head {len(recorded)} times",
                      {"expected": "one call, on the last hidden state"},
                      fix="use chunked_head on a model that calls its lm_head once")
    if not dataclasses.is_dataclass(out) or not hasattr(out, "logits"):
        raise _refuse(model, "the forward returned no output with .logits",
                      {"found": type(out).__name__},
                      fix="call the model with return_dict=True (the default)")
    hidden, empty = recorded[0]  # (B, S, d), (B, S, 0)
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    if out.logits is empty:
        softcap = None  # the logits are the head's own: the forward changed nothing
    elif softcap is None or out.logits is None or out.logits.numel() != 0:
        raise _refuse(model, "the forward changes the logits after the output head",
                      {"reproduced": "final_logit_softcapping only (Gemma2)"},
                      fix="remove chunked_head for this model")
    loss = chunked_next_token_loss(
        hidden, labels, head.weight, head.bias, chunks=info.chunks, softcap=softcap,
        ignore_index=kwargs.get("ignore_index", IGNORE_INDEX),
        shift_labels=kwargs.get("shift_labels"),
        num_items_in_batch=kwargs.get("num_items_in_batch"),
        refuse=lambda what, facts: _refuse(model, what, facts,
                                           fix="pass labels shaped like input_ids and "
                                               "leave logits_to_keep at 0"))
    return dataclasses.replace(out, logits=None, loss=loss)  # type: ignore[type-var]


def _chunk_loss(hidden: Tensor, targets: Tensor, weight: Tensor, bias: Tensor | None,
                softcap: float | None, ignore_index: int) -> Tensor:
    """Summed cross entropy of one chunk, the ops of the un-chunked loss (Rule 1)."""
    logits = F.linear(hidden, weight, bias)  # (n, V), the model's dtype
    if softcap is not None:  # Gemma2's final_logit_softcapping, in the model's dtype
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index,
                           reduction="sum")


def _recompute_context() -> tuple[contextlib.AbstractContextManager[None],
                                  contextlib.AbstractContextManager[None]]:
    return contextlib.nullcontext(), recomputing()


def chunked_next_token_loss(
    hidden: Tensor,
    labels: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    chunks: int,
    softcap: float | None = None,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: Tensor | None = None,
    num_items_in_batch: Tensor | int | None = None,
    refuse: Callable[[str, dict[str, Any]], Exception] | None = None,
) -> Tensor:
    """Next-token cross entropy of ``linear(hidden, weight, bias)`` in ``chunks`` token
    slices, each recomputed in backward (NOTE [ Chunked head ], Rule 1).

    Trades one extra output projection per token in backward (``2 * tokens * d * V``
    FLOPs) for never holding more than ``ceil(tokens / chunks) x V`` logits, their float32
    copy and gradient at once.

    Args:
        hidden: ``(B, S, d)`` last hidden states (what the output head reads).
        labels: ``(B, S)`` token ids; ``ignore_index`` entries are left out.
        weight: ``(V, d)`` output head weight; bias: ``(V,)`` or ``None``.
        chunks: number of token slices (of ``B * S`` tokens; the last ones may be one
            token shorter), >= 1.
        softcap: Gemma2's ``final_logit_softcapping`` (``tanh(z / c) * c``). Default:
            ``None``.
        ignore_index: the ignored label. Default: -100.
        shift_labels: targets already shifted (``(B, S)``); replaces ``labels``' shift.
        num_items_in_batch: divide the summed loss by this instead of the number of
            non-ignored targets (what Hugging Face trainers pass). Default: ``None``.

    Returns:
        The scalar float32 loss.

    Example:
        >>> loss = chunked_next_token_loss(h, ids, model.lm_head.weight, chunks=8)
    """
    if shift_labels is None:
        # Shift so that tokens < n predict n (ForCausalLMLoss): (B, S)
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if tuple(shift_labels.shape) != tuple(hidden.shape[:-1]):
        facts = {"labels": tuple(shift_labels.shape),
                 "hidden states": tuple(hidden.shape[:-1])}
        if refuse is not None:
            raise refuse("the labels do not line up with the output head's input", facts)
        raise ValueError(message("chunked_next_token_loss", "labels and hidden differ in "
                                 "shape", facts, fix="pass (B, S) labels for (B, S, d) hidden"))
    flat = hidden.reshape(-1, hidden.size(-1))  # (B*S, d)
    targets = shift_labels.reshape(-1).to(hidden.device)  # (B*S,)
    total: Tensor | None = None
    for part, part_targets in zip(flat.tensor_split(chunks), targets.tensor_split(chunks),
                                  strict=True):
        if part.size(0) == 0:
            continue
        summed = checkpoint(_chunk_loss, part, part_targets, weight, bias, softcap,
                            ignore_index, use_reentrant=False, preserve_rng_state=False,
                            context_fn=_recompute_context)
        total = summed if total is None else total + summed
    assert total is not None
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()  # the mean over non-ignored targets
    if isinstance(num_items_in_batch, Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
