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
       by a :class:`~remat.compiled.capture.SimRegion` (the copy's
       ``_compiled_call_impl``).
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
       :class:`~remat.compiled.graphs.CountingBackend`, or plain inductor at
       the current ``torch._functorch.config`` value, with the options of
       ``torch.compile(mode=/options=)``), the backward lowered at once, and an
       ``inner_compile`` that runs inductor's own ``compile_fx_inner`` with the FX
       graph cache off (a hit would skip code generation) up to
       ``GraphLowering.compile_to_module``: there the wrapper's source is generated
       (``GraphLowering.codegen``, no compiler runs) and taken instead of compiled.
    4. The wrapper source is executed with ``AsyncCompile`` replaced by no-op
       kernels, ``empty_strided_<device>`` by fake allocations and
       ``reinterpret_tensor`` by ``as_strided``
       (:func:`~remat.compiled.replay.load_wrapper`). AOTAutograd's runtime
       calls it as it would call the compiled graph (boxed arguments, saved tensors,
       ``ctx`` cleared before backward so the wrapper's ``del`` frees them).
    5. The training step runs on the fake copy under
       :class:`~remat.measure.tracker.MemoryTracker`, as an eager
       ``remat.profile(simulate=True)`` step: eager code (embedding and head around
       compiled blocks, the loss, the optimizer) is tracked op by op, and inside a
       compiled graph the tracker sees exactly the wrapper's allocations, reuses and
       frees and the extern ops' outputs. Its peak is the step's.
    FLOPs: counted on the partitioned graphs at each run of them (NOTE [ Counting
    compiled FLOPs ] in graphs.py) plus the eager ops the tracker saw outside
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
      layers compiled per block would be captured with a 4-D attention mask
      (transformers' packed-sequence check on fake position ids) and then run with
      ``None``: a region measured for inputs it never gets, or an AOTAutograd failure.
    Measured against real compiled runs in benchmarks/compile_sim.py
    (benchmarks/RESULTS_compile.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode

from remat.compiled.capture import SimRegion, region_backend
from remat.compiled.measure import compiled_regions
from remat.compiled.replay import (
    _API,
    GraphMemory,
    GraphRuns,
)
from remat.core.cost import StepCost
from remat.core.results import BlockProfile, Profile
from remat.errors import message
from remat.measure import shadow
from remat.measure.fake import check_fake_device, fake_batch, fake_optimizer, fake_tensor
from remat.measure.fake_kernels import install_fake_kernels
from remat.measure.ledger import categorized
from remat.measure.step import LossFn, Step, clear_grads
from remat.measure.tracked_step import check_trainable, tracked_step


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
            :func:`~remat.compiled.install.compile_with_budget`) or per block
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
        >>> from remat.compiled.install import compile_with_budget
        >>> sim = simulate_compiled(compile_with_budget(model, 0.5), batch)
        >>> sim.profile.simulated, sim.budgets
        (True, (0.5,))
    """
    check_trainable(model, api=_API)
    check_fake_device(device)
    regions = compiled_regions(model)
    if not regions:
        raise ValueError(message(_API, f"{type(model).__name__} has no compiled module",
                                 fix="use remat.profile(model, batch, simulate=True) for eager "
                                     "models"))
    wrappers = _wrappers(model)
    settings = [region_backend(name, module, wrappers.get(id(module)), model)
                for name, module in regions]
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fmodel, replaced, copies = _fake_copy(model, fake_mode, device, regions)
    counter = GraphRuns()
    graphs: list[GraphMemory] = []
    for (name, _), (budget, options) in zip(regions, settings, strict=True):
        region = copies[name]
        region._compiled_call_impl = SimRegion(name, region, budget, options, counter, graphs)
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


def _build(tracked: Any, counter: GraphRuns, regions: Sequence[tuple[str, nn.Module]],
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
    cost = StepCost(
        peak_bytes=tracker.peak_bytes,
        breakdown=categorized(tracker.peak_breakdown),
        activation_bytes=tracker.activation_bytes,
        **tracked.resident_fields(),
        forward_flops=fwd,
        backward_flops=bwd,
        recompute_flops=rec,
    )
    profile = Profile(
        cost=cost,
        blocks=blocks,
        ops=(),
        simulated=True,
        device=str(device),
        allocator_peak_bytes=None,
        peak_phase=tracker.peak_phase,
        phase_peaks=tracker.phase_peaks,
    )
    return CompiledSimulation(profile=profile, regions=tuple(name for name, _ in regions),
                              budgets=tuple(b for b, _ in settings), graphs=tuple(graphs))
