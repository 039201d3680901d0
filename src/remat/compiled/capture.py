"""One compiled region of a fake copy: captured whole by dynamo on its first call (and
again for inputs of another signature), partitioned and lowered by inductor at the
region's own budget, then replayed: steps 2 and 3 of NOTE [ Simulating compiled code ] in
simulate.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn

from remat.compiled.graphs import CountingBackend, backend_of, count_graph
from remat.compiled.replay import (
    _API,
    CompiledSimulationError,
    GraphMemory,
    GraphRuns,
    Replay,
    load_wrapper,
    stop_at_wrapper,
)
from remat.errors import message

# ---- one region ------------------------------------------------------------------------

def region_backend(name: str, region: nn.Module, wrapper: nn.Module | None,
                    model: nn.Module) -> tuple[float, dict[str, Any]]:
    """The activation memory budget and inductor options the region was compiled with."""
    from torch._dynamo.eval_frame import OptimizeContext, innermost_backend
    from torch._functorch import config as functorch_config

    label = name or "<model>"
    counting = backend_of(region) or (backend_of(wrapper) if wrapper is not None else None)
    if counting is None and name == "":
        counting = backend_of(model)
    if counting is not None:
        if counting._inner is not None:
            raise CompiledSimulationError(message(
                _API, f"region {label} is compiled with a CountingBackend whose "
                "inner_compile is not inductor's",
                {"so": "its memory is not inductor's to simulate"},
                fix="profile it for real (simulate=False)"))
        budget = counting.budget
        return (float(functorch_config.activation_memory_budget) if budget is None
                else budget), {}
    ctx: Any = None
    if wrapper is not None:  # torch.compile(module): an OptimizedModule
        ctx = getattr(wrapper, "dynamo_ctx", None)
    else:  # module.compile(): find the dynamo context in the compiled call's closure
        impl = getattr(region, "_compiled_call_impl", None)
        for cell in getattr(impl, "__closure__", None) or ():
            if isinstance(cell.cell_contents, OptimizeContext):
                ctx = cell.cell_contents
    backend = innermost_backend(ctx.callback) if ctx is not None else None
    if isinstance(backend, CountingBackend):
        return (float(functorch_config.activation_memory_budget) if backend.budget is None
                else backend.budget), {}
    if type(backend).__name__ == "_TorchCompileInductorWrapper":
        options = dict(getattr(backend, "config", {}) or {})
        return float(functorch_config.activation_memory_budget), options
    raise CompiledSimulationError(message(
        _API, f"region {label} is compiled with backend {_backend_name(backend)!r}",
        {"simulated": "only inductor (the default backend, or "
                      "remat.compiled.install), from its own generated code"},
        fix="profile it for real (simulate=False), or compile it with "
            "remat.compiled.install.compile_with_budget"))


@contextmanager
def _dynamo_state_kept() -> Iterator[None]:
    """Put dynamo's per-code automatic-dynamic records (``torch._dynamo.pgo``) back as they
    were: a capture records the shapes it saw, which would make a later real compile of
    the same code treat them as changing (dynamic)."""
    import copy

    from torch._dynamo.pgo import get_code_state

    state = get_code_state()
    before = {key: copy.deepcopy(value) for key, value in state.items()}
    try:
        yield
    finally:
        state.clear()
        state.update(before)


def _backend_name(backend: Any) -> str:
    for attribute in ("compiler_name", "__name__"):
        name = getattr(backend, attribute, None)
        if isinstance(name, str):
            return name
    return type(backend).__name__


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What a region's call is traced for: the inputs' structure, each tensor's metadata and
    each other leaf's value (scalars, ``None``) or type (what dynamo's guards check, short of
    module state and globals)."""
    from torch.utils._pytree import tree_flatten

    leaves, spec = tree_flatten((args, kwargs))
    parts: list[Any] = [spec]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device,
                          leaf.requires_grad))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            parts.append((type(leaf), leaf))
        else:
            parts.append(type(leaf))
    return tuple(parts)


class SimRegion:
    """The fake copy's stand-in for one compiled region (set as ``_compiled_call_impl``)."""

    def __init__(self, name: str, module: nn.Module, budget: float,
                 options: dict[str, Any], counter: GraphRuns,
                 graphs: list[GraphMemory]) -> None:
        self.name = name
        self.module = module
        self.budget = budget
        self.options = options
        self.counter = counter
        self.graphs = graphs
        self.fns: list[tuple[Any, Callable[..., Any]]] = []  # (input signature, callable)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The captured callable has no guards: called with other inputs (a mask that is
        # now None) it would run a graph traced for different ones. A call whose inputs
        # differ is captured anew, as dynamo recompiles when a guard fails.
        signature = _signature(args, kwargs)
        fn = next((f for s, f in self.fns if s == signature), None)
        if fn is None:
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes():  # compile outside the fake mode and the tracker
                fn = self._compile(args, kwargs)
            self.fns.append((signature, fn))
        return fn(self.module, *args, **kwargs)

    def _compile(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[..., Any]:
        from torch._dynamo import convert_frame
        from torch._dynamo.exc import Unsupported
        from torch._dynamo.utils import dynamo_timed, get_metrics_context
        from torch._functorch import config as functorch_config
        from torch._guards import TracingContext, tracing
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        label = self.name or "<model>"
        try:
            with (_dynamo_state_kept(), get_metrics_context(),
                  dynamo_timed("remat_simulate_capture")):
                capture = convert_frame.fullgraph_capture(self.module._call_impl, args, kwargs)
        except Unsupported as error:
            raise CompiledSimulationError(message(
                _API, f"region {label} does not compile to one graph",
                {"dynamo": str(error).splitlines()[0],
                 "why": "the simulation models one inductor graph per region"},
                fix="compile the blocks instead (compile_blocks_with_budget), or profile for "
                    "real (simulate=False)")) from error
        backend_input = capture.backend_input
        if backend_input is None:
            raise CompiledSimulationError(message(_API,
                                                  f"region {label} has no tensor op to compile",
                                                  fix="profile it for real (simulate=False)"))
        for value in backend_input.example_inputs:
            if isinstance(value, torch.SymInt) or (
                    isinstance(value, torch.Tensor)
                    and any(isinstance(s, torch.SymInt) for s in value.shape)):
                raise CompiledSimulationError(message(
                    _API, f"region {label} was traced with dynamic shapes",
                    {"simulated": "static shapes only"},
                    fix="compile with dynamic=False, or profile for real (simulate=False)"))
        context = TracingContext(backend_input.fake_mode)
        context.tensor_to_context = backend_input.tensor_to_context
        def inner(gm: fx.GraphModule, example_inputs: Sequence[Any], *rest: Any,
                  **inner_kwargs: Any) -> Any:
            from torch._inductor.compile_fx import compile_fx_inner

            kind = ("backward" if inner_kwargs.get("is_backward")
                    else "inference" if inner_kwargs.get("is_inference") else "forward")
            sink: list[tuple[str, int]] = []
            with stop_at_wrapper(sink):
                try:
                    compile_fx_inner(gm, example_inputs, *rest, **inner_kwargs)
                except Exception:
                    if not sink:
                        raise
            if not sink:
                raise CompiledSimulationError(message(
                    _API, f"inductor compiled region {label}'s {kind} graph without "
                    "generating its wrapper (a cached or non-Python-wrapper path)",
                    fix="profile it for real (simulate=False)"))
            source, kernels = sink[-1]
            counts = count_graph(gm, label=self.name, kind=kind, budget=self.budget)
            self.graphs.append(GraphMemory(region=self.name, kind=kind, kernels=kernels,
                                           counts=counts))
            return Replay(load_wrapper(source, self.name), counts, self.counter)

        with (tracing(context),
              functorch_config.patch(activation_memory_budget=self.budget,
                                     enable_autograd_cache=False,
                                     force_non_lazy_backward_lowering=True),
              inductor_config.patch(self.options)):
            compiled = compile_fx(backend_input.graph_module, backend_input.example_inputs,
                                  inner_compile=inner)
        if not callable(compiled):
            raise CompiledSimulationError(message(
                _API, f"inductor returned a {type(compiled).__name__} for region {label}, "
                "not a callable (an AOT/export mode?)", fix="profile it for real (simulate=False)"))
        # the globals dynamo installed while tracing (modules, constructors of the output
        # structure) live in the traced function's global scope, as for a real compile
        return capture.forward_callable(
            compiled_fn=compiled, extra_globals=capture.graph_capture_output.f_globals)
