"""``profile_compiled``: one training step of a ``torch.compile``-d model, measured honestly.

NOTE [ Measuring compiled code ]
    :func:`remat.profile` runs the step under a ``TorchDispatchMode`` with module
    hooks. Around a compiled model either one makes dynamo fall back to eager
    (or recompile until it hits the recompile limit, after which the user's model
    stays eager): the numbers would be the eager step's, and the model would be
    left slower. So a compiled step is measured from outside:

    1. A warm-up step (compiles on first use; creates optimizer state).
    2. Bytes: one step under :func:`~remat.measure.allocator.allocator_peak`,
       with phase marks placed between the model's calls by
       :func:`~remat.measure.step.run_step`'s ``on_phase`` (no hook, no mode).
       ``peak_bytes`` = the allocator peak above the step's start + what was alive
       at the start (parameters, buffers, optimizer state, batch), comparable
       with the eager profile's ``peak_bytes``. ``activation_bytes`` = the
       allocator's live bytes when backward starts.
    3. FLOPs: from the graphs the partitioner produced, logged at compile time by
       a :class:`~remat.compiled.graphs.CountingBackend` (see NOTE
       [ Counting compiled FLOPs ] there): compile with
       :mod:`remat.compiled.install`. FLOPs of code outside the compiled
       regions (embedding, head, loss when the blocks are compiled) and the static
       bytes come from one eager step under ``torch.compiler.set_stance("force_eager")``:
       dynamo is skipped entirely, so its caches and recompile counters are not
       touched. A region compiled with another backend has no graph log: its
       FLOPs are the eager ones and its recompute unknown (``counted=False``).
    4. Times: untracked steps (:func:`~remat.measure.timing.time_step`, phase
       callbacks only); per-block times need hooks and are not measured.
    The dynamo graph counter is read before and after 2-4: ``new_graphs`` > 0
    means something remat did changed what dynamo compiled (tests assert 0).

NOTE [ Compiled FLOPs per step ]
    Each graph is counted as often as it ran in the measured step (NOTE [ Counting
    graph runs ] in graphs.py), so graphs compiled for shapes or
    signatures the step does not use count nothing, and blocks that share a
    backend and call it with several signatures (a tensor, then ``None``) count
    the graphs they ran (before runs were counted, each block was credited with
    every graph of the shared log; tests/compiled/test_measure.py's two-signature
    toy now reads its eager FLOPs). Where runs cannot be counted (a callable that
    takes no weak reference) a graph counts once per region compiled with it. A
    backend's runs are split evenly between the regions that share it: step totals
    are exact, per-block figures are even shares.

    Code outside the regions is counted from the eager step: forward ops outside
    every region (a ``loss_fn`` applied to a compiled model's output, the
    embedding and head around compiled blocks) and, when only blocks are
    compiled, the backward ops the tracker attributes to no block. When the model
    itself is compiled, the tracker cannot tell the model's backward from the
    loss's (the model's output carries no block boundary), so every backward op
    is taken to be in the compiled graphs; a loss's backward has no matmul, so
    no FLOPs are lost in practice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.compiled.graphs import (
    CompiledGraph,
    CountingBackend,
    backend_of,
    counting_runs,
)
from remat.core.cost import Category, StepCost
from remat.core.results import BlockProfile, Profile
from remat.errors import message
from remat.measure.allocator import AllocatorPeak, allocator_peak, mark
from remat.measure.ledger import categorized
from remat.measure.state import preserved_state
from remat.measure.step import LossFn, Step, clear_grads, model_device, run_step
from remat.measure.timing import time_step
from remat.measure.tracked_step import check_trainable, tracked_step

_API = "remat.profile_compiled"
_ROOT = "<model>"  # the tracker's name for a region that is the whole model


def compiled_regions(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified_name, module)`` of every compiled region of ``model``, outermost only.

    A region is a module compiled in place (``module.compile()``; its
    ``_compiled_call_impl`` is set) or the module an ``OptimizedModule``
    (``torch.compile(module)``) wraps; its name is the one it has in ``model``
    (``""`` for the model itself). Submodules of a region are not listed.

    Example:
        >>> compiled_regions(torch.compile(torch.nn.Linear(2, 2)))[0][0]
        ''
    """
    from torch._dynamo.eval_frame import OptimizedModule

    found: list[tuple[str, nn.Module]] = []

    def walk(name: str, module: nn.Module) -> None:
        if isinstance(module, OptimizedModule):
            found.append((name, module._orig_mod))
            return
        if getattr(module, "_compiled_call_impl", None) is not None:
            found.append((name, module))
            return
        for child_name, child in module.named_children():
            walk(f"{name}.{child_name}" if name else child_name, child)

    walk("", model)
    return found


def is_compiled(model: nn.Module) -> bool:
    """True when ``model`` or any of its submodules is compiled (whole or per block).

    Example:
        >>> is_compiled(torch.nn.Linear(2, 2)), is_compiled(torch.compile(torch.nn.Linear(2, 2)))
        (False, True)
    """
    return bool(compiled_regions(model))


def dynamo_graph_count() -> int:
    """Graphs dynamo has captured in this process (``counters["stats"]["unique_graphs"]``)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@dataclass(frozen=True)
class CompiledMeasurement:
    """A compiled step measured: the :class:`Profile` and what it was derived from.

    Args:
        profile: the step's :class:`Profile` (``ops`` empty: compiled code has no
            per-op record).
        allocator: the allocator's view of the measured step (above its start).
        regions: qualified names of the compiled regions (``""``: the whole model).
        graphs: the partitioned graphs counted, over all regions.
        counted: every region had a graph log, so FLOPs and recompute are the
            compiled ones (False: some are eager figures; see NOTE [ Measuring
            compiled code ]).
        new_graphs: graphs dynamo captured while remat measured (after the warm-up);
            0 unless measuring disturbed the compiled model.
        eager_regions: regions compiled through remat whose backend never compiled a
            forward graph: dynamo ran them eagerly (most often its recompile limit,
            ``torch._dynamo.config.recompile_limit``, was reached). Their FLOPs are
            eager and ``counted`` is False. Empty when all is well.
    """

    profile: Profile
    allocator: AllocatorPeak
    regions: tuple[str, ...]
    graphs: tuple[CompiledGraph, ...]
    counted: bool
    new_graphs: int
    eager_regions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.new_graphs < 0:
            raise ValueError(message("CompiledMeasurement", "new_graphs must be >= 0",
                                     {"found": self.new_graphs}, fix="pass new_graphs >= 0"))

    @property
    def peak_bytes(self) -> int:
        """The compiled step's peak, static bytes included (``profile.peak_bytes``)."""
        return self.profile.peak_bytes


def _region_graphs(regions: Sequence[tuple[str, nn.Module]], model: nn.Module
                   ) -> dict[str, tuple[CountingBackend | None, tuple[CompiledGraph, ...]]]:
    out: dict[str, tuple[CountingBackend | None, tuple[CompiledGraph, ...]]] = {}
    for name, module in regions:
        backend = backend_of(module)
        if backend is None and name == "":
            backend = backend_of(model)
        graphs = backend.log.graphs if backend is not None else ()
        out[name] = (backend, tuple(g for g in graphs if g.kind != "inference"))
    return out


def measure_compiled(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    timing: bool = True,
    repeats: int = 5,
) -> CompiledMeasurement:
    """:func:`profile_compiled`, with the allocator reading, the graphs and the checks.

    Args and Raises: as for :func:`profile_compiled`.
    """
    check_trainable(model)
    if repeats < 1:
        raise ValueError(message(_API, "repeats must be >= 1", {"found": repeats},
                                 fix="pass repeats >= 1"))
    regions = compiled_regions(model)
    if not regions:
        raise ValueError(message(
            _API, f"{type(model).__name__} has no compiled module",
            {"looked for": "torch.compile(model) or module.compile()"},
            fix="use remat.profile for eager models"))
    device = model_device(model)
    with preserved_state(model, optimizer, device):
        clear_grads(model)
        run_step(model, batch, loss_fn=loss_fn, optimizer=optimizer)  # warm-up, compiles
        clear_grads(model)
        graphs_before = dynamo_graph_count()
        logs = {id(b.log): b.log for b, _ in _region_graphs(regions, model).values()
                if b is not None}
        with counting_runs(logs.values()) as runs:
            alloc = allocator_peak(
                lambda: run_step(model, batch, loss_fn=loss_fn, optimizer=optimizer,
                                 on_phase=mark),
                device=device,
            )
        clear_grads(model)
        with torch.compiler.set_stance("force_eager"):
            tracked = tracked_step(Step(model, batch, loss_fn=loss_fn, optimizer=optimizer),
                                   [(name or _ROOT, module) for name, module in regions])
        clear_grads(model)
        times = None
        if timing:
            times = time_step(model, batch, loss_fn=loss_fn, optimizer=optimizer,
                              repeats=repeats, device=device, warmup=0)
        new_graphs = dynamo_graph_count() - graphs_before
    return _build(tracked, alloc, regions, model, times, new_graphs, device, dict(runs))


def _runs_per_region(per_region: dict[str, tuple[CountingBackend | None,
                                                 tuple[CompiledGraph, ...]]],
                     runs: dict[int, int]) -> dict[str, tuple[tuple[CompiledGraph, int], ...]]:
    """Each region's ``(graph, runs)`` pairs, runs in this region's share; see NOTE
    [ Counting graph runs ] in graphs.py."""
    sharing: dict[int, int] = {}
    for backend, _ in per_region.values():
        if backend is not None:
            sharing[id(backend)] = sharing.get(id(backend), 0) + 1
    out: dict[str, tuple[tuple[CompiledGraph, int], ...]] = {}
    for name, (backend, graphs) in per_region.items():
        counted = {id(g) for g, a in backend.log.artifacts() if a is not None} \
            if backend is not None else set()
        k = sharing.get(id(backend), 1)
        ran = ((g, runs.get(id(g), 0) if id(g) in counted else k) for g in graphs)
        out[name] = tuple((g, n) for g, n in ran if n)
    return out


def _share(total: int, region: str, regions: Sequence[str]) -> int:
    """``region``'s part of ``total`` split evenly over ``regions`` (the remainder to the
    first ones), so the parts add up to ``total``."""
    k, i = len(regions), regions.index(region)
    return total // k + (1 if i < total % k else 0)


def _build(tracked: Any, alloc: AllocatorPeak, regions: Sequence[tuple[str, nn.Module]],
           model: nn.Module, times: Any, new_graphs: int,
           device: torch.device, runs: dict[int, int]) -> CompiledMeasurement:
    names = {name or _ROOT for name, _ in regions}
    fwd = bwd = rec = 0
    eager_region: dict[str, list[int]] = {name: [0, 0, 0] for name in names}
    for op in tracked.tracker.ops:
        if op.phase == "optimizer":
            continue
        column = {"forward": 0, "backward": 1, "recompute": 2}[op.phase]
        if op.block in names:
            eager_region[op.block][column] += op.flops
        elif column == 0 or _ROOT not in names:
            # outside every compiled region: runs eagerly in the compiled step too. See
            # NOTE [ Compiled FLOPs per step ] for backward ops when the root is compiled.
            fwd += op.flops if column == 0 else 0
            bwd += op.flops if column == 1 else 0
            rec += op.flops if column == 2 else 0
    per_region = _region_graphs(regions, model)
    ran = _runs_per_region(per_region, runs)
    counted = True
    eager: list[str] = []
    blocks: list[BlockProfile] = []
    all_graphs: list[CompiledGraph] = []
    for name, _ in regions:
        backend, graphs = per_region[name]
        peers = [n for n, _ in regions if per_region[n][0] is backend]
        if backend is not None and not any(g.kind == "forward" for g in graphs):
            eager.append(name)  # compiled, yet never compiled a graph: dynamo ran it eagerly
            backend = None
        if backend is None:
            counted = False
            f, b, r = eager_region[name or _ROOT]
            fwd, bwd, rec = fwd + f, bwd + b, rec + r
            continue
        listed = {id(g) for g in all_graphs}
        all_graphs.extend(g for g, _ in ran[name] if id(g) not in listed)
        # Runs of a backend shared by several regions are split between them (NOTE
        # [ Counting graph runs ]): step totals are exact, per-region parts even shares.
        f = _share(sum(g.flops * n for g, n in ran[name] if g.kind == "forward"), name, peers)
        r = _share(sum(g.recompute_flops * n for g, n in ran[name]), name, peers)
        b = _share(sum(g.flops * n for g, n in ran[name] if g.kind == "backward"), name,
                   peers) - r
        fwd, bwd, rec = fwd + f, bwd + b, rec + r
        if name:  # see NOTE [ Counting compiled FLOPs ]: saved bytes per region's graphs
            saved = _share(sum(g.saved_bytes * n for g, n in ran[name]), name, peers)
            blocks.append(BlockProfile(name=name, saved_bytes=saved,
                                       forward_flops=f, backward_flops=b, recompute_flops=r))
    static = tracked.static
    start_bytes = sum(static.values())  # alive at the step's start
    # NOTE [ Categories of each backend ] in remat/core/cost.py: the allocator sees the
    # step's own bytes unsplit.
    breakdown = categorized(static)
    if alloc.peak_bytes:
        breakdown[Category.STEP_TEMPORARIES] = alloc.peak_bytes
    cost = StepCost(
        peak_bytes=start_bytes + alloc.peak_bytes,
        breakdown=breakdown,
        activation_bytes=alloc.mark_bytes.get("backward", 0),
        **tracked.resident_fields(),
        forward_flops=fwd,
        backward_flops=bwd,
        recompute_flops=rec,
        forward_ms=times.forward_ms if times is not None else None,
        backward_ms=times.backward_ms if times is not None else None,
        step_ms=times.step_ms if times is not None else None,
    )
    profile = Profile(
        cost=cost,
        blocks=tuple(blocks),
        ops=(),
        simulated=False,
        device=str(device),
        allocator_peak_bytes=start_bytes + alloc.peak_bytes,
        peak_phase=alloc.peak_phase,
    )
    return CompiledMeasurement(profile=profile, allocator=alloc,
                               regions=tuple(name for name, _ in regions),
                               graphs=tuple(all_graphs), counted=counted,
                               new_graphs=new_graphs, eager_regions=tuple(eager))


def profile_compiled(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    timing: bool = True,
    repeats: int = 5,
) -> Profile:
    """Measure one training step of a compiled model without changing what it runs.

    The peak comes from the allocator, FLOPs from the partitioned graphs the compiler
    produced (its recompute included), times from untracked steps; nothing remat does
    while measuring is visible to dynamo, so the model runs the same compiled graphs
    afterwards. See NOTE [ Measuring compiled code ] for the exact sequence.

    Note:
        Compile with :mod:`remat.compiled.install`
        (``compile_with_budget`` / ``compile_blocks_with_budget``) to get compiled
        FLOPs and per-block figures; regions compiled otherwise report their eager
        FLOPs (:attr:`CompiledMeasurement.counted` is False). ``blocks`` lists the
        blocks compiled through remat (saved bytes, FLOPs; no times); it is empty for
        a model compiled whole, whose bytes cannot be attributed to blocks.

    Args:
        model: a model compiled whole (``torch.compile(model)`` / ``model.compile()``)
            or per block, in train mode.
        batch, loss_fn, optimizer, timing, repeats: as for :func:`remat.profile`.

    Returns:
        A :class:`Profile` (``ops`` empty; ``peak_bytes`` from the allocator plus the
        bytes alive at the step's start).

    Raises:
        ValueError: no compiled module, model in eval mode, no trainable parameter,
            ``repeats < 1``.

    Example:
        >>> from remat.compiled.install import compile_with_budget
        >>> prof = profile_compiled(compile_with_budget(model, 0.5), batch)
        >>> prof.recompute_flops > 0
        True
    """
    return measure_compiled(model, batch, loss_fn=loss_fn, optimizer=optimizer,
                            timing=timing, repeats=repeats).profile
