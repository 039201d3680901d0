"""Hugging Face transformers: apply a strategy or a budget's plan before training.

``remat.apply(hf_model, ...)`` works on transformers models as they are: the
repeated layers are found by remat's block rules (decoder layers, encoder layers,
and both stacks of encoder-decoder models such as T5), and the pitfall checks turn
off ``config.use_cache`` and the model's own activation checkpointing, each with
one warning. This module adds the Trainer side::

    >>> from remat.integrations.hf import RematCallback
    >>> trainer = Trainer(model=model, args=args, train_dataset=data,
    ...                   callbacks=[RematCallback("ops")])          # or budget="12GiB"
    >>> trainer.train()

or, without a callback, :func:`prepare_model` before building the Trainer.

``transformers`` is an optional dependency (``pip install 'remat[hf]'``).

NOTE [ Planning from a Trainer batch ]
    A budget needs one training batch to measure. :class:`RematCallback` takes the
    ``batch=`` it was given, else the first batch of the Trainer's training
    dataloader (drawing it advances a shuffling sampler's random state once; pass
    ``batch=`` for bit-identical data order). ``BatchEncoding`` and other mappings
    become plain dicts on the model's device, so ``model(**batch)`` gets exactly
    what the Trainer passes. The plan is measured at that batch's shapes; a later batch
    outside them (padded to a longer sequence) warns once per shape bucket and runs
    (``on_new_shape="warn"``, NOTE [ Shape guard ] in strategies/guard.py), since a
    Trainer's batches vary and the user gave one. For a plan proven on every shape, pass
    ``strategy=remat.plan(model, batch, budget=..., shapes=[...])``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from remat.blocks import BlocksSpec
from remat.errors import RematWarning, message
from remat.integrations.prepare import apply_or_plan, check_one_of, on_model_device
from remat.strategies.apply import AppliedStrategy, applied
from remat.strategies.registry import parse_strategy

if TYPE_CHECKING:
    from remat.planning.plans import Plan

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(message(
        "remat.integrations.hf", "needs the transformers package, which is not installed",
        fix="install it with: pip install 'remat[hf]'")) from exc

__all__ = ["RematCallback", "disable_kv_cache", "prepare_model", "to_model_batch"]

M = TypeVar("M", bound=nn.Module)
_API = "remat.integrations.hf.prepare_model"


def disable_kv_cache(model: nn.Module, *, include_root: bool = True) -> list[str]:
    """Set ``use_cache=False`` on every config in the model, sub-stacks included.

    Encoder-decoder models keep a config copy per stack (T5's decoder has its own, with
    ``use_cache=True`` even when the top-level config is changed), and a decoder that
    caches appends its keys and values again when a checkpointed block is recomputed:
    recomputation then sees keys twice as long and fails. See NOTE [ Planning from a
    Trainer batch ] for when :func:`prepare_model` calls this.

    Args:
        model: the model.
        include_root: also the root module's config. Default: ``True``.

    Returns:
        Qualified names of the modules whose config had ``use_cache=True`` (``""`` is the root).

    Example:
        >>> disable_kv_cache(t5_model)
        ['', 'decoder']
    """
    changed: list[str] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))  # shared with the root (LlamaModel under LlamaForCausalLM): once
        if name == "" and not include_root:
            continue
        if getattr(config, "use_cache", False) is True:
            config.use_cache = False
            changed.append(name)
    return changed


def to_model_batch(batch: Any, model: nn.Module) -> Any:
    """A Trainer batch as ``model(**batch)`` takes it: a plain dict on the model's device.

    Example:
        >>> to_model_batch(tokenizer(["hi"], return_tensors="pt"), model).keys()
        dict_keys(['input_ids', 'attention_mask'])
    """
    return on_model_device(batch, model)


def prepare_model(model: M, *, strategy: str | Any | None = None, budget: int | str | None = None,
                  batch: Any = None, blocks: BlocksSpec = None,
                  optimizer: torch.optim.Optimizer | None = None,
                  forward_kwargs: Mapping[str, Any] | None = None) -> M:
    """Apply a strategy, or plan for a memory budget and apply the plan, to a transformers model.

    ``use_cache`` is turned off in every config of the model (T5's decoder stack has
    its own) and the model's own activation checkpointing disabled, with one warning
    each; the model's train/eval mode is kept. A budget costs a few measured training
    steps to plan (see :func:`remat.plan`); a strategy costs nothing up front.

    Args:
        model: a transformers ``PreTrainedModel`` (or any model remat can find blocks in).
        strategy: a strategy string (``"full"``, ``"ops"``, ...) or a Plan. Default: ``None``.
        budget: the step's peak memory: bytes, ``"12GiB"`` or ``"60%"``. Default: ``None``.
            With neither ``strategy`` nor ``budget``, ``"full"`` is applied.
        batch: one training batch (mapping of tensors), required with ``budget``.
            Default: ``None``.
        blocks: which modules are blocks (see :func:`remat.find_blocks`). Default: automatic.
        optimizer: counted in the budget (its state) when planning. Default: ``None``.
        forward_kwargs: keyword arguments the training loop adds to ``model(**batch)``,
            added to the measured step when planning (TRL's ``SFTTrainer`` calls
            ``model(**batch, fused_lm_head=True)``: pass ``{"fused_lm_head": True}``).
            Default: ``None``.

    Returns:
        ``model``, modified in place.

    Raises:
        ValueError: both ``strategy`` and ``budget``, or ``budget`` without ``batch``.
        BudgetTooSmall: no plan fits ``budget``.

    Example:
        >>> model = AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=4))
        >>> prepare_model(model, strategy="ops")
    """
    _prepare(model, strategy=strategy, budget=budget, batch=batch, blocks=blocks,
             optimizer=optimizer, forward_kwargs=forward_kwargs)
    return model


def _prepare(model: nn.Module, *, strategy: str | Any | None, budget: int | str | None,
             batch: Any, blocks: BlocksSpec, optimizer: torch.optim.Optimizer | None,
             forward_kwargs: Mapping[str, Any] | None) -> Plan | None:
    """:func:`prepare_model`, returning the plan it applied (``None`` for a strategy)."""
    check_one_of(_API, strategy, budget, spelled="strategy=")
    if isinstance(strategy, str):  # an unknown strategy fails here, naming this call
        strategy = parse_strategy(strategy, api=_API)
    elif callable(check := getattr(strategy, "check_model", None)):
        check(model, api=_API)  # a plan for another model, named here
    was_training = model.training
    model.train()  # checkpointing is for training; avoid the eval-mode warning
    # Before planning too: a cache makes the measured blocks append to it (see disable_kv_cache).
    cached = disable_kv_cache(model)
    if cached:
        where = ", ".join(repr(name) if name else "the model" for name in cached)
        warnings.warn(
            message(_API, f"config.use_cache was True ({where})",
                    {"why": "recomputing a checkpointed block with a KV cache appends its keys "
                            "and values a second time, which fails or corrupts the cache, so "
                            "remat set use_cache=False for training"},
                    fix="set it back to True before generation"),
            RematWarning, stacklevel=3,
        )
    if batch is not None:
        batch = to_model_batch(batch, model)
        if forward_kwargs and isinstance(batch, dict):
            batch = {**batch, **forward_kwargs}
    try:
        return apply_or_plan(model, strategy=strategy, budget=budget, batch=batch,
                             blocks=blocks, optimizer=optimizer, api=_API)
    finally:
        model.train(was_training)


class RematCallback(TrainerCallback):  # type: ignore[misc]
    """A ``transformers.TrainerCallback`` that applies remat when training begins.

    At ``on_train_begin`` (after the Trainer has enabled or not its own activation
    checkpointing, which remat then turns off with a warning) it calls
    :func:`prepare_model` on the Trainer's model. With a budget, the plan is measured
    on ``batch`` or the first training batch (NOTE [ Planning from a Trainer batch ]).

    Args:
        strategy: a strategy string or a Plan. Default: ``None`` (``"full"`` without a budget).
        budget: the step's peak memory (bytes, ``"12GiB"``, ``"60%"``). Default: ``None``.
        batch: the batch to plan with. Default: ``None`` (the first training batch).
        blocks: which modules are blocks. Default: automatic.
        forward_kwargs: what the Trainer adds to ``model(**batch)``, for the measured step
            (see :func:`prepare_model`; TRL's ``SFTTrainer``: ``{"fused_lm_head": True}``).
            Default: ``None``.

    Attributes:
        applied: what was applied (``remat.strategies.applied(model)``), after training began.
        plan: the :class:`remat.Plan` a budget gave (``plan.measured_peak_bytes``,
            ``plan.budget_bytes``), after training began; ``None`` with a strategy.

    Example:
        >>> trainer = Trainer(model, args, train_dataset=data,
        ...                   callbacks=[RematCallback(budget="60%")])
    """

    def __init__(self, strategy: str | Any | None = None, *, budget: int | str | None = None,
                 batch: Any = None, blocks: BlocksSpec = None,
                 forward_kwargs: Mapping[str, Any] | None = None) -> None:
        check_one_of("remat.integrations.hf.RematCallback", strategy, budget)
        self.strategy = strategy
        self.budget = budget
        self.batch = batch
        self.blocks = blocks
        self.forward_kwargs = forward_kwargs
        self.applied: AppliedStrategy | None = None
        self.plan: Plan | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       train_dataloader: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        """Apply the strategy (or plan the budget) on the Trainer's model."""
        if model is None:
            raise ValueError(message("remat.integrations.hf.RematCallback",
                                     "the Trainer passed no model",
                                     fix="add the callback to a Trainer with a model"))
        batch = self.batch
        if self.budget is not None and batch is None:
            if train_dataloader is None:
                raise ValueError(message(
                    "remat.integrations.hf.RematCallback",
                    "budget= needs a batch to measure, and the Trainer has no training "
                    "dataloader", fix="pass RematCallback(budget=..., batch=...)"))
            batch = next(iter(train_dataloader))
        # accelerate wraps the Trainer's optimizer; the planner rebuilds the torch one.
        inner = getattr(optimizer, "optimizer", optimizer)
        self.plan = _prepare(model, strategy=self.strategy, budget=self.budget, batch=batch,
                             blocks=self.blocks,
                             optimizer=inner if isinstance(inner, torch.optim.Optimizer)
                             else None, forward_kwargs=self.forward_kwargs)
        self.applied = applied(model)
