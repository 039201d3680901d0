"""Compile one training step (or any function) as remat.jax does, and read XLA's analysis.

NOTE [ The JAX step and its peak ]
    The step is ``jax.jit`` of ``nnx.value_and_grad(loss_fn)(model, batch)`` over
    the model's split state (``nnx.split``), returning the loss and the gradients.
    Its peak is XLA's own figure for the compiled executable
    (``compiled.memory_analysis()``)::

        peak = argument_size + output_size + temp_size - alias_size

    (device memory; host-offloaded bytes are reported apart, in
    ``host_temp_bytes``). FLOPs are ``compiled.cost_analysis()["flops"]``. XLA
    schedules the step and may rematerialize on its own, so these figures, not a
    sum of tensor sizes, are the truth remat plans against.

NOTE [ CPU optimization barriers ]
    ``jax.checkpoint`` keeps XLA from merging the recomputation back into the
    forward (CSE) with optimization barriers. XLA's CPU pipeline expands those
    barriers (pass ``cse_barrier_expander``) *before* CSE and scheduling, so on a
    stock CPU ``jax.jit`` the recomputation is merged away or scheduled early and
    remat saves no memory at all (XLA reports the same temp bytes for every
    policy). On CPU every step remat.jax compiles therefore disables that pass
    (:func:`compiler_options`); train with the same options (or
    ``XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander``) to get the
    memory the analysis reports. Other backends compile with no extra options.

NOTE [ Compilation cache ]
    Compiling is the cost of everything here. Analyses are cached by the model's
    ``GraphDef`` (which holds the remat policies, see strategies.py), the shapes
    of its state and batch, and the loss function, so a strategy or candidate is
    compiled once per process.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

__all__ = ["LossFn", "StepAnalysis", "analyze_fns", "analyze_step", "analyze_steps", "compile_fn",
           "clear_cache", "compiler_options", "default_loss", "shape_key", "step_fn"]

LossFn = Callable[[Any, Any], Any]


def default_loss(model: Any, batch: Any) -> Any:
    """The model returns its loss: ``model(**batch)``, ``model(*batch)`` or ``model(batch)``."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, tuple):
        return model(*batch)
    return model(batch)


@dataclass(frozen=True)
class StepAnalysis:
    """XLA's analysis of one compiled step (see NOTE [ The JAX step and its peak ]).

    Args:
        argument_bytes: ``memory_analysis().argument_size_in_bytes``.
        output_bytes: ``output_size_in_bytes`` (loss and gradients).
        temp_bytes: ``temp_size_in_bytes``.
        alias_bytes: ``alias_size_in_bytes``.
        host_temp_bytes: ``host_temp_size_in_bytes`` (offloaded residuals).
        flops: ``cost_analysis()["flops"]``.
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    host_temp_bytes: int
    flops: int

    def __post_init__(self) -> None:
        for key in ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes",
                    "host_temp_bytes", "flops"):
            if getattr(self, key) < 0:
                raise ValueError(f"StepAnalysis: {key} must be >= 0, got {getattr(self, key)}")

    @property
    def peak_bytes(self) -> int:
        """``argument + output + temp - alias`` bytes: XLA's device peak of the step."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    @classmethod
    def of(cls, compiled: Any) -> StepAnalysis:
        """Read a ``jax.stages.Compiled``'s memory and cost analyses."""
        mem = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
            cost = cost[0] if cost else {}
        return cls(
            argument_bytes=int(mem.argument_size_in_bytes),
            output_bytes=int(mem.output_size_in_bytes),
            temp_bytes=int(mem.temp_size_in_bytes),
            alias_bytes=int(mem.alias_size_in_bytes),
            host_temp_bytes=int(getattr(mem, "host_temp_size_in_bytes", 0) or 0),
            flops=int(round(float((cost or {}).get("flops", 0.0)))),
        )


def compiler_options() -> dict[str, str]:
    """XLA options remat.jax compiles with (see NOTE [ CPU optimization barriers ]).

    Example:
        >>> jax.jit(step).lower(state, batch).compile(compiler_options=compiler_options())
    """
    if jax.default_backend() == "cpu":
        return {"xla_disable_hlo_passes": "cse_barrier_expander"}
    return {}


def compile_fn(fn: Callable[..., Any], *args: Any, analysis_only: bool = True) -> Any:
    """``jax.jit(fn).lower(*args).compile(...)`` with :func:`compiler_options`.

    With ``analysis_only`` (nothing will run the executable), LLVM code generation
    runs at optimization level 0: it halves compile time and leaves XLA's buffer
    assignment, hence ``memory_analysis()``, and ``cost_analysis()`` unchanged
    (HLO passes are not affected; tests/jax checks the figures are identical).
    """
    options: dict[str, Any] = dict(compiler_options())
    if analysis_only:
        options["xla_backend_optimization_level"] = 0
    return jax.jit(fn).lower(*args).compile(compiler_options=options)


def _avals(tree: Any) -> Any:
    return jax.tree.map(lambda a: (tuple(np.shape(a)), str(np.asarray(a).dtype)
                                   if not hasattr(a, "dtype") else str(a.dtype)), tree)


def shape_key(tree: Any) -> Any:
    leaves, treedef = jax.tree.flatten(_avals(tree))
    return treedef, tuple(leaves)


def step_fn(graphdef: Any, loss_fn: LossFn) -> Callable[[Any, Any], Any]:
    """The (un-jitted) step over split state: ``(state, batch) -> (loss, grads)``."""
    def step(state: Any, batch: Any) -> Any:
        model = nnx.merge(graphdef, state)
        return nnx.value_and_grad(loss_fn)(model, batch)

    return step


_CACHE: dict[Any, StepAnalysis] = {}


def _lower(model: nnx.Module, batch: Any, fn: LossFn, forward_only: bool
           ) -> tuple[Any, Callable[[], Any]]:
    """The cache key of the step, and a thunk that compiles it (tracing done already)."""
    graphdef, state = nnx.split(model)
    key = (graphdef, shape_key(state), shape_key(batch), fn, forward_only)
    if key in _CACHE:
        return key, lambda: None
    if forward_only:
        def forward(s: Any, b: Any) -> Any:
            return fn(nnx.merge(graphdef, s), b)

        target: Callable[[Any, Any], Any] = forward
    else:
        target = step_fn(graphdef, fn)
    lowered = jax.jit(target).lower(state, batch)
    return key, functools.partial(lowered.compile, compiler_options=_analysis_options())


def _analysis_options() -> dict[str, Any]:
    """Options of an analysis-only compile (see :func:`compile_fn`)."""
    return {**compiler_options(), "xla_backend_optimization_level": 0}


def analyze_step(model: nnx.Module, batch: Any, *, loss_fn: LossFn | None = None,
                 forward_only: bool = False) -> StepAnalysis:
    """Compile the training step (or its forward) and return XLA's analysis of it.

    Args:
        model: an NNX module, with or without remat applied.
        batch: what ``loss_fn`` takes after the model.
        loss_fn: ``loss_fn(model, batch) -> scalar``. Default: :func:`default_loss`.
        forward_only: analyse ``loss_fn`` alone (no gradients). Default: False.

    Example:
        >>> analyze_step(build_model("gpt-tiny"), make_batch("gpt-tiny", 2)).peak_bytes > 0
        True
    """
    fn = default_loss if loss_fn is None else loss_fn
    key, compile_ = _lower(model, batch, fn, forward_only)
    if key not in _CACHE:
        _CACHE[key] = StepAnalysis.of(compile_())
    return _CACHE[key]


def analyze_steps(model: nnx.Module, batch: Any, configurations: Sequence[Callable[[], Any]],
                  *, loss_fn: LossFn | None = None) -> list[StepAnalysis]:
    """:func:`analyze_step` for several configurations of ``model``, compiled in parallel.

    Each ``configure()`` sets the model up (e.g. applies policies); the step is traced
    right after it, in this thread, and the XLA compilations then run in a thread pool
    (XLA compiles without the GIL). See NOTE [ Compilation cache ].
    """
    fn = default_loss if loss_fn is None else loss_fn
    pending: list[tuple[Any, Callable[[], Any]]] = []
    for configure in configurations:
        configure()
        pending.append(_lower(model, batch, fn, False))
    _compile_all({key: thunk for key, thunk in pending if key not in _CACHE})
    return [_CACHE[key] for key, _ in pending]


def analyze_fns(jobs: Sequence[tuple[Any, Callable[..., Any], tuple[Any, ...]]]
                ) -> list[StepAnalysis]:
    """XLA's analysis of ``fn(*args)`` for each ``(key, fn, args)``, compiled in parallel.

    Cached by ``key`` and the shapes of ``args`` (NOTE [ Compilation cache ]); ``args``
    may be arrays or ``jax.ShapeDtypeStruct``: nothing runs.
    """
    keys = [(key, shape_key(args)) for key, _, args in jobs]
    todo: dict[Any, Callable[[], Any]] = {}
    for full_key, (_, fn, args) in zip(keys, jobs, strict=True):
        if full_key not in _CACHE and full_key not in todo:
            lowered = jax.jit(fn).lower(*args)
            todo[full_key] = functools.partial(lowered.compile,
                                               compiler_options=_analysis_options())
    _compile_all(todo)
    return [_CACHE[key] for key in keys]


def _compile_all(todo: Mapping[Any, Callable[[], Any]]) -> None:
    """Run the compile thunks in a thread pool and cache their analyses."""
    if not todo:
        return
    workers = max(1, min(len(todo), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = dict(zip(todo, pool.map(lambda t: t(), todo.values()), strict=True))
    for key, compiled in results.items():
        _CACHE[key] = StepAnalysis.of(compiled)


def clear_cache() -> None:
    """Forget every cached step analysis (NOTE [ Compilation cache ])."""
    _CACHE.clear()
