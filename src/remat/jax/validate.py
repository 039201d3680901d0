"""Gradient parity: a remat'd JAX step against the same step without remat."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np
from flax import nnx

from remat.core.parity import ParityReport
from remat.jax.analysis import (
    LossFn,
    compile_in_pool,
    default_loss,
    shape_key,
    step_executable,
    step_fn,
)
from remat.jax.blocks import BlocksSpec, named_blocks
from remat.jax.strategies import apply, current_policies, remove


def run_step(model: nnx.Module, batch: Any, *, loss_fn: LossFn | None = None
             ) -> tuple[float, dict[str, np.ndarray]]:
    """Run the compiled step once: the loss and every gradient by parameter path."""
    fn = default_loss if loss_fn is None else loss_fn
    _, state = nnx.split(model)
    loss, grads = _executable(model, batch, fn).result()(state, batch)
    flat = {".".join(str(k) for k in path): np.asarray(
                leaf.get_value() if hasattr(leaf, "get_value") else leaf)
            for path, leaf in nnx.to_flat_state(grads)}
    return float(loss), flat


def _executable(model: nnx.Module, batch: Any, fn: LossFn) -> Future[Any]:
    """The step's executable, compiling in the pool (cached by graph and shapes).

    Code generation level 0 (see compile_fn): same HLO, hence the same arithmetic
    for the reference and the remat'd step, at half the compile time. A step
    compiled for its analysis (profile, compare, plan) is that same program: its
    kept executable is run, not compiled again (NOTE [ Compilation cache ]).
    """
    graphdef, state = nnx.split(model)
    key = (graphdef, shape_key(state), shape_key(batch), fn)
    failed = key in _EXECUTABLES and _EXECUTABLES[key].done() \
        and _EXECUTABLES[key].exception() is not None
    if key not in _EXECUTABLES or failed:
        analysed = step_executable(model, batch, loss_fn=fn)
        if analysed is not None:
            done: Future[Any] = Future()
            done.set_result(analysed)
            _EXECUTABLES[key] = done
        else:
            _EXECUTABLES[key] = compile_in_pool(step_fn(graphdef, fn), state, batch)
    return _EXECUTABLES[key]


_EXECUTABLES: dict[Any, Future[Any]] = {}


def _rel(value: np.ndarray, ref: np.ndarray) -> float:
    value64, ref64 = value.astype(np.float64), ref.astype(np.float64)
    scale = float(np.max(np.abs(ref64))) if ref64.size else 0.0
    diff = float(np.max(np.abs(value64 - ref64))) if ref64.size else 0.0
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def validate(model: nnx.Module, batch: Any, strategy_or_plan: Any = None, *,
             loss_fn: LossFn | None = None, blocks: BlocksSpec = None,
             rtol: float = 1e-5) -> ParityReport:
    """Loss and every gradient of ``model`` under a strategy, against no remat.

    Both steps are compiled and run as remat.jax compiles them (see
    NOTE [ CPU optimization barriers ] in analysis.py). The model is left as it was.

    Args:
        model: a Flax NNX module.
        batch: its batch.
        strategy_or_plan: a strategy string, :class:`~remat.jax.Plan` or per-block
            mapping; None checks the policies already applied to ``model``.
        loss_fn: ``loss_fn(model, batch) -> scalar``. Default: the model returns its loss.
        blocks: which modules are blocks. Default: automatic.
        rtol: tolerance on ``max|g - g_ref| / max|g_ref|`` (and the loss). Default: 1e-5.

    Returns:
        A :class:`remat.ParityReport` (``.passed``, ``.raise_if_failed()``).

    Example:
        >>> validate(model, batch, "dots_saveable").passed
        True
    """
    paths = [p for p, _ in named_blocks(model, blocks)] if strategy_or_plan is not None else []
    before = current_policies(model, paths) if paths else []
    label = "applied" if strategy_or_plan is None else (
        strategy_or_plan if isinstance(strategy_or_plan, str) else type(strategy_or_plan).__name__
    )
    try:
        if strategy_or_plan is not None:
            apply(model, strategy_or_plan, blocks=blocks)
        reference = remove(nnx.merge(*nnx.split(model)))
        fn = default_loss if loss_fn is None else loss_fn
        _executable(reference, batch, fn)  # both compile side by side
        loss, grads = run_step(model, batch, loss_fn=fn)
        loss_ref, grads_ref = run_step(reference, batch, loss_fn=fn)
    finally:
        if paths:
            apply(model, dict(zip(paths, before, strict=True)))
    per_param = {name: _rel(grads[name], ref) for name, ref in grads_ref.items()}
    loss_err = abs(loss - loss_ref) / abs(loss_ref) if loss_ref else abs(loss)
    worst = max(per_param, key=lambda k: per_param[k]) if per_param else ""
    return ParityReport(
        strategy=label, loss_ref=loss_ref, loss=loss, loss_rel_error=loss_err,
        max_rel_error=max([loss_err, *per_param.values()]), worst_param=worst,
        per_param_rel_error=per_param, rtol=rtol,
    )


