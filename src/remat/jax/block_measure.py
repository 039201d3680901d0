"""Measure one block alone: its residuals, its FLOPs, its tagged names, its inputs in the model.

NOTE [ Residuals ]
    Saved residuals come from JAX's own inspection
    (``jax.ad_checkpoint.print_saved_residuals``'s data, ``saved_residuals``):
    every value the forward keeps for backward, minus the function's arguments
    (parameters and inputs exist anyway) and literals. A block's residuals are
    measured on the block alone, on the inputs it receives inside the model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from remat.errors import current_call, message
from remat.jax.analysis import LossFn, analyze_fns, shape_key
from remat.jax.strategies import capture_block_inputs

#: A block's call as captured in the model: positional arguments (arrays as
#: ``jax.ShapeDtypeStruct``) and keyword arguments.
BlockInputs = tuple[tuple[Any, ...], dict[str, Any]]


def residual_bytes(fn: Callable[..., Any], *args: Any, keep_args_after: int | None = None
                   ) -> int:
    """Bytes ``fn(*args)`` saves for backward, arguments and literals excluded.

    See NOTE [ Residuals ].

    Args:
        fn, args: the function and its arguments.
        keep_args_after: count residuals that are the function's own positional
            arguments from this index on (a block's inputs, which the model keeps
            for the block only because of its backward). Default: count none.
    """
    from jax._src.ad_checkpoint import saved_residuals

    total = 0
    for aval, description in saved_residuals(fn, *args):
        if "from a literal" in description:
            continue
        if "from the argument" in description and not _is_kept_arg(description,
                                                                   keep_args_after):
            continue
        shaped: Any = aval
        total += int(np.prod(shaped.shape)) * np.dtype(shaped.dtype).itemsize
    return total


def _is_kept_arg(description: str, keep_args_after: int | None) -> bool:
    # Block functions name their inputs ``xs`` (see block_fn): "from the argument xs[0]".
    return keep_args_after is not None and "argument xs" in description


# ---- per block ----------------------------------------------------------------------------

def block_saved_bytes(block: nnx.Module, inputs: BlockInputs) -> int:
    """Residual bytes ``block`` saves for backward under its policy, its inputs included.

    Measured on the block alone, on its in-model input shapes (NOTE [ Residuals ]).
    """
    key = ("saved", *_block_key(block, inputs))
    if key not in _BLOCK_CACHE:
        args, kwargs = inputs
        f, state, xs = block_fn(block, args, kwargs)
        _BLOCK_CACHE[key] = residual_bytes(f, state, *xs, keep_args_after=1)
    return int(_BLOCK_CACHE[key])


def _block_key(block: nnx.Module, inputs: BlockInputs) -> tuple[Any, ...]:
    """What a block measurement depends on: its graph (policy included), shapes, inputs."""
    return nnx.graphdef(block), shape_key(nnx.state(block)), repr(inputs)


def block_forward_flops(block: nnx.Module, inputs: BlockInputs
                        ) -> int:
    """XLA FLOPs of ``block``'s forward alone; cached by graph and shapes (compiled in the pool)."""
    args, kwargs = inputs
    f, state, xs = block_fn(block, args, kwargs)
    key = ("block-forward", *_block_key(block, inputs))
    return analyze_fns([(key, f, (state, *xs))])[0].flops


def block_step_flops(block: nnx.Module, inputs: BlockInputs) -> int:
    """XLA FLOPs of ``block``'s forward and backward alone (recompute included); cached.

    The function returns the forward's output as well as the input gradients, so XLA
    cannot drop the forward and count only the recomputation.
    """
    args, kwargs = inputs
    f, state, xs = block_fn(block, args, kwargs)

    def vjp(s: Any, *inputs: Any) -> Any:
        out, pullback = jax.vjp(f, s, *inputs)
        return out, pullback(jax.tree.map(jnp.ones_like, out))

    key = ("block-vjp", *_block_key(block, inputs))
    return analyze_fns([(key, vjp, (state, *xs))])[0].flops


_BLOCK_CACHE: dict[Any, Any] = {}


def block_fn(block: nnx.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> tuple[Callable[..., Any], Any, list[Any]]:
    graphdef, state = nnx.split(block)
    arrays = [i for i, a in enumerate(args) if isinstance(a, jax.ShapeDtypeStruct)]

    def f(s: Any, *xs: Any) -> Any:  # "xs": see _is_kept_arg
        full = list(args)
        for i, x in zip(arrays, xs, strict=True):
            full[i] = x
        return nnx.merge(graphdef, s)(*full, **kwargs)

    return f, state, [args[i] for i in arrays]


def tagged_names(block: nnx.Module, inputs: BlockInputs
                 ) -> tuple[str, ...]:
    """The ``checkpoint_name`` tags inside ``block``'s forward, in first-use order; cached."""
    key = ("names", *_block_key(block, inputs))
    if key not in _BLOCK_CACHE:
        _BLOCK_CACHE[key] = _tagged_names(block, inputs)
    return tuple(_BLOCK_CACHE[key])


def _tagged_names(block: nnx.Module, inputs: BlockInputs) -> tuple[str, ...]:
    args, kwargs = inputs
    f, state, xs = block_fn(block, args, kwargs)
    found: dict[str, None] = {}

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "name":
                found[str(eqn.params["name"])] = None
            for sub in subjaxprs(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(f)(state, *xs).jaxpr)
    return tuple(found)


def subjaxprs(params: Mapping[str, Any]) -> list[Any]:
    out = []
    for value in params.values():
        for v in value if isinstance(value, (list, tuple)) else (value,):
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                out.append(inner)
    return out


def block_inputs(model: nnx.Module, batch: Any, paths: Sequence[str], loss_fn: LossFn
                 ) -> dict[str, BlockInputs]:
    """Each block's input shapes inside ``loss_fn(model, batch)`` (traced, not run)."""
    graphdef, state = nnx.split(model)

    def trace() -> Any:
        gd, st = nnx.split(model)
        return jax.eval_shape(lambda s, b: loss_fn(nnx.merge(gd, s), b), st, batch)

    del graphdef, state
    found = capture_block_inputs(model, paths, trace)
    missing = [p for p in paths if p not in found]
    if missing:
        raise ValueError(message(current_call("remat.jax.plan"),
                                 f"blocks {missing} were never called by loss_fn(model, batch)",
                                 fix="pass blocks= naming the modules the forward calls"))
    return found


def memo(key: Any, compute: Callable[[], Any]) -> Any:
    """``compute()``, cached under ``key`` with the block measurements (cleared with them)."""
    if key not in _BLOCK_CACHE:
        _BLOCK_CACHE[key] = compute()
    return _BLOCK_CACHE[key]


def clear_block_cache() -> None:
    """Forget the cached block FLOPs."""
    _BLOCK_CACHE.clear()
