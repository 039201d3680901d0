"""PyTorch Lightning: apply a strategy or a budget's plan when ``Trainer.fit`` starts training.

::

    >>> from remat.integrations.lightning import RematCallback
    >>> trainer = lightning.pytorch.Trainer(callbacks=[RematCallback("ops")])  # or budget="12GiB"
    >>> trainer.fit(lit_module, train_loader)

The blocks are found by remat's rules in the LightningModule, or in one of its
submodules (``module="model"``). ``lightning`` is an optional dependency
(``pip install 'remat[lightning]'``; ``pytorch_lightning``, its older name, works too).

NOTE [ Planning a Lightning training step ]
    A budget is planned on the step the Trainer runs: ``training_step(batch, 0)``
    (its loss, or ``["loss"]`` of what it returns), backward and the optimizer, under
    the Trainer's precision context (``precision="bf16-mixed"`` autocasts the measured
    step as it does the real one). :func:`remat.plan` measures a module's forward, so
    the step is wrapped in a module whose forward is the training step and whose only
    child is the LightningModule; the plan's names (``lightning_module.model.blocks.0``)
    are made relative to the module the plan is applied to (``blocks.0`` for
    ``module="model"``), so ``remat.strategies.applied`` and ``remat.remove`` work on
    it. ``self.log`` calls in ``training_step`` are dropped while planning (the Trainer
    refuses them outside its loop). The batch is ``batch=`` or the first batch of the
    Trainer's training dataloader, moved by the Trainer (``batch_to_device``, so the
    batch-transfer hooks run) as NOTE [ Planning from a Trainer batch ] in hf.py
    describes for transformers. With manual optimization ``training_step`` steps the
    optimizer itself: pass ``step_fn=`` to plan.

NOTE [ Both Lightning packages ]
    Lightning is published as ``lightning`` (``lightning.pytorch``) and under its older
    name ``pytorch_lightning``; the two are separate copies of the same code, and each
    Trainer accepts only callbacks of its own ``Callback`` class. ``RematCallback``
    derives from the ``Callback`` of every package installed (their hooks have the same
    names and signatures), so it is a callback of whichever one the user's Trainer comes
    from.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from remat.blocks import BlocksSpec, named_blocks
from remat.errors import message
from remat.integrations.prepare import check_one_of, plan_budget
from remat.strategies.apply import AppliedStrategy, applied, apply
from remat.strategies.registry import parse_strategy


def _callback_bases() -> tuple[type, ...]:
    """The ``Callback`` class of every Lightning package installed (NOTE [ Both Lightning
    packages ])."""
    import importlib

    bases: list[type] = []
    for package in ("lightning.pytorch", "pytorch_lightning"):
        try:
            bases.append(importlib.import_module(package).Callback)
        except ImportError:
            continue
    if not bases:
        raise ImportError(message(
            "remat.integrations.lightning",
            "needs Lightning, and neither lightning nor pytorch_lightning is installed",
            fix="install it with: pip install 'remat[lightning]' (or pytorch-lightning)"))
    return tuple(bases)


if TYPE_CHECKING:
    from remat.planning.plans import Plan

__all__ = ["RematCallback", "training_step_loss"]

_API = "remat.integrations.lightning.RematCallback"
#: The child name of the LightningModule in the planned step module.
_CHILD = "lightning_module"

ModuleSpec = str | Callable[[nn.Module], nn.Module] | None
StepFn = Callable[[Any, Any], torch.Tensor]


def training_step_loss(lightning_module: Any, batch: Any) -> torch.Tensor:
    """The loss of ``lightning_module.training_step(batch, 0)``: the value itself, or
    its ``"loss"`` entry (what Lightning's automatic optimization backpropagates).

    Raises:
        ValueError: the step returned neither (``None`` skips a step in Lightning).

    Example:
        >>> training_step_loss(lit_module, next(iter(loader))).ndim
        0
    """
    out = lightning_module.training_step(batch, 0)
    if isinstance(out, Mapping):
        out = out.get("loss")
    if not isinstance(out, torch.Tensor):
        raise ValueError(message(
            _API, "training_step returned no loss to plan with",
            {"returned": type(out).__name__},
            fix="return the loss (or {'loss': loss}) from training_step, or pass step_fn="))
    return out


class _TrainingStep(nn.Module):
    """A LightningModule's training step as a forward: ``forward(batch) -> loss``."""

    def __init__(self, lightning_module: nn.Module, step_fn: StepFn,
                 context: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
        super().__init__()
        self.add_module(_CHILD, lightning_module)
        self.step_fn = step_fn
        self.context = context

    def forward(self, batch: Any) -> torch.Tensor:
        with self.context():
            return self.step_fn(getattr(self, _CHILD), batch)


def _no_log(*args: Any, **kwargs: Any) -> None:
    """``LightningModule.log`` while planning (the Trainer refuses it outside its loop)."""


@contextlib.contextmanager
def _logging_off(lightning_module: nn.Module) -> Iterator[None]:
    own: dict[str, Any] = {k: lightning_module.__dict__[k] for k in ("log", "log_dict")
                           if k in lightning_module.__dict__}
    lightning_module.__dict__.update(log=_no_log, log_dict=_no_log)
    try:
        yield
    finally:
        for key in ("log", "log_dict"):
            lightning_module.__dict__.pop(key, None)
        lightning_module.__dict__.update(own)


def _target(lightning_module: nn.Module, module: ModuleSpec) -> tuple[nn.Module, str]:
    """The module to checkpoint and its qualified name in ``lightning_module``."""
    if module is None:
        return lightning_module, ""
    if isinstance(module, str):
        try:
            return lightning_module.get_submodule(module), module
        except AttributeError as exc:
            children = [name for name, _ in lightning_module.named_children()]
            raise ValueError(message(
                _API, f"module={module!r} is not a submodule of "
                f"{type(lightning_module).__name__}", {"its children": children[:8]},
                fix="pass the attribute name of the model to checkpoint, e.g. "
                    "module='model'")) from exc
    found = module(lightning_module)
    for name, sub in lightning_module.named_modules():
        if sub is found:
            return found, name
    raise ValueError(message(
        _API, f"module= returned a {type(found).__name__} that is not inside "
        f"{type(lightning_module).__name__}",
        fix="return a submodule of the LightningModule (lambda lm: lm.model)"))


def _relative(plan: Plan, prefix: str) -> Plan:
    """``plan`` with ``prefix`` taken off every name (NOTE [ Planning a Lightning
    training step ])."""
    from remat.blocks import NamedBlocks

    def strip(name: str) -> str:
        return name[len(prefix):] if name.startswith(prefix) else name

    spec = plan.blocks
    if isinstance(spec, NamedBlocks):
        spec = NamedBlocks(tuple(strip(n) for n in spec.names))
    prints = None if plan.fingerprint is None else tuple(
        dataclasses.replace(p, name=strip(p.name)) for p in plan.fingerprint)
    # The shapes are of the training step's inputs, not of the module the plan goes on:
    # no shape guard there (NOTE [ Shape guard ]).
    return dataclasses.replace(
        plan, decisions={strip(k): v for k, v in plan.decisions.items()},
        block_names=tuple(strip(n) for n in plan.block_names), blocks=spec, fingerprint=prints,
        shape_envelope=None)


def _first_batch(trainer: Any) -> Any:
    loader = trainer.train_dataloader
    if isinstance(loader, Mapping):  # several training dataloaders: Lightning combines them
        raise ValueError(message(
            _API, "budget= needs one batch, and the Trainer has several training dataloaders",
            {"dataloaders": list(loader)[:4]}, fix="pass RematCallback(budget=..., batch=...)"))
    if loader is None:
        raise ValueError(message(_API, "budget= needs a batch, and the Trainer has no "
                                 "training dataloader", fix="pass batch="))
    return next(iter(loader))


class RematCallback(*_callback_bases()):  # type: ignore[misc]
    """A Lightning ``Callback`` (of ``lightning.pytorch`` and of ``pytorch_lightning``,
    whichever are installed: NOTE [ Both Lightning packages ]) that applies remat when
    training starts.

    At ``on_train_start`` (the model is on its device, the optimizers exist and the
    training dataloader is loaded; the sanity-check validation before it runs no
    backward) it applies ``strategy`` to the chosen module, or plans ``budget`` on one
    training step and applies the plan (NOTE [ Planning a Lightning training step ]).
    A budget costs a few measured training steps up front; a strategy costs nothing.

    Args:
        strategy: a strategy string (``"full"``, ``"ops"``, ...), strategy or Plan.
            Default: ``None`` (``"full"`` without a budget).
        budget: the training step's peak memory: bytes, ``"12GiB"``, ``"60%"`` or
            ``"activations:50%"``. Default: ``None``.
        batch: the batch to plan with, as the dataloader yields it. Default: ``None``
            (the first batch of the training dataloader, which advances a shuffling
            sampler once: pass ``batch=`` for the same data order as without remat).
        module: what to checkpoint: ``None`` (the LightningModule), the name of a
            submodule (``"model"``, ``"backbone.encoder"``) or a function of the
            LightningModule returning one. Blocks are found in it by remat's rules.
            Default: ``None``.
        blocks: which modules are blocks (see :func:`remat.find_blocks`), within
            ``module``. Default: automatic.
        step_fn: ``step_fn(lightning_module, batch) -> loss``, the forward and loss of
            the step to plan. Default: :func:`training_step_loss`.

    Attributes:
        applied: what was applied (``remat.strategies.applied(module)``), once training
            started.
        plan: the applied :class:`remat.Plan` with a budget (``plan.measured_peak_bytes``
            ``<= plan.budget_bytes``), its names relative to ``module``; else ``None``.

    Example:
        >>> callback = RematCallback(budget="activations:50%", module="model")
        >>> Trainer(max_steps=100, callbacks=[callback]).fit(lit_module, loader)
        >>> callback.plan.measured_peak_bytes <= callback.plan.budget_bytes
        True
    """

    def __init__(self, strategy: str | Any | None = None, *, budget: int | str | None = None,
                 batch: Any = None, module: ModuleSpec = None, blocks: BlocksSpec = None,
                 step_fn: StepFn | None = None) -> None:
        check_one_of(_API, strategy, budget)
        self.strategy = parse_strategy(strategy, api=_API) if isinstance(strategy, str) \
            else strategy
        self.budget = budget
        self.batch = batch
        self.module = module
        self.blocks = blocks
        self.step_fn = step_fn
        self.applied: AppliedStrategy | None = None
        self.plan: Plan | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Apply the strategy (or plan the budget) on the chosen module."""
        target, path = _target(pl_module, self.module)
        was_training = pl_module.training
        pl_module.train()
        try:
            if self.budget is None:
                apply(target, self.strategy if self.strategy is not None else "full",
                      blocks=self.blocks)
            else:
                self.plan = self._plan(trainer, pl_module, target, path)
        finally:
            pl_module.train(was_training)
        self.applied = applied(target)

    def _plan(self, trainer: Any, pl_module: Any, target: nn.Module, path: str) -> Plan:
        assert self.budget is not None  # on_train_start plans only with a budget
        if self.step_fn is None and not pl_module.automatic_optimization:
            raise ValueError(message(
                _API, "budget= with manual optimization: training_step steps the "
                "optimizer itself, so remat cannot measure one step of it",
                fix="pass step_fn=lambda module, batch: loss (forward and loss only)"))
        raw = self.batch if self.batch is not None else _first_batch(trainer)
        batch = trainer.strategy.batch_to_device(raw)
        prefix = f"{_CHILD}.{path}." if path else f"{_CHILD}."
        found = named_blocks(target, self.blocks, api=_API)
        from remat.blocks import NamedBlocks

        step = _TrainingStep(pl_module, self.step_fn or training_step_loss,
                             trainer.precision_plugin.train_step_context)
        optimizers = [o for o in trainer.optimizers if isinstance(o, torch.optim.Optimizer)]
        with _logging_off(pl_module):
            chosen = plan_budget(
                step, budget=self.budget, batch=(batch,),
                blocks=NamedBlocks(tuple(prefix + name for name, _ in found)),
                optimizer=optimizers[0] if len(optimizers) == 1 else None,
                loss_fn=_the_loss, api=_API)
        relative = _relative(chosen, prefix)
        apply(target, relative, blocks=relative.blocks)
        return relative


def _the_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    """The planned step's output is already its loss."""
    return output
