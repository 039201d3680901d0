"""Gradient parity: a checkpointed model must train exactly like the original.

``validate`` runs one forward/backward without checkpointing and one with the
strategy, on the same weights, inputs and RNG seed, and compares the loss and
every parameter gradient.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.blocks import BlockMethod, BlocksSpec, Sublayer
from remat.core.parity import ParityReport
from remat.errors import RematWarning, message, names_the_call
from remat.measure.attribution import hook_calls
from remat.measure.step import Step, call_model, check_runnable, default_loss
from remat.strategies.apply import apply, remove
from remat.strategies.base import Strategy
from remat.strategies.guard import install_guard, shape_guard
from remat.strategies.regions import installed_attributes, method_regions, region_of
from remat.strategies.registry import parse_strategy

_TINY = 1e-30
_APPLIED_KEY = "_remat_applied"
#: Per-module state validation may change and puts back: remat's regions and Hugging Face's
#: own checkpointing switches (``gradient_checkpointing_disable`` resets them).
_HF_KEYS = ("gradient_checkpointing", "_gradient_checkpointing_func")


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """``max|value - reference| / max|reference|`` in float64 (0 when both are zero)."""
    diff = (value.double() - reference.double()).abs().max().item() if value.numel() else 0.0
    scale = reference.double().abs().max().item() if reference.numel() else 0.0
    if diff == 0.0:
        return 0.0
    return float(diff / max(scale, _TINY))


@contextmanager
def _preserved(model: nn.Module) -> Iterator[None]:
    """Restore remat regions, buffers, grads and the RNG state afterwards."""
    keys = (_APPLIED_KEY, *_HF_KEYS)
    installed = {
        id(m): (m, {**installed_attributes(m),
                    **{k: m.__dict__[k] for k in keys if k in m.__dict__}})
        for m in model.modules()
    }
    configs = {id(c): (c, c.use_cache) for m in model.modules()
               if (c := m.__dict__.get("config")) is not None and hasattr(c, "use_cache")}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    grads = {name: p.grad for name, p in model.named_parameters()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    guard = shape_guard(model)
    try:
        yield
    finally:
        remove(model)
        for module, saved in installed.values():
            module.__dict__.update(saved)
        if guard is not None:
            install_guard(model, guard)
        for config, use_cache in configs.values():
            config.use_cache = use_cache
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        for name, p in model.named_parameters():
            p.grad = grads[name]
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


@dataclass
class _Calls:
    names: list[str]
    regions: int = 0
    ran: int = 0


@contextmanager
def _region_calls(model: nn.Module) -> Iterator[_Calls]:
    """Count the calls of ``model``'s checkpointed regions (modules and methods) while the
    block runs."""
    regions: list[tuple[str, Sublayer]] = [
        (n, m) for n, m in model.named_modules() if region_of(m) is not None]
    regions += [(f"{n}.{method}" if n else method, BlockMethod(m, method))
                for n, m in model.named_modules() for method in method_regions(m)]
    calls = _Calls([n for n, _ in regions], len(regions))

    def hook(*_: Any) -> None:
        calls.ran += 1

    handles = [h for _, target in regions
               for h in hook_calls(target, hook, lambda *_: None)]
    try:
        yield calls
    finally:
        for handle in reversed(handles):
            handle.remove()


def _step(step: Step, seed: int) -> tuple[float, dict[str, torch.Tensor | None]]:
    model, batch = step.model, step.batch
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    output = call_model(model, batch, api="remat.validate")
    loss = step.loss_fn(output, batch) if step.loss_fn is not None else default_loss(
        output, api="remat.validate")
    loss.backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else None)
             for n, p in model.named_parameters()}
    return float(loss.detach().double().item()), grads


@names_the_call("remat.validate")
def validate(model: nn.Module, batch: Any, strategy: str | Any, *, blocks: BlocksSpec = None,
             loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, rtol: float = 1e-6,
             seed: int = 0) -> ParityReport:
    """Check that a strategy leaves the loss and every parameter gradient unchanged.

    Runs one step without checkpointing and one with ``strategy`` on the same weights,
    batch and RNG seed (dropout draws the same masks), and compares. The model is
    left as it was: its applied strategy, Hugging Face's own checkpointing and
    ``use_cache`` settings, buffers, gradients and the global RNG state are restored.
    Costs two training steps of memory for gradients.

    Args:
        model: the model (in train mode for dropout to matter).
        batch: a tensor, tuple (``model(*batch)``) or dict (``model(**batch)``).
        strategy: a strategy string (see :func:`remat.apply`) or a Plan.
        blocks: which modules are blocks (see :func:`remat.find_blocks`). Default: automatic.
        loss_fn: ``loss_fn(output, batch) -> Tensor``. Default: ``output.loss``, else the
            mean of the output.
        rtol: relative tolerance for ``report.passed``. Default: ``1e-6``.
        seed: RNG seed both runs start from. Default: ``0``.

    Returns:
        A :class:`ParityReport`; call ``report.raise_if_failed()`` to turn a failure into
        an exception.

    Example:
        >>> report = remat.validate(model, batch, "ops")
        >>> report.passed, report.max_rel_error
        (True, 0.0)
    """
    step = Step(model, batch, loss_fn=loss_fn, blocks=blocks)
    check_runnable(model, api="remat.validate")
    label = strategy if isinstance(strategy, str) else \
        str(strategy) if isinstance(strategy, Strategy) else "plan"
    if isinstance(strategy, str):
        strategy = parse_strategy(strategy, api="remat.validate")
    if isinstance(strategy, Strategy):  # a Plan brings its own blocks
        step.blocks_found(api="remat.validate")  # bad blocks= fail here, naming this call
    elif callable(check := getattr(strategy, "check_model", None)):
        check(model, api="remat.validate")  # a plan for another model, named here
    with _preserved(model):
        remove(model)
        loss_ref, grads_ref = _step(step, seed)
        apply(model, strategy, blocks=blocks, on_new_shape="off")  # any batch: no guard
        with _region_calls(model) as calls:
            loss, grads = _step(step, seed)
    if calls.regions and not calls.ran:
        warnings.warn(
            message("remat.validate", f"strategy {label!r} installed {calls.regions} "
                    "checkpointed region(s), but none ran in the step",
                    {"regions": ", ".join(calls.names[:4]),
                     "so": "nothing was checkpointed and the report says nothing about "
                           "checkpointing",
                     "why": "blocks= selects modules the model's forward never calls"},
                    fix="select with blocks= the modules the forward runs"),
            RematWarning,
            stacklevel=2,
        )
    per_param: dict[str, float] = {}
    for name, ref in grads_ref.items():
        got = grads[name]
        if ref is None and got is None:
            continue
        if ref is None or got is None:
            per_param[name] = math.inf
            continue
        per_param[name] = relative_error(got, ref)
    loss_err = abs(loss - loss_ref) / max(abs(loss_ref), _TINY) if loss != loss_ref else 0.0
    worst_param = max(per_param, key=lambda n: per_param[n]) if per_param else ""
    worst = max([loss_err, *per_param.values()])
    return ParityReport(
        strategy=label, loss_ref=loss_ref, loss=loss, loss_rel_error=loss_err,
        max_rel_error=worst, worst_param=worst_param, per_param_rel_error=per_param, rtol=rtol,
    )
