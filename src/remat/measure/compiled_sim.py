"""``simulate_compiled``: a compiled training step's peak, from the code inductor generates
for it, replayed on fake tensors (nothing is allocated; the user's model is not run or
compiled).

Example::

    >>> compiled = compile_with_budget(model, 0.5)
    >>> sim = simulate_compiled(compiled, batch)      # or remat.profile(compiled, batch,
    >>> sim.peak_bytes, sim.profile.recompute_flops   #                  simulate=True)

NOTE [ Simulating compiled code ]
    Inductor compiles from fake tensors: dynamo traces the region on fake inputs,
    AOTAutograd partitions the joint graph (``activation_memory_budget``), inductor
    lowers each partitioned graph, fuses and orders its kernels and writes a Python
    wrapper that allocates every buffer (``empty_strided_cpu``), reuses freed ones of
    the same size (``buf7 = buf4; del buf4  # reuse``), calls the kernels and extern
    ops, and frees each buffer and input after its last use (``del``). Only the C++
    (or Triton) kernels need compiling and real memory, and they only write into
    buffers the wrapper allocated. So the simulation runs the same pipeline on a
    fake copy and executes the wrapper with no-op kernels:

    1. The model is copied with fake tensors (NOTE [ Fake copies ] in fake.py),
       every compiled region uncompiled in the copy, and each region's call replaced
       by a :class:`_SimRegion` (the copy's ``_compiled_call_impl``).
    2. On its first call a region is captured whole by dynamo
       (``torch._dynamo.convert_frame.fullgraph_capture`` of the module's
       ``_call_impl``, as ``module.compile()`` / ``torch.compile(module)`` trace it).
       That capture installs no cache entry on any code object, so the user's
       compiled model is not touched and its recompile budget not spent; the
       automatic-dynamic shape records it leaves (``torch._dynamo.pgo``) are put
       back. It does count in dynamo's statistics (``unique_graphs``). Hooks on the
       region module itself are traced into the graph, where the real compile runs
       them outside it.
    3. The graph goes to inductor's ``compile_fx`` with the region's own activation
       memory budget (from its backend: remat's
       :class:`~remat.measure.compiled_graphs.CountingBackend`, or plain inductor at
       the current ``torch._functorch.config`` value, with the options of
       ``torch.compile(mode=/options=)``), the backward lowered at once, and an
       ``inner_compile`` that runs inductor's own ``compile_fx_inner`` with the FX
       graph cache off (a hit would skip code generation) up to
       ``GraphLowering.compile_to_module``: there the wrapper's source is generated
       (``GraphLowering.codegen``, no compiler runs) and taken instead of compiled.
    4. The wrapper source is executed with ``AsyncCompile`` replaced by no-op
       kernels, ``empty_strided_<device>`` by fake allocations and
       ``reinterpret_tensor`` by ``as_strided`` (:func:`_load_wrapper`). AOTAutograd's
       runtime calls it as it would call the compiled graph (boxed arguments, saved
       tensors, ``ctx`` cleared before backward so the wrapper's ``del`` frees them).
    5. The training step runs on the fake copy under
       :class:`~remat.measure.tracker.MemoryTracker`, as an eager
       ``remat.profile(simulate=True)`` step: eager code (embedding and head around
       compiled blocks, the loss, the optimizer) is tracked op by op, and inside a
       compiled graph the tracker sees exactly the wrapper's allocations, reuses and
       frees and the extern ops' outputs. Its peak is the step's.
    FLOPs: counted on the partitioned graphs at each run of them (NOTE [ Counting
    compiled FLOPs ] in compiled_graphs.py) plus the eager ops the tracker saw outside
    compiled graphs.

NOTE [ What the simulation does not see ]
    * Memory an extern kernel allocates inside itself (a workspace below the
      dispatcher): the tracker sees only the tensors an op returns. The eager
      tracker has the same blind spot.
    * Allocator behaviour: sizes are storage bytes (the CPU allocator does not
      round; CUDA's caching allocator rounds to 512 bytes and keeps blocks).
    * Graph breaks: a region must compile to one graph (``fullgraph_capture``);
      one that does not is refused (the real compile would split it into several
      graphs with eager code between them, which this does not model).
    * Dynamic shapes: refused (sizes would be symbolic).
    * Regions compiled with another backend than inductor (``aot_eager``, custom):
      refused; their memory is not inductor's. Inductor's C++ wrapper
      (``cpp_wrapper``) is not modelled: the Python wrapper is generated instead
      (not checked against a C++ wrapper's allocations). Tested on CPU; a fake
      CUDA device needs a CUDA build and Triton for code generation.
    * Inputs that change between calls of a region: each distinct input signature
      (structure, tensor metadata, scalar values, ``None``) is captured and compiled
      anew, as dynamo recompiles on a failed guard; other guards (module attributes,
      globals, grad mode) are not checked. The warm-up step that captures the regions
      runs under the tracker like the measured step, so code branching on known values
      (NOTE [ Data-dependent branches under fake tensors ] in shadow.py) gives each
      region the inputs the measured step gives it. Without that, Hugging Face decoder
      layers compiled per block were captured with a 4-D attention mask (transformers'
      packed-sequence check on fake position ids) and then run with ``None``: +7.2% on
      benchmarks/compile.py's hf-llama at budget 1.0, an AOTAutograd failure at 0.75.
    Measured against real compiled runs in benchmarks/compile_sim.py
    (benchmarks/RESULTS_compile.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode

from remat.errors import RematError
from remat.measure import shadow
from remat.measure.compiled import compiled_regions
from remat.measure.compiled_graphs import CompiledGraph, CountingBackend, backend_of, count_graph
from remat.measure.fake import check_fake_device, fake_batch, fake_optimizer, fake_tensor
from remat.measure.fake_kernels import install_fake_kernels
from remat.measure.results import BlockProfile, Profile
from remat.measure.step import LossFn, Step, clear_grads
from remat.measure.tracked import check_trainable, tracked_step
from remat.measure.tracker import MemoryTracker

__all__ = ["CompiledSimulation", "GraphMemory", "simulate_compiled"]

_API = "remat.profile(simulate=True)"


class CompiledSimulationError(RematError, ValueError):
    """A compiled model (or region) that the simulation cannot model honestly."""


@dataclass(frozen=True)
class GraphMemory:
    """One partitioned graph as inductor compiled it (its wrapper replayed in the step).

    Args:
        region: qualified name of the compiled region (``""``: the whole model).
        kind: ``"forward"``, ``"backward"`` or ``"inference"``.
        kernels: scheduler nodes (fused kernels and extern calls) in the graph.
        counts: FLOPs, recompute FLOPs and saved bytes of the graph.
    """

    region: str
    kind: str
    kernels: int
    counts: CompiledGraph

    def __post_init__(self) -> None:
        if self.kernels < 0:
            raise ValueError(f"GraphMemory({self.region!r}, {self.kind}): kernels must be "
                             f">= 0, got {self.kernels}")


@dataclass(frozen=True)
class CompiledSimulation:
    """A compiled step simulated (see NOTE [ Simulating compiled code ]).

    Args:
        profile: the step's :class:`Profile` (``simulated=True``, ``ops`` empty, no
            times): peak, activation bytes, static bytes, FLOPs (compiled graphs'
            plus eager code's), per-block saved bytes and FLOPs for per-block compiles.
        regions: qualified names of the compiled regions (``""``: the whole model).
        budgets: the activation memory budget each region was partitioned with.
        graphs: every distinct partitioned graph, with inductor's memory plan.
    """

    profile: Profile
    regions: tuple[str, ...]
    budgets: tuple[float, ...]
    graphs: tuple[GraphMemory, ...]

    @property
    def peak_bytes(self) -> int:
        """The simulated step's peak, static bytes included (``profile.peak_bytes``)."""
        return self.profile.peak_bytes


# ---- inductor's generated wrapper, with its kernels stubbed -------------------------------

class _Generated(Exception):
    """Raised from inside inductor once the wrapper's source exists: nothing is compiled."""


class _NoKernels:
    """Stands in for inductor's ``AsyncCompile`` in generated code: every kernel is a no-op
    (fused kernels only write into buffers the wrapper allocated; values do not matter)."""

    def __getattr__(self, name: str) -> Callable[..., Callable[..., None]]:
        def define(*args: Any, **kwargs: Any) -> Callable[..., None]:
            def kernel(*args: Any, **kwargs: Any) -> None:
                return None
            return kernel
        return define

    def wait(self, scope: Any) -> None:
        return None


_IMPORT = "from torch._inductor.async_compile import AsyncCompile\n"


def _empty_strided(device: str) -> Callable[..., torch.Tensor]:
    def empty(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_strided(tuple(size), tuple(stride), dtype=dtype, device=device)
    return empty


def _reinterpret(t: torch.Tensor, size: Sequence[int], stride: Sequence[int],
                 offset: int) -> torch.Tensor:
    # inductor's _reinterpret_tensor: offset is relative to the tensor's own
    return t.as_strided(tuple(size), tuple(stride), t.storage_offset() + offset)


def _no_check(*args: Any, **kwargs: Any) -> None:
    return None


def _load_wrapper(source: str, region: str) -> Callable[[list[Any]], Any]:
    """Execute inductor's wrapper source with stub kernels and fake-tensor allocation; the
    returned ``call(args)`` allocates, reuses and frees exactly as the compiled code does."""
    if _IMPORT not in source:
        raise CompiledSimulationError(
            f"{_API}: region {region or '<model>'}: this torch's inductor writes wrapper code "
            "remat does not recognise (no AsyncCompile import); cannot simulate it")
    scope: dict[str, Any] = {"__name__": "remat_simulated_wrapper", "AsyncCompile": _NoKernels}
    exec(compile(source.replace(_IMPORT, ""), "<inductor wrapper (remat simulation)>", "exec"),
         scope)
    for name in list(scope):
        if name.startswith("empty_strided_") and name != "empty_strided_p2p":
            scope[name] = _empty_strided(name[len("empty_strided_"):].replace("_pinned", ""))
    scope["reinterpret_tensor"] = _reinterpret
    scope["assert_size_stride"] = _no_check
    scope["assert_alignment"] = _no_check
    call = scope.get("call")
    if not callable(call):
        raise CompiledSimulationError(
            f"{_API}: region {region or '<model>'}: inductor's wrapper has no call(args); "
            "cannot simulate it")
    return call  # type: ignore[no-any-return]


_local = threading.local()
_patch_lock = threading.Lock()


@contextmanager
def _stop_at_wrapper(sink: list[tuple[str, int]]) -> Iterator[None]:
    """Make ``GraphLowering.compile_to_module`` (this thread's calls only) generate the
    wrapper's source, record ``(source, kernels)`` in ``sink`` and raise
    :class:`_Generated` instead of compiling anything."""
    from torch._inductor import config as inductor_config
    from torch._inductor.graph import GraphLowering

    with _patch_lock:
        original = GraphLowering.compile_to_module
        if not getattr(original, "_remat_sim", False):

            def compile_to_module(self: Any) -> Any:
                target = getattr(_local, "sink", None)
                if target is None:
                    return original(self)
                wrapper, _ = self.codegen()
                target.append((wrapper.value, len(self.scheduler.nodes)))
                raise _Generated

            compile_to_module._remat_sim = True  # type: ignore[attr-defined]
            GraphLowering.compile_to_module = compile_to_module  # type: ignore[method-assign]

    _local.sink = sink
    try:  # a cache hit would skip code generation
        with inductor_config.patch(fx_graph_cache=False, cpp_wrapper=False):
            yield
    finally:
        _local.sink = None


class _Replay:
    """A partitioned graph's stand-in at run time: inductor's own wrapper with no-op
    kernels, run on fake tensors (boxed calling convention, as inductor's)."""

    def __init__(self, call: Callable[[list[Any]], Any], counts: CompiledGraph,
                 counter: _Counter) -> None:
        # an instance attribute: the wrappers AOTAutograd puts around a compiled graph
        # (functools.wraps) copy the instance's __dict__, so they stay boxed too
        self._boxed_call = True
        self.call = call
        self.counts = counts
        self.counter = counter

    def __call__(self, args: list[Any]) -> Any:
        tracker = _tracker()
        first = len(tracker.ops) if tracker is not None else 0
        out = self.call(args)
        if tracker is not None:
            self.counter.add(self.counts, range(first, len(tracker.ops)))
        return out


def _tracker() -> MemoryTracker | None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, MemoryTracker):
            return mode
    return None


class _Counter:
    """The compiled graphs run during the tracked step, and the tracker's ops they ran
    (extern kernels: already in the graphs' FLOPs)."""

    def __init__(self) -> None:
        self.runs: list[CompiledGraph] = []
        self.inside: set[int] = set()

    def add(self, counts: CompiledGraph, ops: range) -> None:
        self.runs.append(counts)
        self.inside.update(ops)


# ---- one region ------------------------------------------------------------------------

def _region_backend(name: str, region: nn.Module, wrapper: nn.Module | None,
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
            raise CompiledSimulationError(
                f"{_API}: region {label} is compiled with a CountingBackend whose "
                "inner_compile is not inductor's; its memory is not inductor's to simulate")
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
    raise CompiledSimulationError(
        f"{_API}: region {label} is compiled with backend "
        f"{_backend_name(backend)!r}; only inductor (the "
        "default backend, or remat.integrations.compiler_budget) is simulated, from its own "
        "generated code. Profile it for real (simulate=False), or compile it with "
        "remat.integrations.compiler_budget.compile_with_budget")


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


class _SimRegion:
    """The fake copy's stand-in for one compiled region (set as ``_compiled_call_impl``)."""

    def __init__(self, name: str, module: nn.Module, budget: float,
                 options: dict[str, Any], counter: _Counter,
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
            raise CompiledSimulationError(
                f"{_API}: region {label} does not compile to one graph (dynamo: "
                f"{str(error).splitlines()[0]}); the simulation models one inductor graph "
                "per region. Compile the blocks instead (compile_blocks_with_budget), or "
                "profile for real (simulate=False)") from error
        backend_input = capture.backend_input
        if backend_input is None:
            raise CompiledSimulationError(f"{_API}: region {label} has no tensor op to compile")
        for value in backend_input.example_inputs:
            if isinstance(value, torch.SymInt) or (
                    isinstance(value, torch.Tensor)
                    and any(isinstance(s, torch.SymInt) for s in value.shape)):
                raise CompiledSimulationError(
                    f"{_API}: region {label} was traced with dynamic shapes; only static "
                    "shapes are simulated")
        context = TracingContext(backend_input.fake_mode)
        context.tensor_to_context = backend_input.tensor_to_context
        def inner(gm: fx.GraphModule, example_inputs: Sequence[Any], *rest: Any,
                  **inner_kwargs: Any) -> Any:
            from torch._inductor.compile_fx import compile_fx_inner

            kind = ("backward" if inner_kwargs.get("is_backward")
                    else "inference" if inner_kwargs.get("is_inference") else "forward")
            sink: list[tuple[str, int]] = []
            with _stop_at_wrapper(sink):
                try:
                    compile_fx_inner(gm, example_inputs, *rest, **inner_kwargs)
                except Exception:
                    if not sink:
                        raise
            if not sink:
                raise CompiledSimulationError(
                    f"{_API}: inductor compiled region {label}'s {kind} graph without "
                    "generating its wrapper (a cached or non-Python-wrapper path); cannot "
                    "simulate it")
            source, kernels = sink[-1]
            counts = count_graph(gm, label=self.name, kind=kind, budget=self.budget)
            self.graphs.append(GraphMemory(region=self.name, kind=kind, kernels=kernels,
                                           counts=counts))
            return _Replay(_load_wrapper(source, self.name), counts, self.counter)

        with (tracing(context),
              functorch_config.patch(activation_memory_budget=self.budget,
                                     enable_autograd_cache=False,
                                     force_non_lazy_backward_lowering=True),
              inductor_config.patch(self.options)):
            compiled = compile_fx(backend_input.graph_module, backend_input.example_inputs,
                                  inner_compile=inner)
        if not callable(compiled):
            raise CompiledSimulationError(
                f"{_API}: inductor returned a {type(compiled).__name__} for region {label}, "
                "not a callable (an AOT/export mode?); cannot simulate it")
        # the globals dynamo installed while tracing (modules, constructors of the output
        # structure) live in the traced function's global scope, as for a real compile
        return capture.forward_callable(
            compiled_fn=compiled, extra_globals=capture.graph_capture_output.f_globals)


# ---- the step ----------------------------------------------------------------------------

def _fake_copy(model: nn.Module, fake_mode: FakeTensorMode,
               device: torch.device | str | None,
               regions: Sequence[tuple[str, nn.Module]]
               ) -> tuple[nn.Module, dict[int, torch.Tensor], dict[str, nn.Module]]:
    """A fake copy of ``model`` with every compiled wrapper removed: ``OptimizedModule``s
    replaced by copies of the modules they wrap, in-place compiles undone. Returns the copy,
    ``{id(real tensor): fake}`` and ``{region name: its copy}``."""
    import copy

    from torch._dynamo.eval_frame import OptimizedModule

    install_fake_kernels()
    replaced: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) not in replaced:
                replaced[id(p)] = nn.Parameter(fake_tensor(p, fake_mode, device=device),
                                               requires_grad=p.requires_grad)
        for b in module.buffers(recurse=False):
            if id(b) not in replaced:
                replaced[id(b)] = fake_tensor(b, fake_mode, device=device)
        for t in module.__dict__.values():
            if isinstance(t, torch.Tensor) and id(t) not in replaced:
                replaced[id(t)] = fake_tensor(t, fake_mode, device=device)
    memo: dict[int, Any] = dict(replaced)
    for module in model.modules():  # an OptimizedModule copies as the module it wraps
        if isinstance(module, OptimizedModule):
            memo[id(module)] = copy.deepcopy(module._orig_mod, memo)
    copied = copy.deepcopy(model, memo)
    for module in copied.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
    root = memo.get(id(model), copied)
    by_name: dict[str, nn.Module] = {}
    for name, original in regions:
        by_name[name] = memo[id(original)]
    return root, replaced, by_name


def _wrappers(model: nn.Module) -> dict[int, nn.Module]:
    """``{id(wrapped module): OptimizedModule}`` for every OptimizedModule in ``model``."""
    from torch._dynamo.eval_frame import OptimizedModule

    return {id(m._orig_mod): m for m in model.modules() if isinstance(m, OptimizedModule)}


def simulate_compiled(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    device: torch.device | str | None = None,
) -> CompiledSimulation:
    """Simulate one training step of a compiled model on fake tensors: its peak, from the
    code inductor generates for it, without allocating, compiling or running the model.

    Each compiled region is traced and partitioned as its compile does (dynamo capture,
    the partitioner at the region's ``activation_memory_budget``) and inductor generates
    its wrapper (fusion, buffer reuse, frees after last use); the step then runs on fake
    tensors with each compiled graph's wrapper replayed with no-op kernels (NOTE
    [ Simulating compiled code ]). The trade-off: seconds of inductor lowering per
    region (about a real compile minus the C++ compiler) instead of a real step, and no
    memory at all, but workspace allocated inside extern kernels and allocator rounding
    are not seen (NOTE [ What the simulation does not see ]); the error against real
    compiled runs is in benchmarks/RESULTS_compile.md (within 0.25% on CPU for whole-model
    compiles, remat's models and Hugging Face Llama layers per block). The user's model
    is left as it was: no dynamo cache entry is added, nothing runs on its tensors.

    Args:
        model: a model compiled whole (``torch.compile(model)``, ``model.compile()``,
            :func:`~remat.integrations.compiler_budget.compile_with_budget`) or per block
            (``compile_blocks_with_budget``, ``compile_blocks``, ``remat.apply`` of a
            compiled plan) with inductor, in train mode. Real or meta tensors.
        batch, loss_fn, optimizer: as for :func:`remat.profile`.
        device: device the fake tensors claim to be on. Default: each tensor's own,
            CPU for meta tensors.

    Returns:
        A :class:`CompiledSimulation`; ``.profile`` is what ``remat.profile(model, batch,
        simulate=True)`` returns.

    Raises:
        ValueError: no compiled region, eval mode, no trainable parameter, or a region
            the simulation cannot model (:class:`CompiledSimulationError`: graph breaks,
            dynamic shapes, a backend other than inductor).

    Example:
        >>> from remat.integrations.compiler_budget import compile_with_budget
        >>> sim = simulate_compiled(compile_with_budget(model, 0.5), batch)
        >>> sim.profile.simulated, sim.budgets
        (True, (0.5,))
    """
    check_trainable(model, api=_API)
    check_fake_device(device)
    regions = compiled_regions(model)
    if not regions:
        raise ValueError(f"{_API}: {type(model).__name__} has no compiled module; "
                         "use remat.profile(model, batch, simulate=True) for eager models")
    wrappers = _wrappers(model)
    settings = [_region_backend(name, module, wrappers.get(id(module)), model)
                for name, module in regions]
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fmodel, replaced, copies = _fake_copy(model, fake_mode, device, regions)
    counter = _Counter()
    graphs: list[GraphMemory] = []
    for (name, _), (budget, options) in zip(regions, settings, strict=True):
        region = copies[name]
        region._compiled_call_impl = _SimRegion(name, region, budget, options, counter, graphs)
    fbatch = fake_batch(batch, fake_mode, device=device)
    fopt = fake_optimizer(optimizer, replaced) if optimizer is not None else None
    fstep = Step(fmodel, fbatch, loss_fn=loss_fn, optimizer=fopt)
    with fake_mode:
        try:
            clear_grads(fmodel)
            # warm-up: compiles the regions, creates the optimizer state. Tracked like the
            # measured step, so that code branching on known values (NOTE [ Data-dependent
            # branches under fake tensors ] in shadow.py) branches alike in both and each
            # region is captured with the inputs the measured step gives it.
            tracked_step(fstep, [])
        except DynamicOutputShapeException as error:
            raise shadow.data_dependent_error(error.func, error) from error
        clear_grads(fmodel)
        counter.runs.clear()
        counter.inside.clear()
        tracked = tracked_step(fstep, [])
    return _build(tracked, counter, regions, settings, graphs, fstep.device)


def _build(tracked: Any, counter: _Counter, regions: Sequence[tuple[str, nn.Module]],
           settings: Sequence[tuple[float, dict[str, Any]]], graphs: list[GraphMemory],
           device: torch.device) -> CompiledSimulation:
    tracker = tracked.tracker
    eager = {"forward": 0, "backward": 0, "recompute": 0}
    for index, op in enumerate(tracker.ops):
        if index not in counter.inside and op.phase in eager:
            eager[op.phase] += op.flops
    fwd, bwd, rec = eager["forward"], eager["backward"], eager["recompute"]
    per_region: dict[str, list[int]] = {}
    saved: dict[str, int] = {}
    for run in counter.runs:
        f = run.flops if run.kind == "forward" else 0
        r = run.recompute_flops
        b = run.flops - r if run.kind == "backward" else 0
        fwd, bwd, rec = fwd + f, bwd + b, rec + r
        sums = per_region.setdefault(run.label, [0, 0, 0])
        sums[0] += f
        sums[1] += b
        sums[2] += r
        saved[run.label] = saved.get(run.label, 0) + run.saved_bytes
    blocks = tuple(BlockProfile(name=name, saved_bytes=saved.get(name, 0),
                                forward_flops=per_region.get(name, [0, 0, 0])[0],
                                backward_flops=per_region.get(name, [0, 0, 0])[1],
                                recompute_flops=per_region.get(name, [0, 0, 0])[2])
                   for name, _ in regions if name)
    static = tracked.static
    profile = Profile(
        peak_bytes=tracker.peak_bytes,
        activation_bytes=tracker.activation_bytes,
        param_bytes=static.get("params", 0),
        buffer_bytes=static.get("buffers", 0),
        grad_bytes=tracked.grad_bytes,
        optimizer_bytes=static.get("optimizer_state", 0),
        batch_bytes=static.get("batch", 0),
        flops=fwd + bwd + rec,
        forward_flops=fwd,
        backward_flops=bwd,
        recompute_flops=rec,
        forward_ms=None,
        backward_ms=None,
        step_ms=None,
        blocks=blocks,
        ops=(),
        simulated=True,
        device=str(device),
        cuda_peak_bytes=None,
        peak_phase=tracker.peak_phase,
        peak_breakdown=tracker.peak_breakdown,
        phase_peaks=tracker.phase_peaks,
    )
    return CompiledSimulation(profile=profile, regions=tuple(name for name, _ in regions),
                              budgets=tuple(b for b, _ in settings), graphs=tuple(graphs))
