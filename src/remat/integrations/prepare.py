"""What the trainer callbacks share: one of strategy or budget, a batch on the model's
device, and applying a strategy or a budget's plan.

The Hugging Face and Lightning callbacks (hf.py, lightning.py) differ only in where the
model, the batch and the optimizer come from; this module is the part after that, and
imports neither framework.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from remat.blocks import BlocksSpec
from remat.errors import message
from remat.measure.step import LossFn, model_device
from remat.strategies.apply import apply

if TYPE_CHECKING:
    from remat.planning.plans import Plan


def check_one_of(api: str, strategy: Any, budget: Any, *, spelled: str = "strategy") -> None:
    """Raise ValueError when both ``strategy`` and ``budget`` are given (``spelled``: how
    ``api`` names its strategy argument, ``"strategy"`` or ``"strategy="``)."""
    if strategy is not None and budget is not None:
        raise ValueError(message(api, f"{spelled} and budget= were both given",
                                 {"strategy": repr(strategy), "budget": repr(budget)},
                                 fix=f"pass {spelled} or budget=, not both"))


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor on ``device``; mappings become plain dicts, tuples and
    lists keep their type, anything else is returned as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def apply_or_plan(model: nn.Module, *, strategy: Any, budget: int | str | None, batch: Any,
                  blocks: BlocksSpec, optimizer: torch.optim.Optimizer | None,
                  loss_fn: LossFn | None = None, api: str) -> Plan | None:
    """Apply ``strategy`` (``"full"`` when neither is given), or plan ``budget`` on one
    step of ``batch`` and apply the plan.

    Args:
        model: the model ``batch`` is called on (``model(**batch)``, see
            :func:`remat.profile`), in train mode.
        strategy: a strategy string, strategy or Plan; ``None`` with a budget.
        budget: the step's peak memory (bytes, ``"12GiB"``, ``"60%"``); ``None`` with a
            strategy.
        batch: one training batch, on the model's device; required with ``budget``.
        blocks: which modules are blocks. ``None``: remat's rules.
        optimizer: counted in the budget (its state) when planning.
        loss_fn: ``loss_fn(output, batch) -> loss``. Default: ``None`` (``output.loss``).
        api: the public call, for messages.

    Returns:
        The plan that was applied (with ``on_new_shape="warn"``: a batch outside its
        shapes warns and runs), or ``None`` when a strategy was.

    Raises:
        ValueError: ``budget`` without ``batch``.
        BudgetTooSmall: no plan fits ``budget``.
    """
    if budget is None:
        apply(model, strategy if strategy is not None else "full", blocks=blocks)
        return None
    chosen = plan_budget(model, budget=budget, batch=batch, blocks=blocks, optimizer=optimizer,
                         loss_fn=loss_fn, api=api)
    # Measured at one batch's shapes: a later, longer batch warns (once per shape bucket)
    # rather than stopping a training run the user did not plan shapes for (NOTE
    # [ Planning from a Trainer batch ] in hf.py, NOTE [ Shape guard ]).
    apply(model, chosen, blocks=blocks, on_new_shape="warn")
    return chosen


def plan_budget(model: nn.Module, *, budget: int | str, batch: Any, blocks: BlocksSpec,
                optimizer: torch.optim.Optimizer | None, loss_fn: LossFn | None = None,
                api: str) -> Plan:
    """:func:`remat.plan` of one step of ``batch`` (arguments as for :func:`apply_or_plan`);
    nothing is applied.

    Raises:
        ValueError: ``batch`` is ``None``.
        BudgetTooSmall: no plan fits ``budget``.
    """
    if batch is None:
        raise ValueError(message(api, f"budget={budget!r} needs batch= to measure the step",
                                 fix="pass batch=, one training batch as the data loader "
                                     "yields it"))
    from remat.planning import plan  # lazily: planning loads the solver

    return plan(model, batch, budget=budget, blocks=blocks, optimizer=optimizer,
                loss_fn=loss_fn)


def on_model_device(batch: Any, model: nn.Module) -> Any:
    """:func:`to_device` on the device of ``model``'s first parameter."""
    return to_device(batch, model_device(model))
