"""Inductor's generated wrapper of a partitioned graph, taken instead of compiled and
replayed with no-op kernels: steps 3 and 4 of NOTE [ Simulating compiled code ] in
simulate.py.

The wrapper allocates every buffer, reuses and frees them as the compiled code would; the
kernels only write into those buffers, so stubbing them keeps every allocation and free
while computing nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from remat.compiled.graphs import CompiledGraph
from remat.errors import RematError, message
from remat.measure.tracker import MemoryTracker

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
            raise ValueError(message(f"GraphMemory({self.region!r}, {self.kind})",
                                     "kernels must be >= 0", {"found": self.kernels},
                                     fix="pass kernels >= 0"))


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


def load_wrapper(source: str, region: str) -> Callable[[list[Any]], Any]:
    """Execute inductor's wrapper source with stub kernels and fake-tensor allocation; the
    returned ``call(args)`` allocates, reuses and frees exactly as the compiled code does."""
    if _IMPORT not in source:
        raise CompiledSimulationError(message(
            _API, f"region {region or '<model>'}: this torch's inductor writes wrapper code "
            "remat does not recognise (no AsyncCompile import)",
            {"torch": torch.__version__}, fix="profile it for real (simulate=False)"))
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
        raise CompiledSimulationError(message(
            _API, f"region {region or '<model>'}: inductor's wrapper has no call(args)",
            {"torch": torch.__version__}, fix="profile it for real (simulate=False)"))
    return call  # type: ignore[no-any-return]


_local = threading.local()
_patch_lock = threading.Lock()


@contextmanager
def stop_at_wrapper(sink: list[tuple[str, int]]) -> Iterator[None]:
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


class Replay:
    """A partitioned graph's stand-in at run time: inductor's own wrapper with no-op
    kernels, run on fake tensors (boxed calling convention, as inductor's)."""

    def __init__(self, call: Callable[[list[Any]], Any], counts: CompiledGraph,
                 counter: GraphRuns) -> None:
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


class GraphRuns:
    """The compiled graphs run during the tracked step, and the tracker's ops they ran
    (extern kernels: already in the graphs' FLOPs)."""

    def __init__(self) -> None:
        self.runs: list[CompiledGraph] = []
        self.inside: set[int] = set()

    def add(self, counts: CompiledGraph, ops: range) -> None:
        self.runs.append(counts)
        self.inside.update(ops)
