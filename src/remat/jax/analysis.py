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

NOTE [ Difference compiles ]
    Block chains (candidates.py) are compiled only to compare them with each
    other: a candidate is the chain's peak drop and FLOP increase over the
    same chain without remat. On CPU they compile with XLA's older loop
    emitters (``xla_cpu_use_fusion_emitters=False``, :func:`difference_options`),
    which about halves their compile time on gpt-small
    and moves every chain's absolute peak by the same few hundred bytes:
    the differences, hence the candidate tables, are identical
    (``tests/jax/test_candidates.py`` checks it). Every step whose figures are
    reported (profile, compare, the plan's measured peak) compiles with the
    default pipeline. An XLA without the option compiles them the default way.

NOTE [ Compilation cache ]
    Compiling is the cost of everything here (about 1 s per program on CPU,
    whatever its size). Analyses are cached by the model's ``GraphDef`` (which
    holds the remat policies, see strategies.py), the shapes of its state and
    batch, and the loss function, so a strategy or candidate is compiled once
    per process. Compiles run in a process-wide pool of one thread per core
    (XLA compiles without the GIL) while the caller traces the next program;
    the cache holds a future until the compile is done. A training step's
    analysis compile is the very program :func:`remat.jax.validate` runs (the
    same ``jax.jit(step_fn(...)).lower(state, batch)``, the same
    :func:`_analysis_options`), so the executables of the last
    :data:`_KEPT_STEPS` concrete steps analysed are kept and validate runs them
    (:func:`step_executable`) instead of compiling the step a second time.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from remat.core.cost import Category
from remat.errors import message

LossFn = Callable[[Any, Any], Any]


def default_loss(model: Any, batch: Any) -> Any:
    """The model returns its loss; how it is called follows NOTE [ Calling the model ].

    Raises:
        TypeError: a dict batch whose keys the model's ``__call__`` does not take, and a
            ``__call__`` that does not take the dict itself; the message says how remat
            called it and that ``loss_fn=`` calls it your way.
    """
    if isinstance(batch, Mapping):
        signature = _call_signature(model)
        if signature is None or _takes_keywords(signature, batch):
            return model(**batch)
        if _takes_one_argument(signature):
            return model(batch)
        raise TypeError(message(
            "remat.jax", f"cannot call {type(model).__name__}{signature} with a dict batch",
            {"batch keys": ", ".join(map(str, batch)),
             "remat's default loss calls": "model(**batch) when __call__ takes the batch's "
                                           "keys, model(batch) when it takes one argument"},
            fix="pass loss_fn=lambda model, batch: <a scalar loss> (e.g. model(batch["
                "'input_ids'], batch['labels'])) to remat.jax.profile / plan / compare / "
                "validate"))
    if isinstance(batch, tuple):
        return model(*batch)
    return model(batch)


# NOTE [ Calling the model ]
#   The default loss calls the model the way its ``__call__`` is written: a dict batch
#   goes in as keywords, ``model(**batch)``, when ``__call__`` takes every key (or has
#   ``**kwargs``) and needs nothing else; as one argument, ``model(batch)``, when
#   ``__call__`` takes one argument (``def __call__(self, batch)``); a tuple as
#   positional arguments, ``model(*batch)``; anything else as one argument. A dict that
#   fits neither way is refused before tracing, with the fix (``loss_fn=``), rather than
#   failing inside jax with "got an unexpected keyword argument". A ``__call__`` whose
#   signature cannot be read is called with keywords.


def _call_signature(model: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(model.__call__)
    except (TypeError, ValueError):
        return None


def _takes_keywords(signature: inspect.Signature, batch: Mapping[Any, Any]) -> bool:
    params = signature.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return True
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = {p.name for p in params if p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return set(batch) <= named and required <= set(batch)


def _takes_one_argument(signature: inspect.Signature) -> bool:
    positional = [p for p in signature.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in signature.parameters.values()
                if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return len(positional) >= 1 and len(required) <= 1


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
                raise ValueError(message("StepAnalysis", f"{key} must be >= 0",
                                         {key: getattr(self, key)},
                                         fix="pass bytes and FLOPs as non-negative ints"))

    @property
    def peak_bytes(self) -> int:
        """``argument + output + temp - alias`` bytes: XLA's device peak of the step."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    def breakdown(self, *, param_bytes: int, buffer_bytes: int,
                  batch_bytes: int) -> dict[Category, int]:
        """The peak by :class:`~remat.core.cost.Category` (NOTE [ Categories of each
        backend ] in remat/core/cost.py); the values sum to :attr:`peak_bytes`.

        Args:
            param_bytes: bytes of the model's ``nnx.Param`` state (its gradients too).
            buffer_bytes: bytes of the model's other state.
            batch_bytes: bytes of the batch.
        """
        out: dict[Category, int] = {}

        def add(category: Category, nbytes: int) -> None:
            if nbytes:
                out[category] = out.get(category, 0) + nbytes

        known = param_bytes + buffer_bytes + batch_bytes
        if known <= self.argument_bytes:
            add(Category.PARAMETERS, param_bytes)
            add(Category.BUFFERS, buffer_bytes)
            add(Category.BATCH, batch_bytes)
            add(Category.OTHER, self.argument_bytes - known)
        else:  # XLA pruned arguments: no exact split
            add(Category.OTHER, self.argument_bytes)
        outputs = self.output_bytes - self.alias_bytes  # aliased outputs reuse arguments
        grads = min(param_bytes, outputs)
        add(Category.GRADIENTS, grads)
        add(Category.OTHER, outputs - grads)
        add(Category.STEP_TEMPORARIES, self.temp_bytes)
        return out

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


_CACHE: dict[Any, StepAnalysis | Future[StepAnalysis]] = {}
_POOL: list[ThreadPoolExecutor] = []
#: Executables kept of the training steps last compiled for their analysis, by their
#: :data:`_CACHE` key (NOTE [ Compilation cache ]); at most :data:`_KEPT_STEPS`, oldest
#: dropped first.
_KEPT: OrderedDict[Any, Any] = OrderedDict()
_KEPT_LOCK = threading.Lock()
_KEPT_STEPS = 16


def _pool() -> ThreadPoolExecutor:
    """The process's compile pool: one thread per core (XLA compiles without the GIL)."""
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1),
                                        thread_name_prefix="remat-jax-compile"))
    return _POOL[0]


def compile_in_pool(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """:func:`compile_fn` (analysis-only options) in the compile pool: a future executable.

    Example:
        >>> compile_in_pool(step, state, batch).result()(state, batch)  # runs the step
    """
    lowered = jax.jit(fn).lower(*args)
    return _pool().submit(lowered.compile, compiler_options=_analysis_options())


def _submit(key: Any, lowered: Any, *, differences_only: bool = False,
            keep: bool = False) -> None:
    """Start compiling ``lowered`` in the pool; its analysis is cached under ``key``.

    ``differences_only``: with :func:`difference_options` (NOTE [ Difference compiles ]).
    ``keep``: keep the executable for :func:`step_executable` (NOTE [ Compilation cache ]).
    """
    def compile_() -> StepAnalysis:
        if differences_only:
            try:
                return StepAnalysis.of(lowered.compile(compiler_options=difference_options()))
            except Exception as exc:  # noqa: BLE001 - an XLA without the option: default
                if "compile option" not in str(exc):
                    raise
        compiled = lowered.compile(compiler_options=_analysis_options())
        if keep:
            with _KEPT_LOCK:
                _KEPT[key] = compiled
                while len(_KEPT) > _KEPT_STEPS:
                    _KEPT.popitem(last=False)
        return StepAnalysis.of(compiled)

    _CACHE[key] = _pool().submit(compile_)


def difference_options() -> dict[str, Any]:
    """Options of a compile whose figures are only compared with each other.

    See NOTE [ Difference compiles ]. Example:
        >>> difference_options()["xla_backend_optimization_level"]
        0
    """
    if jax.default_backend() != "cpu":
        return _analysis_options()
    return {**_analysis_options(), "xla_cpu_use_fusion_emitters": False}


def _result(key: Any) -> StepAnalysis:
    """The cached analysis of ``key``, waiting for its compile if it is still running."""
    value = _CACHE[key]
    if isinstance(value, Future):
        try:
            value = value.result()
        except BaseException:
            _CACHE.pop(key, None)  # a failed compile is not cached
            raise
        _CACHE[key] = value
    return value


def _step_key(model: nnx.Module, batch: Any, fn: LossFn, forward_only: bool) -> tuple[Any, Any]:
    graphdef, state = nnx.split(model)
    return (graphdef, shape_key(state), shape_key(batch), fn, forward_only), (graphdef, state)


def _lower(model: nnx.Module, batch: Any, fn: LossFn, forward_only: bool) -> Any:
    """Trace and lower the step, start compiling it, and return its cache key.

    Tracing happens in this thread (it reads the model's current policies); the
    compile runs in the pool, so the caller can trace the next step meanwhile.
    """
    key, (graphdef, state) = _step_key(model, batch, fn, forward_only)
    if key in _CACHE:
        return key
    if forward_only:
        def forward(s: Any, b: Any) -> Any:
            return fn(nnx.merge(graphdef, s), b)

        target: Callable[[Any, Any], Any] = forward
    else:
        target = step_fn(graphdef, fn)
    # an abstract step (nnx.eval_shape, jax.ShapeDtypeStruct) is never run: not kept
    keep = not forward_only and not any(isinstance(x, jax.ShapeDtypeStruct)
                                        for x in jax.tree.leaves((state, batch)))
    _submit(key, jax.jit(target).lower(state, batch), keep=keep)
    return key


def step_executable(model: nnx.Module, batch: Any, *, loss_fn: LossFn) -> Any | None:
    """The training step's executable if it was compiled for its analysis and is still kept.

    It is the program :func:`compile_in_pool` would compile for
    ``step_fn(graphdef, loss_fn)`` on ``(state, batch)``, with the same options
    (NOTE [ Compilation cache ]); None when it was not kept or its compile failed.
    """
    key, _ = _step_key(model, batch, loss_fn, False)
    if key not in _CACHE:
        return None
    try:
        _result(key)  # its compile may still be running
    except Exception:  # noqa: BLE001 - the caller compiles it and reports its own error
        return None
    with _KEPT_LOCK:
        return _KEPT.get(key)


def _analysis_options() -> dict[str, Any]:
    """Options of an analysis-only compile (see :func:`compile_fn`)."""
    return {**compiler_options(), "xla_backend_optimization_level": 0}


def prefetch_step(model: nnx.Module, batch: Any, *, loss_fn: LossFn | None = None,
                  forward_only: bool = False) -> None:
    """Start compiling the step in the background; :func:`analyze_step` picks it up.

    Example:
        >>> prefetch_step(model, batch)   # compiles while the caller traces other things
        >>> analyze_step(model, batch).peak_bytes > 0
        True
    """
    _lower(model, batch, default_loss if loss_fn is None else loss_fn, forward_only)


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
    return _result(_lower(model, batch, fn, forward_only))


def analyze_steps(model: nnx.Module, batch: Any, configurations: Sequence[Callable[[], Any]],
                  *, loss_fn: LossFn | None = None) -> list[StepAnalysis]:
    """:func:`analyze_step` for several configurations of ``model``, compiled in parallel.

    Each ``configure()`` sets the model up (e.g. applies policies); the step is traced
    right after it, in this thread, while the pool compiles the steps traced before
    (XLA compiles without the GIL). See NOTE [ Compilation cache ].
    """
    fn = default_loss if loss_fn is None else loss_fn
    keys = []
    for configure in configurations:
        configure()
        keys.append(_lower(model, batch, fn, False))
    return [_result(key) for key in keys]


def analyze_fns(jobs: Sequence[tuple[Any, Callable[..., Any], tuple[Any, ...]]]
                ) -> list[StepAnalysis]:
    """XLA's analysis of ``fn(*args)`` for each ``(key, fn, args)``, compiled in parallel.

    Cached by ``key`` and the shapes of ``args`` (NOTE [ Compilation cache ]); ``args``
    may be arrays or ``jax.ShapeDtypeStruct``: nothing runs.
    """
    return [_result(key) for key in submit_fns(jobs)]


def submit_fns(jobs: Sequence[tuple[Any, Callable[..., Any], tuple[Any, ...]]], *,
               differences_only: bool = False) -> list[Any]:
    """Lower each ``(key, fn, args)`` and start compiling it; the cache keys, for :func:`wait`.

    ``differences_only``: see NOTE [ Difference compiles ]. Default: False.
    """
    keys = []
    for key, fn, args in jobs:
        full_key, lowered = lower_job(key, fn, args, differences_only=differences_only)
        if lowered is not None:
            _submit(full_key, lowered, differences_only=differences_only)
        keys.append(full_key)
    return keys


def lower_job(key: Any, fn: Callable[..., Any], args: tuple[Any, ...], *,
              differences_only: bool = False) -> tuple[Any, Any]:
    """``(cache key, jax.jit(fn).lower(*args))``; the lowering is None when the key is cached.

    Compile it with :func:`submit_lowered` (or not: a lowering's
    ``cost_analysis()`` is XLA's count of the *unoptimized* program, no compile).
    """
    full_key = job_key(key, args, differences_only=differences_only)
    if full_key in _CACHE:
        return full_key, None
    return full_key, jax.jit(fn).lower(*args)


def job_key(key: Any, args: tuple[Any, ...], *, differences_only: bool = False) -> Any:
    """The cache key :func:`lower_job` gives ``(key, fn, args)``, without lowering."""
    return key, shape_key(args), differences_only


def submit_lowered(full_key: Any, lowered: Any) -> None:
    """Start compiling a lowering from :func:`lower_job` (None: cached, nothing to do)."""
    if lowered is not None and full_key not in _CACHE:
        _submit(full_key, lowered, differences_only=full_key[-1])


def cached(full_key: Any) -> StepAnalysis | None:
    """The analysis cached under ``full_key`` (waiting for its compile), or None."""
    return _result(full_key) if full_key in _CACHE else None


def wait(keys: Sequence[Any]) -> list[StepAnalysis]:
    """The analyses of keys returned by :func:`submit_fns`, waiting for their compiles."""
    return [_result(key) for key in keys]


def clear_cache() -> None:
    """Forget every cached step analysis (NOTE [ Compilation cache ])."""
    for value in list(_CACHE.values()):
        if isinstance(value, Future):
            value.cancel()
    _CACHE.clear()
    with _KEPT_LOCK:
        _KEPT.clear()
