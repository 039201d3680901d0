"""What keeps a tensor storage alive between training steps: the *holder* ``remat doctor``
names when memory grows.

NOTE [ Holders ]
    Between two steps, after a garbage collection, every storage the tracker counts is
    alive because something refers to it. The holder is the first of:

    1. the model: a parameter (``"parameters"``), its ``.grad`` (``"gradients"``), a buffer
       that existed before the steps (``"buffers"``), or any other tensor reachable from a
       module's attributes (a buffer assigned anew, a list, a dict, an object such as a
       cache, up to four levels deep): the attribute's path (``"blocks.1.cache"``);
    2. an optimizer's state (``"optimizer state"``): the optimizers the steps stepped;
    3. the batch (``"batch"``);
    4. a tensor anywhere else in Python, found among the objects the garbage collector
       tracks: the variable or container holding it, named where it can be (a local of a
       running function, a module global, an instance attribute; else the container's
       type);
    5. an autograd graph: a storage no Python tensor refers to, while a tensor of 1. or 4.
       that the steps created has a ``grad_fn`` (its graph's nodes keep the tensors they
       saved until a backward frees them): ``"graph of <that holder>"``. The graph's saved
       tensors are not read to prove it: reading one runs its unpack hook, which under
       checkpointing recomputes;
    6. else ``"other"``: held where Python cannot see (C++ state).

    4. and 5. scan every object the collector tracks, so they run only when 1.-3. leave
    storages unexplained, never inside a step.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import CellType, FrameType, FunctionType
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from remat.measure.ledger import storage_of

#: Holder kinds, in the order of NOTE [ Holders ].
KINDS = ("parameters", "gradients", "buffers", "module", "optimizer", "batch", "python",
         "graph", "other")
#: Holders every step keeps and no step should free (left out of what a step holds over).
STATIC_KINDS = frozenset({"parameters", "buffers", "optimizer", "batch"})
_DEPTH = 4
_T = TypeVar("_T")
_MODULE_KEYS = frozenset(vars(nn.Module())) - {"_buffers"}
_OWN_FILES = ("remat/measure/holders.py", "remat/measure/doctor.py")


@dataclass(frozen=True)
class Holder:
    """What keeps a storage alive (NOTE [ Holders ]).

    Args:
        label: how the report names it (``"gradients"``, ``"blocks.1.cache"``,
            ``"losses in train()"``).
        kind: one of :data:`KINDS`.
    """

    label: str
    kind: str


#: Tensors with a ``grad_fn`` and their holders: the roots of graphs kept alive.
Roots = list[tuple[Holder, Tensor]]


def _key(t: Tensor) -> int | None:
    st = storage_of(t)
    return id(st) if st is not None else None


def _tensors_in(value: Any, depth: int) -> Iterator[Tensor]:
    """Tensors reachable from ``value`` through containers and plain objects."""
    if isinstance(value, Tensor):
        yield value
        return
    if depth <= 0 or isinstance(value, (str, bytes, int, float, nn.Module, type)) \
            or callable(value):
        return
    if isinstance(value, Mapping):
        for v in list(value.values()):
            yield from _tensors_in(v, depth - 1)
    elif isinstance(value, (list, tuple, set, frozenset, deque)):
        for v in list(value):
            yield from _tensors_in(v, depth - 1)
    elif hasattr(value, "__dict__"):
        yield from _tensors_in(vars(value), depth - 1)


def model_holders(model: nn.Module, optimizers: Iterable[torch.optim.Optimizer], batch: Any,
                  buffers_before: set[int]) -> tuple[dict[int, Holder], Roots]:
    """Holders 1.-3. of NOTE [ Holders ] by storage key, and the module-state tensors that
    have a ``grad_fn`` (roots of graphs the model keeps).

    Args:
        model: the model.
        optimizers: the optimizers whose state counts.
        batch: the batch's tensors.
        buffers_before: keys of the buffers' storages before the steps.
    """
    from remat.measure.step import batch_tensors

    found: dict[int, Holder] = {}
    roots: Roots = []

    def add(t: Tensor | None, holder: Holder) -> None:
        if t is None:
            return
        key = _key(t)
        if key is not None and key not in found:
            found[key] = holder
            if holder.kind == "module" and t.grad_fn is not None:
                roots.append((holder, t))

    params = list(model.named_parameters())
    for _, p in params:
        add(p, Holder("parameters", "parameters"))
    for _, p in params:
        add(p.grad, Holder("gradients", "gradients"))
    for name, b in model.named_buffers():
        key = _key(b)
        add(b, Holder("buffers", "buffers") if key in buffers_before else Holder(name, "module"))
    for prefix, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr in _MODULE_KEYS:
                continue
            label = f"{prefix}.{attr}" if prefix else attr
            if attr == "_buffers":
                continue  # named_buffers above
            for t in _tensors_in(value, _DEPTH):
                add(t, Holder(label, "module"))
    for opt in optimizers:
        for state in opt.state.values():
            for t in _tensors_in(state, 2):
                add(t, Holder("optimizer state", "optimizer"))
    for t in batch_tensors(batch):
        add(t, Holder("batch", "batch"))
    return found, roots


def python_holders(unexplained: set[int], created: set[int],
                   roots: Roots) -> dict[int, Holder]:
    """Holders 4.-6. of NOTE [ Holders ] for the storage keys in ``unexplained``.

    Args:
        unexplained: storage keys 1.-3. did not explain.
        created: keys of the storages the steps created (a graph root must be one).
        roots: module-state tensors with a ``grad_fn`` (from :func:`model_holders`).
    """
    with warnings.catch_warnings():
        # isinstance on some lazily deprecated torch objects warns
        warnings.simplefilter("ignore")
        return _python_holders(unexplained, created, roots)


def _python_holders(unexplained: set[int], created: set[int],
                    roots: Roots) -> dict[int, Holder]:
    finder = _Finder()
    tensors = finder.mine({})  # id(tensor) -> tensor, held in Python
    by_tensor: dict[int, int] = {}  # id(tensor) -> storage key
    for obj in finder.mine(gc.get_objects()):
        if type(obj) in weakref.ProxyTypes:  # holds nothing; isinstance on a dead one raises
            continue
        if isinstance(obj, Tensor) and not isinstance(obj, nn.Parameter):
            key = _key(obj)
            if key is not None and (key in unexplained or key in created
                                    and obj.grad_fn is not None):
                tensors[id(obj)] = obj
                by_tensor[id(obj)] = key
    finder.skip.clear()  # the heap's list is gone
    finder.mine(tensors)
    places = finder.places(tensors)
    found: dict[int, Holder] = {}
    graph_roots = [holder for holder, _ in roots]
    for tid, key in by_tensor.items():
        place = places.get(tid)
        if place is None:  # a tensor only C++ refers to: an autograd graph's, say
            continue
        holder = Holder(place, "python")
        if key in unexplained and key not in found:
            found[key] = holder
        if tensors[tid].grad_fn is not None:
            graph_roots.append(holder)
    rest = unexplained - set(found)
    if rest:
        labels = sorted({h.label for h in graph_roots})
        holder = Holder("graph of " + ", ".join(labels[:2]) + (", ..." if len(labels) > 2
                                                                 else ""), "graph") \
            if labels else Holder("other", "other")
        for key in rest:
            found[key] = holder
    return found


def _own(frame: FrameType) -> bool:
    return frame.f_code.co_filename.replace("\\", "/").endswith(_OWN_FILES)


def _running_frames() -> Iterator[FrameType]:
    for ident, top in sys._current_frames().items():
        frame: FrameType | None = top
        while frame is not None:
            if not _own(frame) or ident != threading.get_ident():
                yield frame
            frame = frame.f_back


def _module_dicts() -> dict[int, str]:
    """Each module's globals by id: the module's name, or its file's for a private name (a
    file the CLI imported, ``_remat_user_...``)."""
    out: dict[int, str] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not hasattr(module, "__dict__") or name == "__mp_main__":
            continue
        file = getattr(module, "__file__", None)
        out[id(vars(module))] = os.path.basename(file) if name.startswith("_") and \
            isinstance(file, str) else name
    return out


def _frame_locals(wanted: Mapping[int, Any]) -> dict[int, str]:
    out: dict[int, str] = {}
    for frame in _running_frames():
        if frame.f_code.co_name == "<module>":
            continue  # its locals are its module's globals, named by the module
        for name, value in list(frame.f_locals.items()):
            if id(value) in wanted and id(value) not in out:
                out[id(value)] = f"{name} in {frame.f_code.co_name}()"
    return out


def _owner(d: dict[Any, Any]) -> Any:
    """The object whose ``__dict__`` is ``d``, or None."""
    return next((o for o in gc.get_referrers(d) if getattr(o, "__dict__", None) is d), None)


def _closure_name(cell: CellType) -> str:
    for closure in gc.get_referrers(cell):
        if not isinstance(closure, tuple):
            continue
        for func in gc.get_referrers(closure):
            if isinstance(func, FunctionType) and func.__closure__ is closure:
                return f"{func.__code__.co_freevars[closure.index(cell)]} in {func.__name__}()"
    return "a closure variable"


def _key_of(container: Any, target: Any) -> Any:
    return next((k for k, v in container.items() if v is target), "?")


class _Finder:
    """Names where Python objects are held (NOTE [ Holders ], 4.), never naming its own
    bookkeeping: every container it makes is in :attr:`skip`."""

    def __init__(self) -> None:
        self.skip: set[int] = set()
        self.modules = _module_dicts()

    def mine(self, obj: _T) -> _T:
        """``obj``, noted as the finder's own (never a holder)."""
        self.skip.add(id(obj))
        return obj

    def places(self, targets: Mapping[int, Any]) -> dict[int, str]:
        """Where each target (by id) is held: a local of a running function, a module
        global or an instance attribute, else the container holding it, named by where
        that is."""
        places = self.mine(_frame_locals(targets))
        rest = self.mine({oid: t for oid, t in targets.items() if oid not in places})
        containers = self.containers(rest)
        others = self.mine({})
        for oid, container in containers.items():
            if isinstance(container, dict):
                if id(container) in self.modules:
                    places[oid] = f"{_key_of(container, rest[oid])} in " \
                                  f"{self.modules[id(container)]}"
                    continue
                owner = _owner(container)
                if owner is not None:
                    places[oid] = f"{type(owner).__name__}.{_key_of(container, rest[oid])}"
                    continue
            others[id(container)] = container
        names = self.container_names(others)
        for oid, container in containers.items():
            if oid not in places:
                places[oid] = names.get(id(container), f"a {type(container).__name__}")
        return places

    def container_names(self, containers: Mapping[int, Any]) -> dict[int, str]:
        """Names for containers: the local, global, attribute or closure variable holding
        each (one level up)."""
        kind = {cid: type(c).__name__ for cid, c in containers.items()}
        out = {cid: f"{name} ({kind[cid]})" for cid, name in _frame_locals(containers).items()}
        rest = self.mine({cid: c for cid, c in containers.items() if cid not in out})
        for cid, outer in self.containers(rest).items():
            if isinstance(outer, CellType):
                out[cid] = f"{_closure_name(outer)} ({kind[cid]})"
            elif isinstance(outer, dict):
                key = _key_of(outer, rest[cid])
                if id(outer) in self.modules:
                    out[cid] = f"{key} in {self.modules[id(outer)]} ({kind[cid]})"
                elif (owner := _owner(outer)) is not None:
                    out[cid] = f"{type(owner).__name__}.{key} ({kind[cid]})"
        return out

    def containers(self, wanted: Mapping[int, Any]) -> dict[int, Any]:
        """For each target, a list, tuple, dict, deque, set or closure cell holding it (one
        ``gc.get_referrers`` pass over the heap, in C)."""
        out: dict[int, Any] = self.mine({})
        if not wanted:
            return out
        args = self.mine(tuple(wanted.values()))
        for obj in gc.get_referrers(*args):
            if id(obj) in self.skip:
                continue
            if isinstance(obj, dict):
                values: Iterable[Any] = obj.values()
            elif isinstance(obj, (list, tuple, deque, set)):
                values = obj
            elif isinstance(obj, CellType):
                try:
                    values = (obj.cell_contents,)
                except ValueError:  # an empty cell
                    continue
            else:
                continue
            for value in values:
                if id(value) in wanted and id(value) not in out:
                    out[id(value)] = obj
        return out
