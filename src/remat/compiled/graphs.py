"""What the compiler produced: FLOPs and saved bytes of the graphs AOTAutograd's partitioner
hands to inductor, recorded at compile time by a backend that wraps inductor.

Example::

    >>> backend = CountingBackend(label="model")
    >>> compiled = torch.compile(model, backend=backend)
    >>> compiled(x).sum().backward()            # compiles forward, then backward
    >>> backend.log.flops, backend.log.recompute_flops

NOTE [ Counting compiled FLOPs ]
    A ``FlopCounterMode`` (any ``TorchDispatchMode``) active around a compiled
    model makes dynamo run it eagerly, so compiled FLOPs cannot be counted by
    running the model. They are counted on the graphs instead: inductor's
    ``compile_fx`` runs AOTAutograd, whose partitioner (with
    ``torch._functorch.config.activation_memory_budget``) splits the joint graph
    into a forward and a backward graph and passes each to ``inner_compile``.
    :class:`CountingBackend` passes its own ``inner_compile``, which counts every
    node of the graph with ``torch.utils.flop_counter``'s formulas (on the
    node's fake ``meta["val"]``s; nothing runs) and then calls inductor's own
    ``compile_fx_inner``, so the code that runs is exactly inductor's.

    Recompute: AOTAutograd tags every node traced during the forward with
    ``meta["partitioner_tag"] = "is_forward"`` and the partitioner copies nodes
    (meta included) into the graph it places them in. A backward-graph node
    tagged ``is_forward`` is therefore a forward op the compiler chose to
    recompute: ``recompute_flops``. At budget 1.0 the partitioner recomputes
    only cheap (0-FLOP) ops, so ``recompute_flops`` is 0 and forward + backward
    equals the eager count (tests check this).

    Saved bytes: the backward graph's inputs are the tensors the forward saved
    (named after their forward nodes), the forward's inputs it reuses
    (``primals_*``: parameters and the region's inputs, alive anyway) and the
    incoming gradients (``tangents_*``). ``saved_bytes`` sums the first kind:
    the activations this graph keeps for backward.

NOTE [ Counting graph runs ]
    A graph in the log ran any number of times per step: once per block that
    shares its backend, not at all when it was compiled for another input
    signature or shape. :func:`counting_runs` counts runs: the log keeps a weak
    reference to the callable inductor compiled each graph into, and while the
    measured step runs, the ``__call__`` of those callables' classes is patched
    with a counter (restored afterwards). Nothing is installed on the user's model
    or in its compiled code, so dynamo sees no change and steps outside the
    measurement run exactly what they ran before.

NOTE [ One backend per compile ]
    Dynamo caches compiled code per code object and reuses it for any later
    ``torch.compile`` with the same backend object, so changing
    ``activation_memory_budget`` between two ``torch.compile(model)`` calls with
    the default backend silently reuses the first graph. Each
    :class:`CountingBackend` is a distinct object (dynamo guards on the backend),
    and it patches the budget itself while it compiles, so every budget gets its
    own graphs and no global setting leaks between them. AOTAutograd's cache is
    off while it compiles (a cache hit skips the partitioner, so nothing would be
    counted); inductor's FX graph cache, below the counting, stays on.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_map

from remat.errors import message
from remat.measure.flops import op_flops

KINDS = ("forward", "backward", "inference")


@dataclass(frozen=True)
class CompiledGraph:
    """One graph the partitioner produced and inductor compiled.

    Args:
        label: the backend's label (e.g. the block's qualified name).
        kind: ``"forward"``, ``"backward"`` or ``"inference"`` (no autograd).
        flops: FLOPs of every op in the graph (recompute included).
        recompute_flops: FLOPs of forward ops placed in the backward graph (see NOTE
            [ Counting compiled FLOPs ]); 0 for forward graphs.
        saved_bytes: backward graphs: bytes of the activations the forward saved for
            it; 0 for others.
        budget: ``activation_memory_budget`` it was partitioned with.
        nodes: ops in the graph.
        uncounted_ops: ops with a FLOP formula that could not be evaluated (e.g.
            symbolic shapes); their FLOPs are missing from ``flops``.
    """

    label: str
    kind: str
    flops: int
    recompute_flops: int
    saved_bytes: int
    budget: float
    nodes: int
    uncounted_ops: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(message("CompiledGraph", "unknown kind", {"found": repr(self.kind)},
                                     fix=f"pass one of {KINDS}"))
        for key in ("flops", "recompute_flops", "saved_bytes", "nodes", "uncounted_ops"):
            if getattr(self, key) < 0:
                raise ValueError(message(f"CompiledGraph({self.label!r})",
                                         f"{key} must be >= 0", {"found": getattr(self, key)},
                                         fix=f"pass {key} >= 0"))
        if self.recompute_flops > self.flops:
            raise ValueError(message(f"CompiledGraph({self.label!r})",
                                     "recompute_flops cannot exceed flops",
                                     {"recompute_flops": self.recompute_flops,
                                      "flops": self.flops},
                                     fix="pass flops that include the recompute flops"))
        if not 0.0 <= self.budget <= 1.0:
            raise ValueError(message(f"CompiledGraph({self.label!r})",
                                     "budget must be in [0, 1]", {"found": self.budget},
                                     fix="pass a budget in [0, 1]"))


def _patchable(cls: type) -> bool:
    """Whether :func:`counting_runs` can patch ``cls.__call__``: a class defined in Python.

    Inductor hands back a plain function (``make_boxed_func``) for a graph without ops;
    a built-in type's attributes cannot be set, so such a graph's runs are not counted
    (NOTE [ Compiled FLOPs per step ] in measure.py). Seen on torch 2.11, whose
    partitioner left such a graph in a ``remat.plan_compiled`` candidate.
    """
    heap_type, immutable = 1 << 9, 1 << 8  # Py_TPFLAGS_HEAPTYPE, Py_TPFLAGS_IMMUTABLETYPE
    return bool(cls.__flags__ & heap_type) and not cls.__flags__ & immutable


class GraphLog:
    """The graphs a backend compiled, in compile order (thread-safe appends), and what
    inductor compiled each into (see NOTE [ Counting graph runs ])."""

    def __init__(self) -> None:
        self._graphs: list[CompiledGraph] = []
        self._artifacts: list[weakref.ref[Any] | None] = []
        self._lock = threading.Lock()

    def append(self, graph: CompiledGraph, artifact: Any = None) -> None:
        """Log ``graph``; ``artifact`` is the callable it compiled to (weakly held)."""
        try:
            ref = (weakref.ref(artifact) if artifact is not None
                   and _patchable(type(artifact)) else None)
        except TypeError:  # not weak-referenceable: its runs cannot be counted
            ref = None
        with self._lock:
            self._graphs.append(graph)
            self._artifacts.append(ref)

    def artifacts(self) -> list[tuple[CompiledGraph, Any]]:
        """``(graph, compiled callable or None)`` pairs, in compile order."""
        with self._lock:
            return [(g, r() if r is not None else None)
                    for g, r in zip(self._graphs, self._artifacts, strict=True)]

    @property
    def graphs(self) -> tuple[CompiledGraph, ...]:
        with self._lock:
            return tuple(self._graphs)

    def __len__(self) -> int:
        return len(self.graphs)

    def of_kind(self, kind: str) -> tuple[CompiledGraph, ...]:
        return tuple(g for g in self.graphs if g.kind == kind)

    @property
    def flops(self) -> int:
        """FLOPs of one run of every training graph (forward and backward, recompute in)."""
        return sum(g.flops for g in self.graphs if g.kind != "inference")

    @property
    def recompute_flops(self) -> int:
        return sum(g.recompute_flops for g in self.graphs)

    @property
    def saved_bytes(self) -> int:
        return sum(g.saved_bytes for g in self.graphs)


def _val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, fx.Node) else x


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.numel()) * value.element_size()
    return 0


def count_graph(gm: fx.GraphModule, *, label: str, kind: str,
                budget: float) -> CompiledGraph:
    """Count FLOPs, recompute FLOPs and saved bytes of one partitioned graph.

    See NOTE [ Counting compiled FLOPs ]. Nothing runs: formulas read shapes from
    each node's ``meta["val"]``.
    """
    flops = recompute = saved = nodes = uncounted = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            name = str(node.target)
            if kind == "backward" and not name.startswith(("primals", "tangents")):
                saved += _nbytes(node.meta.get("val"))
            continue
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        nodes += 1
        try:
            args = tree_map(_val, node.args)
            kwargs = tree_map(_val, node.kwargs)
            n = op_flops(node.target.overloadpacket, args, kwargs, node.meta.get("val"))
        except Exception:  # symbolic shapes, missing meta: say so rather than guess
            uncounted += 1
            continue
        flops += n
        if kind == "backward" and node.meta.get("partitioner_tag") == "is_forward":
            recompute += n
    return CompiledGraph(label=label, kind=kind, flops=flops, recompute_flops=recompute,
                         saved_bytes=saved, budget=budget, nodes=nodes,
                         uncounted_ops=uncounted)


class CountingBackend:
    """A ``torch.compile`` backend: inductor, with every partitioned graph logged and the
    activation memory budget of this backend's own choosing.

    Each instance is its own backend (NOTE [ One backend per compile ]): use one per
    budget (and per block, for per-block figures). The budget is patched into
    ``torch._functorch.config`` only while this backend compiles.

    Args:
        budget: ``activation_memory_budget`` for the partitioner, 0.0 (recompute all it
            can) to 1.0 (save all, inductor's default). Default: ``None``: whatever
            ``torch._functorch.config`` holds when the graph is compiled.
        label: names the graphs in the log (e.g. a block's qualified name).
            Default: ``"model"``.
        log: where to record graphs; share one log across backends to pool them.
            Default: a new :class:`GraphLog`.
        inner_compile: the compiler each partitioned graph goes to after counting.
            Default: inductor's ``compile_fx_inner``.

    Example:
        >>> backend = CountingBackend(budget=0.5, label="blocks.0")
        >>> model.blocks[0].compile(backend=backend)
    """

    def __deepcopy__(self, memo: dict[int, Any]) -> CountingBackend:
        # A backend is an identity, not a value (NOTE [ One backend per compile ]): a
        # copy would log into another GraphLog. Lightning's fabric, once imported,
        # deep-copies every torch.compile kwargs dict (backend included) and our log
        # holds a lock, which cannot be copied.
        return self

    def __init__(self, budget: float | None = None, *, label: str = "model",
                 log: GraphLog | None = None,
                 inner_compile: Callable[..., Any] | None = None) -> None:
        if budget is not None and not 0.0 <= budget <= 1.0:
            raise ValueError(message(
                "CountingBackend", "budget must be in [0, 1]", {"found": budget},
                fix="pass a fraction in [0, 1] "
                    "(torch._functorch.config.activation_memory_budget)"))
        self.budget = budget
        self.label = label
        self.log = log if log is not None else GraphLog()
        self._inner = inner_compile
        # dynamo's compiler_fn wrappers look for these
        self.__name__ = f"remat_inductor_{label}_{budget}"

    def __repr__(self) -> str:
        return f"CountingBackend(budget={self.budget}, label={self.label!r})"

    def _inner_compile(self, budget: float) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx_inner

        inner = self._inner or compile_fx_inner

        def counting(gm: fx.GraphModule, example_inputs: Sequence[Any], *args: Any,
                     **kwargs: Any) -> Any:
            if kwargs.get("is_backward"):
                kind = "backward"
            elif kwargs.get("is_inference"):
                kind = "inference"
            else:
                kind = "forward"
            graph = count_graph(gm, label=self.label, kind=kind, budget=budget)
            compiled = inner(gm, example_inputs, *args, **kwargs)
            self.log.append(graph, compiled)
            return compiled

        return counting

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        from torch._functorch import config as functorch_config
        from torch._inductor.compile_fx import compile_fx

        budget = (self.budget if self.budget is not None
                  else float(functorch_config.activation_memory_budget))
        # AOTAutograd's cache would hand back a previous compile's graphs without
        # partitioning, so the counting inner_compile would never see them.
        with functorch_config.patch(activation_memory_budget=budget,
                                    enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=self._inner_compile(budget))


@contextlib.contextmanager
def counting_runs(logs: Iterable[GraphLog]) -> Iterator[dict[int, int]]:
    """Count how often each logged graph's compiled callable runs inside the block.

    Yields ``{id(graph): runs}`` for the graphs of ``logs`` (see NOTE [ Counting graph
    runs ]); it fills in as graphs run and is final when the block exits.
    """
    by_artifact: dict[int, int] = {}
    for log in logs:
        for graph, artifact in log.artifacts():
            if artifact is not None:
                by_artifact[id(artifact)] = id(graph)
    runs: dict[int, int] = {}
    originals: dict[type, tuple[bool, Any]] = {}  # class -> (defined on it, __call__)
    for log in logs:
        for _, artifact in log.artifacts():
            cls = type(artifact)
            if artifact is not None and cls not in originals:
                originals[cls] = ("__call__" in cls.__dict__, cls.__call__)

    def patched(original: Any) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            key = by_artifact.get(id(self))
            if key is not None:
                runs[key] = runs.get(key, 0) + 1
            return original(self, *args, **kwargs)
        return call

    try:
        for cls, (_, original) in originals.items():
            cls.__call__ = patched(original)  # type: ignore[operator]
        yield runs
    finally:
        for cls, (own, original) in originals.items():
            if own:
                cls.__call__ = original  # type: ignore[operator]
            else:
                del cls.__call__  # type: ignore[misc]


# Which CountingBackend compiled which module (weak keys: the registry never keeps a
# module alive, and nothing is stored on the module itself, which dynamo might guard on).
_BACKENDS: weakref.WeakKeyDictionary[nn.Module, CountingBackend] = weakref.WeakKeyDictionary()


def register_backend(module: nn.Module, backend: CountingBackend) -> None:
    """Record that ``module`` was compiled with ``backend`` (see :func:`backend_of`)."""
    _BACKENDS[module] = backend


def backend_of(module: nn.Module) -> CountingBackend | None:
    """The :class:`CountingBackend` ``module`` was compiled with through remat, or None.

    Modules compiled with ``torch.compile(module)`` directly (any other backend) have
    none: their graphs were not counted.
    """
    return _BACKENDS.get(module)
