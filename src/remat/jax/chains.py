"""The block chain a candidate policy is measured on (NOTE [ Block chain ] in candidates.py).

``x -> B_p(x) -> B(.) -> B(.)``, forward and backward, lowered one policy at a
time so each compiles (in the pool, NOTE [ Compilation cache ]) while the next
is traced; compiled with :func:`~remat.jax.analysis.difference_options`
(NOTE [ Difference compiles ]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from flax import nnx

from remat.jax.analysis import StepAnalysis, job_key, lower_job, submit_lowered, wait
from remat.jax.block_measure import BlockInputs
from remat.jax.policies import Policy
from remat.jax.strategies import remove, set_policy

#: Copies of the block in the chain a candidate is measured on (NOTE [ Block chain ]).
CHAIN_BLOCKS = 3


def with_policy(block: nnx.Module, policy: Policy) -> nnx.Module:
    """A copy of ``block`` (same state) running under ``policy`` alone."""
    copy = nnx.merge(*nnx.split(block))
    remove(copy)
    set_policy(copy, policy)
    return copy


def _carried(inputs: BlockInputs) -> int | None:
    """Index of the block's first array argument, the activation the chain carries."""
    args, _ = inputs
    return next((i for i, a in enumerate(args) if isinstance(a, jax.ShapeDtypeStruct)), None)


def chains(block: nnx.Module, inputs: BlockInputs) -> bool:
    """Whether the block maps its first array argument to an array of the same shape."""
    args, kwargs = inputs
    index = _carried(inputs)
    if index is None or kwargs and any(isinstance(v, jax.ShapeDtypeStruct)
                                       for v in kwargs.values()):
        return False
    graphdef, state = nnx.split(block)

    def call(s: Any, *xs: Any) -> Any:
        full = list(args)
        for i, x in zip(_array_positions(args), xs, strict=True):
            full[i] = x
        return nnx.merge(graphdef, s)(*full, **kwargs)

    try:
        out = jax.eval_shape(call, state, *(args[i] for i in _array_positions(args)))
    except Exception:  # noqa: BLE001 - any failure: measure on the whole step instead
        return False
    x = args[index]
    return isinstance(out, jax.ShapeDtypeStruct) and (out.shape, out.dtype) == (x.shape, x.dtype)


def _array_positions(args: tuple[Any, ...]) -> list[int]:
    return [i for i, a in enumerate(args) if isinstance(a, jax.ShapeDtypeStruct)]


def chain_analysis(block: nnx.Module, inputs: BlockInputs, policies: Sequence[Policy],
                   *, blocks: int = CHAIN_BLOCKS) -> list[StepAnalysis]:
    """XLA's analysis of the block chain with the first copy under each policy.

    See NOTE [ Block chain ]. One analysis per policy, compiled in parallel and cached.
    """
    keys = []
    for key, lower in lower_chains(block, inputs, policies, blocks=blocks):
        submit_lowered(key, lower()[1])  # compiles while the next chain is lowered
        keys.append(key)
    return wait(keys)


def lower_chains(block: nnx.Module, inputs: BlockInputs, policies: Sequence[Policy],
                  *, blocks: int = CHAIN_BLOCKS
                  ) -> Iterator[tuple[Any, Callable[[], tuple[Any, Any]]]]:
    """``(cache key, lower)`` of the chain per policy; ``lower()`` is :func:`lower_job`'s."""
    args, kwargs = inputs
    positions = _array_positions(args)
    carried = positions[0]
    plain = remove(nnx.merge(*nnx.split(block)))
    graphdef, state = nnx.split(plain)
    x = args[carried]
    others = [args[i] for i in positions[1:]]
    tail = _tail_fn(graphdef, args, kwargs, positions)
    for policy in policies:
        first = nnx.graphdef(with_policy(plain, policy))
        graphdefs = (first, *([graphdef] * (blocks - 1)))
        key, chain_args = ("chain", graphdefs, repr(inputs)), ((state,) * blocks, x, others, x)
        yield job_key(key, chain_args, differences_only=True), functools.partial(
            lower_job, key, _chain_fn(first, tail, args, kwargs, positions), chain_args,
            differences_only=True)


def _block_call(graphdef: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                positions: Sequence[int]) -> Callable[..., Any]:
    """``(state, x, others) -> y``: the block, its carried and other array inputs explicit."""
    def call(state: Any, x: Any, others: Any) -> Any:
        full = list(args)
        full[positions[0]] = x
        for i, value in zip(positions[1:], others, strict=True):
            full[i] = value
        return nnx.merge(graphdef, state)(*full, **kwargs)

    return call


def _chain_fn(first: Any, tail: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any], positions: Sequence[int]) -> Callable[..., Any]:
    """The chain of NOTE [ Block chain ]: ``first`` (under the policy), then ``tail``.

    ``tail`` (the ``none`` copies) is one ``jax.jit`` function shared by every
    policy's chain, so JAX traces it once; XLA inlines it, so the compiled chain is
    the same as with the copies written out.
    """
    head = _block_call(first, args, kwargs, positions)

    def forward(states: Any, x: Any, others: Any) -> Any:
        return tail(states[1:], head(states[0], x, others), others)

    def chain(states: Any, x: Any, others: Any, cotangent: Any) -> Any:
        out, pullback = jax.vjp(forward, states, x, others)
        return out, pullback(cotangent)

    return chain


def _tail_fn(graphdef: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
             positions: Sequence[int]) -> Callable[..., Any]:
    call = _block_call(graphdef, args, kwargs, positions)

    def tail(states: Any, x: Any, others: Any) -> Any:
        for state in states:
            x = call(state, x, others)
        return x

    return jax.jit(tail)
