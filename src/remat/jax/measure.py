"""What XLA says one training step costs: its compiled peak, FLOPs and saved residuals.

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

NOTE [ Residuals ]
    Saved residuals come from JAX's own inspection
    (``jax.ad_checkpoint.print_saved_residuals``'s data, ``saved_residuals``):
    every value the forward keeps for backward, minus the function's arguments
    (parameters and inputs exist anyway) and literals. A block's residuals are
    measured on the block alone, on the inputs it receives inside the model.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from remat.jax._core import BlockProfile, Profile
from remat.jax.blocks import BlocksSpec, named_blocks
from remat.jax.strategies import capture_block_inputs, remove

__all__ = [
    "LossFn",
    "StepAnalysis",
    "analyze_step",
    "analyze_steps",
    "block_forward_flops",
    "block_saved_bytes",
    "block_step_flops",
    "compile_fn",
    "compiler_options",
    "default_loss",
    "jaxpr_stats",
    "profile",
    "residual_bytes",
    "step_fn",
]

LossFn = Callable[[Any, Any], Any]
_API = "remat.jax.profile"


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


def _key(tree: Any) -> Any:
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
    key = (graphdef, _key(state), _key(batch), fn, forward_only)
    if key in _CACHE:
        return key, lambda: None
    if forward_only:
        def forward(s: Any, b: Any) -> Any:
            return fn(nnx.merge(graphdef, s), b)

        target: Callable[[Any, Any], Any] = forward
    else:
        target = step_fn(graphdef, fn)
    lowered = jax.jit(target).lower(state, batch)
    options: dict[str, Any] = {**compiler_options(), "xla_backend_optimization_level": 0}
    return key, lambda: lowered.compile(compiler_options=options)


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
    from concurrent.futures import ThreadPoolExecutor

    fn = default_loss if loss_fn is None else loss_fn
    pending: list[tuple[Any, Callable[[], Any]]] = []
    for configure in configurations:
        configure()
        pending.append(_lower(model, batch, fn, False))
    todo = {key: thunk for key, thunk in pending if key not in _CACHE}
    if todo:
        workers = max(1, min(len(todo), os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = dict(zip(todo, pool.map(lambda t: t(), todo.values()), strict=True))
        for key, compiled in results.items():
            _CACHE[key] = StepAnalysis.of(compiled)
    return [_CACHE[key] for key, _ in pending]


def clear_cache() -> None:
    """Forget every cached analysis (NOTE [ Compilation cache ])."""
    _CACHE.clear()
    _BLOCK_CACHE.clear()


def _nbytes(tree: Any) -> int:
    return sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


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
    # Block functions name their inputs ``xs`` (see _block_fn): "from the argument xs[0]".
    return keep_args_after is not None and "argument xs" in description


# ---- per block ----------------------------------------------------------------------------

def block_saved_bytes(block: nnx.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> int:
    """Residual bytes ``block`` saves for backward under its policy, its inputs included.

    Measured on the block alone, on its in-model input shapes (NOTE [ Residuals ]).
    """
    args, kwargs = inputs
    f, state, xs = _block_fn(block, args, kwargs)
    return residual_bytes(f, state, *xs, keep_args_after=1)


def block_forward_flops(block: nnx.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]]
                        ) -> int:
    """XLA FLOPs of ``block``'s forward alone; cached by graph and shapes."""
    args, kwargs = inputs
    f, state, xs = _block_fn(block, args, kwargs)
    key = (nnx.graphdef(block), _key(state), tuple((x.shape, str(x.dtype)) for x in xs),
           repr(sorted(kwargs.items())),
           repr([a for a in args if not isinstance(a, jax.ShapeDtypeStruct)]))
    if key not in _BLOCK_CACHE:
        _BLOCK_CACHE[key] = StepAnalysis.of(compile_fn(f, state, *xs)).flops
    return _BLOCK_CACHE[key]


def block_step_flops(block: nnx.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> int:
    """XLA FLOPs of ``block``'s forward and backward alone (recompute included); cached.

    The function returns the forward's output as well as the input gradients, so XLA
    cannot drop the forward and count only the recomputation.
    """
    args, kwargs = inputs
    f, state, xs = _block_fn(block, args, kwargs)
    key = ("vjp", nnx.graphdef(block), _key(state), tuple((x.shape, str(x.dtype)) for x in xs),
           repr(sorted(kwargs.items())),
           repr([a for a in args if not isinstance(a, jax.ShapeDtypeStruct)]))
    if key not in _BLOCK_CACHE:
        def vjp(s: Any, *inputs: Any) -> Any:
            out, pullback = jax.vjp(f, s, *inputs)
            return out, pullback(jax.tree.map(jnp.ones_like, out))

        _BLOCK_CACHE[key] = StepAnalysis.of(compile_fn(vjp, state, *xs)).flops
    return _BLOCK_CACHE[key]


_BLOCK_CACHE: dict[Any, int] = {}


def _block_fn(block: nnx.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> tuple[Callable[..., Any], Any, list[Any]]:
    graphdef, state = nnx.split(block)
    arrays = [i for i, a in enumerate(args) if isinstance(a, jax.ShapeDtypeStruct)]

    def f(s: Any, *xs: Any) -> Any:  # "xs": see _is_kept_arg
        full = list(args)
        for i, x in zip(arrays, xs, strict=True):
            full[i] = x
        return nnx.merge(graphdef, s)(*full, **kwargs)

    return f, state, [args[i] for i in arrays]


def tagged_names(block: nnx.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]]
                 ) -> tuple[str, ...]:
    """The ``checkpoint_name`` tags inside ``block``'s forward, in first-use order."""
    args, kwargs = inputs
    f, state, xs = _block_fn(block, args, kwargs)
    found: dict[str, None] = {}

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "name":
                found[str(eqn.params["name"])] = None
            for sub in _subjaxprs(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(f)(state, *xs).jaxpr)
    return tuple(found)


def _subjaxprs(params: Mapping[str, Any]) -> list[Any]:
    out = []
    for value in params.values():
        for v in value if isinstance(value, (list, tuple)) else (value,):
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                out.append(inner)
    return out


def block_inputs(model: nnx.Module, batch: Any, paths: Sequence[str], loss_fn: LossFn
                 ) -> dict[str, tuple[tuple[Any, ...], dict[str, Any]]]:
    """Each block's input shapes inside ``loss_fn(model, batch)`` (traced, not run)."""
    graphdef, state = nnx.split(model)

    def trace() -> Any:
        gd, st = nnx.split(model)
        return jax.eval_shape(lambda s, b: loss_fn(nnx.merge(gd, s), b), st, batch)

    del graphdef, state
    found = capture_block_inputs(model, paths, trace)
    missing = [p for p in paths if p not in found]
    if missing:
        raise ValueError(f"remat.jax: blocks {missing} were never called by loss_fn(model, "
                         "batch); pass blocks= naming the modules the forward calls")
    return found


# ---- profile ------------------------------------------------------------------------------

def _state_bytes(model: nnx.Module) -> tuple[int, int]:
    params = _nbytes(nnx.state(model, nnx.Param))
    return params, _nbytes(nnx.state(model)) - params


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
        raise TypeError(f"{_API}: model must be a flax.nnx.Module, got {type(model).__name__}")
    fn = default_loss if loss_fn is None else loss_fn
    step = analyze_step(model, batch, loss_fn=fn)
    graphdef, state = nnx.split(model)
    plain = remove(nnx.merge(graphdef, state))
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
    param_bytes, buffer_bytes = _state_bytes(model)
    return Profile(
        peak_bytes=step.peak_bytes, activation_bytes=activation, param_bytes=param_bytes,
        buffer_bytes=buffer_bytes, grad_bytes=param_bytes, optimizer_bytes=0,
        batch_bytes=_nbytes(batch), flops=step.flops, forward_flops=forward_flops,
        backward_flops=step.flops - recompute - forward_flops, recompute_flops=recompute,
        forward_ms=None, backward_ms=None, step_ms=None, blocks=tuple(block_rows), ops=(),
        simulated=False, device=jax.devices()[0].platform,
        peak_breakdown={"arguments": step.argument_bytes, "outputs": step.output_bytes,
                        "temporaries": step.temp_bytes, "aliased": -step.alias_bytes},
    )


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
            for sub in _subjaxprs(eqn.params):
                walk(sub)

    walk(closed.jaxpr)
    residuals = residual_bytes(lambda s, b: fn(nnx.merge(graphdef, s), b), state, batch)
    return JaxprStats(len(closed.jaxpr.eqns), counts["total"], counts["checkpoint"], residuals)
