"""Per-block ``jax.checkpoint`` policies, stored in the NNX graph, and the strategies that set them.

NOTE [ Where the decision lives ]
    ``apply`` gives each block a static attribute ``remat_policy`` (a frozen,
    hashable :class:`Policy`) and swaps the block's class for a cached subclass
    whose ``__call__`` runs the original one under ``nnx.remat(policy=...)``.
    Static attributes and node types are part of the NNX ``GraphDef``, so the
    decision survives ``nnx.split`` / ``nnx.merge``, ``nnx.jit``, ``nnx.grad`` and
    every transform built on them, and the parameter paths do not change: an
    ``nnx.state`` checkpoint of an applied model loads into a plain one and back.
    (A state checkpoint holds arrays only; a freshly built model restored from one
    needs ``apply`` again, e.g. from the plan's JSON.) ``remove`` restores the
    original class and deletes the attribute.

    Policies and the strategy strings live in policies.py (NOTE [ Strategies ]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx

from remat.errors import StrategyError, current_call, message
from remat.jax.blocks import BlocksSpec, named_blocks
from remat.jax.plans import Plan
from remat.jax.policies import (
    NONE,
    Policy,
    parse_policy,
    strategy_policies,
)

_ATTR = "remat_policy"


# ---- the block wrapper (NOTE [ Where the decision lives ]) ----------------------------------

_WRAPPERS: dict[type, type] = {}


def _is_array(value: Any) -> bool:
    return isinstance(value, (jax.Array, np.ndarray))


def _wrapped_call(original: Callable[..., Any]) -> Callable[..., Any]:
    def __call__(self: nnx.Module, *args: Any, **kwargs: Any) -> Any:
        _record(self, args, kwargs)
        policy: Policy = getattr(self, _ATTR, NONE)
        if policy.is_none:
            return original(self, *args, **kwargs)
        # Arrays go through the checkpoint; anything else (flags, None) is closed over.
        arrays = [i for i, a in enumerate(args) if _is_array(a)]

        def run(module: nnx.Module, *xs: Any) -> Any:
            full = list(args)
            for i, x in zip(arrays, xs, strict=True):
                full[i] = x
            return original(module, *full, **kwargs)

        fn = nnx.remat(run, policy=policy.jax_policy(), prevent_cse=True)
        return fn(self, *(args[i] for i in arrays))

    return __call__


def _wrapper_class(cls: type) -> type:
    if getattr(cls, "_remat_original", None) is not None:
        return cls
    if cls not in _WRAPPERS:
        wrapper = type(cls.__name__, (cls,), {
            "__call__": _wrapped_call(cls.__call__),  # type: ignore[operator]
            "_remat_original": cls,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        })
        _WRAPPERS[cls] = wrapper
    return _WRAPPERS[cls]


def set_policy(block: nnx.Module, policy: Policy) -> None:
    """Run ``block`` (one module, in place) under ``policy``; ``none`` removes remat from it."""
    if policy.is_none:
        _unset(block)
        return
    _set_class(block, _wrapper_class(type(block)))
    setattr(block, _ATTR, policy)


def _set_class(block: nnx.Module, cls: type) -> None:
    # object.__setattr__: NNX's __setattr__ would record "__class__" as a static
    # attribute of the node, so a block applied and removed would get a GraphDef
    # different from a never-applied one (and miss the compile cache).
    object.__setattr__(block, "__class__", cls)


def _unset(block: nnx.Module) -> None:
    original = getattr(type(block), "_remat_original", None)
    if original is not None:
        _set_class(block, original)
    if _ATTR in vars(block):
        delattr(block, _ATTR)


# ---- public API ------------------------------------------------------------------------------

StrategyLike = Any  # str | Plan | Mapping[str, str | Policy]
M = TypeVar("M", bound=nnx.Module)


def block_policies(model: nnx.Module, strategy: StrategyLike, *,
                   blocks: BlocksSpec = None) -> dict[str, Policy]:
    """The policy per block path that ``apply(model, strategy)`` sets."""
    if isinstance(strategy, Plan):
        names = [p for p, _ in named_blocks(model, list(strategy.block_names))]
        return {n: strategy.decision(n) for n in names}
    named = named_blocks(model, blocks)
    paths = [p for p, _ in named]
    if isinstance(strategy, Mapping):
        unknown = sorted(set(strategy) - set(paths))
        if unknown:
            raise StrategyError(message(
                current_call("remat.jax.apply"), f"{unknown} are not blocks",
                {"blocks": ", ".join(paths[:6]) + (" ..." if len(paths) > 6 else "")},
                fix="key the mapping by block paths"))
        return {p: parse_policy(strategy.get(p, NONE)) for p in paths}
    return dict(zip(paths, strategy_policies(strategy, len(paths)), strict=True))


def _check_offload(policies: Mapping[str, Policy]) -> None:
    if not any(p.kind == "offload" for p in policies.values()):
        return
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    if "pinned_host" not in kinds:
        raise StrategyError(message(
            current_call("remat.jax.apply"), "offload needs a backend with pinned_host memory",
            {"backend": jax.devices()[0].platform, "memories": sorted(kinds)},
            fix="use save_only_these_names instead"))


def apply(model: M, strategy: StrategyLike, *, blocks: BlocksSpec = None) -> M:
    """Checkpoint ``model``'s blocks with ``jax.checkpoint`` policies, in place.

    Trades compute for memory: a checkpointed block keeps only what its policy saves
    and recomputes the rest of its forward in backward. The decision is stored in the
    model's NNX graph (NOTE [ Where the decision lives ]) and replaces any earlier one.

    Args:
        model: a Flax NNX module with repeated blocks.
        strategy: a strategy string (:data:`STRATEGIES`), a :class:`~remat.jax.Plan`,
            or a mapping from block path to policy (string or :class:`Policy`).
        blocks: which modules are blocks (:data:`~remat.jax.blocks.BlocksSpec`).
            Default: automatic.

    Returns:
        ``model`` itself.

    Raises:
        StrategyError: unknown strategy/policy or unknown block paths.

    Example:
        >>> model = apply(build_model("gpt-tiny"), "dots_saveable")
        >>> decisions_of(model)["blocks.0"]
        'dots_saveable'
    """
    policies = block_policies(model, strategy, blocks=blocks)
    _check_offload(policies)
    remove(model)
    by_path = dict(named_blocks(model, list(policies)))
    for path, policy in policies.items():
        set_policy(by_path[path], policy)
    return model


def remove(model: M) -> M:
    """Undo :func:`apply`: every module runs without checkpoint again. Returns ``model``."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            _unset(node)
    return model


def decisions_of(model: nnx.Module) -> dict[str, str]:
    """The policy label of every checkpointed module, by path (``{}`` when none)."""
    out: dict[str, str] = {}
    for path, node in nnx.iter_graph(model):
        policy = getattr(node, _ATTR, None) if isinstance(node, nnx.Module) else None
        if isinstance(policy, Policy) and not policy.is_none:
            out[".".join(str(p) for p in path)] = policy.label()
    return out


F = TypeVar("F", bound=Callable[..., Any])


def checkpoint_layer(fn: F, policy: str | Policy = "nothing_saveable") -> F:
    """``jax.checkpoint`` a plain JAX layer function ``fn(params, x, ...)`` with a policy.

    For models written as functions rather than NNX modules: wrap the layer function
    once and call it in the stack's loop (or under ``jax.lax.scan``).

    Example:
        >>> layer = checkpoint_layer(lambda w, x: jnp.tanh(x @ w), "dots_saveable")
    """
    p = parse_policy(policy)
    if p.is_none:
        return fn
    return functools.wraps(fn)(jax.checkpoint(fn, policy=p.jax_policy()))  # type: ignore[return-value]


def current_policies(model: nnx.Module, paths: Sequence[str]) -> list[Policy]:
    """The policy each block in ``paths`` runs with now (``none`` when not applied)."""
    by_path = dict(named_blocks(model, list(paths)))
    return [getattr(by_path[p], _ATTR, NONE) for p in paths]


# ---- capturing block inputs (used by block_measure.py) ----------------------------------------

_CAPTURE_ATTR = "_remat_capture_path"
_CAPTURED: list[dict[str, tuple[tuple[Any, ...], dict[str, Any]]]] = []


def _aval(value: Any) -> Any:
    if _is_array(value):
        return jax.ShapeDtypeStruct(value.shape, value.dtype)
    return value


def _record(self: nnx.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    path = getattr(self, _CAPTURE_ATTR, None)
    if _CAPTURED and path is not None and path not in _CAPTURED[-1]:
        _CAPTURED[-1][path] = (tuple(_aval(a) for a in args),
                               {k: _aval(v) for k, v in kwargs.items()})


def capture_block_inputs(model: nnx.Module, paths: Sequence[str],
                         run: Callable[[], Any]) -> dict[str, tuple[tuple[Any, ...],
                                                                   dict[str, Any]]]:
    """Shapes of each block's first call while ``run()`` traces the model (e.g. eval_shape).

    Arrays come back as ``jax.ShapeDtypeStruct``; other arguments as they were.
    """
    by_path = dict(named_blocks(model, list(paths)))
    swapped = []
    for path, block in by_path.items():
        if getattr(type(block), "_remat_original", None) is None:
            swapped.append((block, type(block)))
            _set_class(block, _wrapper_class(type(block)))
        setattr(block, _CAPTURE_ATTR, path)
    _CAPTURED.append({})
    try:
        run()
        return _CAPTURED[-1]
    finally:
        _CAPTURED.pop()
        for block in by_path.values():
            delattr(block, _CAPTURE_ATTR)
        for block, cls in swapped:
            _set_class(block, cls)
