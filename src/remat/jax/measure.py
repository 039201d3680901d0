"""What XLA says one training step costs: its compiled peak, FLOPs and saved residuals.

The step, its compilation and XLA's analysis: analysis.py (NOTE [ The JAX step and
its peak ], NOTE [ CPU optimization barriers ], NOTE [ Compilation cache ]); one block
alone: block_measure.py (NOTE [ Residuals ]). This module puts them together as a
:class:`remat.Profile`, and counts the step's jaxpr.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from remat.core.cost import StepCost
from remat.core.results import BlockProfile, Profile
from remat.errors import message
from remat.jax.analysis import (
    LossFn,
    analyze_step,
    default_loss,
    prefetch_step,
    step_fn,
)
from remat.jax.analysis import clear_cache as _clear_step_cache
from remat.jax.block_measure import (
    block_forward_flops,
    block_inputs,
    block_saved_bytes,
    clear_block_cache,
    residual_bytes,
    subjaxprs,
)
from remat.jax.blocks import BlocksSpec, named_blocks
from remat.jax.strategies import remove

_API = "remat.jax.profile"


def clear_cache() -> None:
    """Forget every cached analysis (NOTE [ Compilation cache ] in analysis.py)."""
    _clear_step_cache()
    clear_block_cache()


def tree_bytes(tree: Any) -> int:
    """Bytes of every array leaf of ``tree``."""
    return sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


# ---- profile ------------------------------------------------------------------------------

def state_bytes(model: nnx.Module) -> tuple[int, int]:
    """``(parameter bytes, other state bytes)`` of an NNX model."""
    params = tree_bytes(nnx.state(model, nnx.Param))
    return params, tree_bytes(nnx.state(model)) - params


def profile(model: nnx.Module, batch: Any, *, loss_fn: LossFn | None = None,
            blocks: BlocksSpec = None) -> Profile:
    """One training step as XLA compiles it: exact peak bytes, FLOPs and residuals per block.

    The same :class:`remat.Profile` as the PyTorch side, with XLA's figures
    (NOTE [ The JAX step and its peak ]): ``peak_bytes`` is the compiled step's
    ``argument + output + temp - alias``; ``activation_bytes`` the residuals the
    forward saves for backward; ``recompute_flops`` the step's FLOPs minus those of
    the same step without remat. Nothing is run and nothing is timed (the times are
    None), and ``ops`` is empty: XLA fuses ops, so there is no op list to report.

    Args:
        model: a Flax NNX module, remat applied or not.
        batch: its batch.
        loss_fn: ``loss_fn(model, batch) -> scalar``. Default: the model returns its loss.
        blocks: which modules are blocks. Default: automatic; a model without repeated
            blocks gets an empty ``blocks``.

    Example:
        >>> model = build_model("gpt-tiny")
        >>> profile(model, make_batch(model, 2)).peak_bytes > 0
        True
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(message(_API, "the model must be a flax.nnx.Module",
                                {"found": type(model).__name__},
                                fix="pass a Flax NNX module (flax.nnx.Module)"))
    fn = default_loss if loss_fn is None else loss_fn
    graphdef, state = nnx.split(model)
    plain = remove(nnx.merge(graphdef, state))
    # the three steps compile side by side in the pool (NOTE [ Compilation cache ])
    prefetch_step(model, batch, loss_fn=fn)
    prefetch_step(plain, batch, loss_fn=fn)
    prefetch_step(plain, batch, loss_fn=fn, forward_only=True)
    step = analyze_step(model, batch, loss_fn=fn)
    base = analyze_step(plain, batch, loss_fn=fn)
    forward = analyze_step(plain, batch, loss_fn=fn, forward_only=True)
    activation = residual_bytes(lambda s, b: fn(nnx.merge(graphdef, s), b), state, batch)
    try:
        named = named_blocks(model, blocks)
    except ValueError:
        if blocks is not None:
            raise
        named = []
    block_rows: list[BlockProfile] = []
    if named:
        inputs = block_inputs(model, batch, [p for p, _ in named], fn)
        for path, block in named:
            plain = remove(nnx.merge(*nnx.split(block)))
            block_rows.append(BlockProfile(
                name=path, saved_bytes=block_saved_bytes(block, inputs[path]),
                forward_flops=block_forward_flops(plain, inputs[path]),
            ))
    recompute = max(0, step.flops - base.flops)
    forward_flops = min(forward.flops, step.flops - recompute)
    param_bytes, buffer_bytes = state_bytes(model)
    batch_bytes = tree_bytes(batch)
    cost = StepCost(
        peak_bytes=step.peak_bytes,
        breakdown=step.breakdown(param_bytes=param_bytes, buffer_bytes=buffer_bytes,
                                 batch_bytes=batch_bytes),
        activation_bytes=activation, param_bytes=param_bytes, buffer_bytes=buffer_bytes,
        grad_bytes=param_bytes, optimizer_bytes=0, batch_bytes=batch_bytes,
        forward_flops=forward_flops, backward_flops=step.flops - recompute - forward_flops,
        recompute_flops=recompute,
    )
    return Profile(cost=cost, blocks=tuple(block_rows), ops=(), simulated=False,
                   device=jax.devices()[0].platform)


# ---- the seeds' make_jaxpr comparison ---------------------------------------------------------

@dataclass(frozen=True)
class JaxprStats:
    """The step's jaxpr, counted: what ``jax.make_jaxpr`` shows with and without remat.

    Args:
        equations: equations of the step's top-level jaxpr.
        total_equations: equations including those inside sub-jaxprs (checkpoint, pjit).
        checkpoint_regions: ``checkpoint`` (remat) equations, at any depth.
        residual_bytes: bytes the forward saves for backward (NOTE [ Residuals ]).
    """

    equations: int
    total_equations: int
    checkpoint_regions: int
    residual_bytes: int


def jaxpr_stats(model: nnx.Module, batch: Any, *, loss_fn: LossFn | None = None) -> JaxprStats:
    """Count the equations of ``make_jaxpr`` of the step, and the residual bytes of its forward.

    Example:
        >>> jaxpr_stats(apply(model, "full"), batch).checkpoint_regions
        6
    """
    fn = default_loss if loss_fn is None else loss_fn
    graphdef, state = nnx.split(model)
    closed = jax.make_jaxpr(step_fn(graphdef, fn))(state, batch)
    counts = {"total": 0, "checkpoint": 0}

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            counts["total"] += 1
            if eqn.primitive.name in ("checkpoint", "remat", "remat2"):
                counts["checkpoint"] += 1
            for sub in subjaxprs(eqn.params):
                walk(sub)

    walk(closed.jaxpr)
    residuals = residual_bytes(lambda s, b: fn(nnx.merge(graphdef, s), b), state, batch)
    return JaxprStats(len(closed.jaxpr.eqns), counts["total"], counts["checkpoint"], residuals)
