"""Exact byte accounting of a training step: a dispatch mode keyed on tensor storages.

:class:`MemoryTracker` sees every aten op that runs while it is active (forward,
the autograd engine's backward, recomputation, the optimizer) and keeps, per
device, the bytes of every storage alive: the ones registered up front
(parameters, buffers, optimizer state, batch) and every storage an op creates.
A storage is counted once, however many views or aliases point at it, and is
subtracted when PyTorch frees it.

NOTE [ Storage identity and frees ]
    ``Tensor.untyped_storage()`` returns the *same* Python object for as long as
    the storage lives (PyTorch preserves a storage's PyObject while the C++
    ``StorageImpl`` is alive), so ``id(storage)`` identifies it and a
    ``weakref`` on it dies exactly when the memory is released, whichever thread
    releases it (the autograd engine runs CUDA backward on its own thread; modes
    propagate there). ``torch.distributed._tools.mem_tracker`` relies on the
    same behaviour. We never hold a strong reference to a tracked storage.

NOTE [ What the tracker cannot see ]
    1. Scratch memory inside a kernel (cuBLAS/cuDNN workspaces, temporaries an
       op frees before returning): only op outputs are visible.
    2. Storages created outside the dispatcher and first seen as an op's input
       (a tensor kept as a plain module attribute, ``torch.from_numpy``) are
       assumed to predate the step: they are counted as ``"other"`` from the
       start, i.e. added to the current *and* the peak bytes when discovered.
       ``torch.tensor(...)`` is the exception: its ``aten.lift_fresh`` marks it
       as created by the step.
    3. ``UntypedStorage.resize_`` called directly (not through an aten op) is not
       seen; a resize done by an op is.
    Sizes are exact ``nbytes``; the CUDA caching allocator rounds every block up
    to 512 bytes, so ``torch.cuda.max_memory_allocated`` reads a little higher.

NOTE [ Phases ]
    The caller says which phase runs (:meth:`MemoryTracker.set_phase`):
    ``"forward"`` (model and loss), ``"backward"``, ``"optimizer"``. Ops that run
    while ``remat.recompute.is_recomputing()`` get phase
    ``"recompute"``. A storage created in a phase is of that *kind*; registered
    ones are ``"params"``, ``"buffers"``, ``"grads"``, ``"optimizer_state"``,
    ``"batch"`` or ``"other"``. A parameter's gradient becomes kind ``"grads"``
    once autograd accumulates it. When the phase first switches from forward
    to backward, the bytes of the forward storages still alive are the
    activation bytes; grouped by the innermost block that created them they
    are each block's saved bytes.

NOTE [ Block attribution ]
    Forward pre/post hooks on the blocks keep a stack of block names; an op is
    attributed to the innermost block on the stack. In backward no block
    forward runs (remat's checkpoint regions recompute *inside* the block's
    forward, below its hooks), so each block's output gets a gradient hook that
    makes it the backward block, and its first input a hook that ends it.
    Backward and recompute ops are attributed to that block.

NOTE [ First dispatch ]
    ``TorchDispatchMode`` subclasses get their ``__torch_dispatch__`` wrapped by
    ``torch._disable_dynamo``, which imports and sets up dynamo on its first
    call. That first call leaves reference cycles through the Python frames
    active at the time (the model's forward), which keep the tensors in those
    frames alive until the garbage collector runs: measured once, the first
    step of a process would show activations that are never freed. Each
    tracker class therefore runs one throwaway dispatch before its first use.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from remat.measure.flops import PHASES, UNINITIALISED_OPS, OpRecord, flop_formula
from remat.recompute import is_recomputing

__all__ = ["CREATED_KINDS", "PHASES", "REGISTERED_KINDS", "MemoryTracker", "OpRecord"]

REGISTERED_KINDS: tuple[str, ...] = (
    "params", "buffers", "grads", "optimizer_state", "batch", "other",
)
CREATED_KINDS: tuple[str, ...] = PHASES
_KINDS = frozenset(REGISTERED_KINDS + CREATED_KINDS)

_aten = torch.ops.aten
_FRESH_OPS = frozenset({_aten.lift_fresh, _aten.lift_fresh_copy, _aten.lift})
# Metadata queries that reach modes for tensor subclasses with custom size/stride policies
# (FakeTensor among them) but never for plain tensors: not ops of the step (the same list
# as FlopCounterMode's).
_METADATA_OPS = frozenset(
    getattr(getattr(ns, name, None), overload, None)
    for ns, name, overload in (
        (_aten, "sym_is_contiguous", "default"), (_aten, "is_contiguous", "default"),
        (_aten, "is_contiguous", "memory_format"), (_aten, "is_strides_like_format", "default"),
        (_aten, "is_non_overlapping_and_dense", "default"), (_aten, "size", "default"),
        (_aten, "sym_size", "default"), (_aten, "stride", "default"),
        (_aten, "sym_stride", "default"), (_aten, "storage_offset", "default"),
        (_aten, "sym_storage_offset", "default"), (_aten, "numel", "default"),
        (_aten, "sym_numel", "default"), (_aten, "dim", "default"),
        (torch.ops.prim, "layout", "default"), (torch.ops.prim, "device", "default"),
    )
) - {None}


class _Storage(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a tracked storage that carries its accounting."""

    __slots__ = ("block", "key", "kind", "nbytes")

    key: int
    nbytes: int
    kind: str
    block: str | None


def _storage_of(t: Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, ... have no single storage
        return None


def _tensors(args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> list[Tensor]:
    """Tensors among aten arguments (aten schemas nest at most one list deep)."""
    found: list[Tensor] = []
    values: Iterable[Any] = args if not kwargs else (*args, *kwargs.values())
    for a in values:
        if isinstance(a, Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(x for x in a if isinstance(x, Tensor))
    return found


def _first_tensor(value: Any) -> Tensor | None:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for v in value:
            t = _first_tensor(v)
            if t is not None:
                return t
    if isinstance(value, dict):
        for v in value.values():
            t = _first_tensor(v)
            if t is not None:
                return t
    return None


class MemoryTracker(TorchDispatchMode):
    """Count the bytes of every live tensor storage, op by op, and record each op.

    Memory is traced exactly rather than estimated: each storage's ``nbytes`` is
    added when an op creates it and subtracted when PyTorch frees it, so the peak
    is the true high-water mark of live tensor bytes, including views-free
    aliasing. The price is a Python call per aten op (a few microseconds), which
    is why timings are taken in separate, untracked runs. Works under
    ``FakeTensorMode`` (enter the fake mode first, the tracker inside it). See the
    NOTEs in this module for what it cannot see and how phases and blocks work.

    Args:
        device: count only storages on this device (e.g. ``"cuda"``, ``"cuda:1"``,
            ``"cpu"``); host copies of offloaded activations are then left out.
            Default: ``None``, every device.
        blocks: ``(qualified_name, module)`` pairs to attribute ops and saved bytes
            to, e.g. ``remat.blocks.named_blocks(model)``. Default: none.
        record_ops: keep an :class:`OpRecord` per op. Default: ``True``.

    Example:
        >>> model = torch.nn.Linear(4, 4)
        >>> x = torch.randn(2, 4)
        >>> tracker = MemoryTracker()
        >>> tracker.register_model(model)  # weight 64 B + bias 16 B
        80
        >>> tracker.register([x], "batch")
        32
        >>> with tracker:
        ...     loss = model(x).sum()
        ...     tracker.set_phase("backward")
        ...     loss.backward()
        >>> tracker.activation_bytes  # the scalar loss: addmm's output is not saved
        4
    """

    _primed: ClassVar[bool]

    def __init__(
        self,
        *,
        device: torch.device | str | None = None,
        blocks: Sequence[tuple[str, nn.Module]] = (),
        record_ops: bool = True,
    ) -> None:
        super().__init__()
        dev = torch.device(device) if device is not None else None
        self._device_type = dev.type if dev is not None else None
        self._device_index = dev.index if dev is not None else None
        self._blocks = list(blocks)
        self._record_ops = record_ops
        self._live: dict[int, _Storage] = {}
        self._by_kind: dict[str, int] = dict.fromkeys(sorted(_KINDS), 0)
        self._current = 0
        self._peak = 0
        self._peak_by_kind: dict[str, int] = dict(self._by_kind)
        self._peak_phase: str | None = None
        self._peak_is_now = True
        self._phase = "forward"
        self._activation: int | None = None
        self._block_saved: dict[str, int] = {}
        self._forward_stack: list[str] = []
        self._backward_block: str | None = None
        self._raw_ops: list[tuple[str, str, int, int, int, str | None, int, int]] = []
        self._ops_cache: tuple[OpRecord, ...] | None = None
        self._params: list[nn.Parameter] = []
        self._handles: list[RemovableHandle] = []
        self._depth = 0

    # ---- registration ------------------------------------------------------------------

    def _counts(self, t: Tensor) -> bool:
        if self._device_type is None:
            return True
        d = t.device
        return d.type == self._device_type and (
            self._device_index is None or d.index == self._device_index
        )

    def _add(self, st: torch.UntypedStorage, kind: str, block: str | None) -> int:
        nbytes = st.nbytes()
        rec = _Storage(st, self._on_free)
        rec.key = id(st)
        rec.nbytes = nbytes
        rec.kind = kind
        rec.block = block
        self._live[rec.key] = rec
        if nbytes:
            self._current += nbytes
            self._by_kind[kind] += nbytes
            self._peak_is_now = False
        return nbytes

    def _on_free(self, rec: _Storage) -> None:  # weakref callback, see NOTE [ Storage identity ]
        if self._live.get(rec.key) is rec:
            del self._live[rec.key]
            if rec.nbytes:
                self._current -= rec.nbytes
                self._by_kind[rec.kind] -= rec.nbytes
                self._peak_is_now = False

    def _update_peak(self) -> None:
        if self._current > self._peak:
            self._peak = self._current
            self._peak_by_kind = dict(self._by_kind)
            self._peak_phase = "recompute" if is_recomputing() else self._phase
            self._peak_is_now = True

    def register(self, tensors: Iterable[Tensor | None], kind: str) -> int:
        """Count already-live tensors as ``kind``; return the bytes newly counted.

        A storage already tracked is left as it is (counted once), so register the
        most specific kind first. Call before the step (or between phases).

        Args:
            tensors: tensors to count (``None`` entries are skipped).
            kind: one of ``"params"``, ``"buffers"``, ``"grads"``, ``"optimizer_state"``,
                ``"batch"``, ``"other"``.
        """
        if kind not in REGISTERED_KINDS:
            raise ValueError(
                f"MemoryTracker.register: kind must be one of {REGISTERED_KINDS}, got {kind!r}"
            )
        added = 0
        for t in tensors:
            if t is None or not isinstance(t, Tensor) or not self._counts(t):
                continue
            st = _storage_of(t)
            if st is not None and id(st) not in self._live:
                added += self._add(st, kind, None)
        self._update_peak()
        return added

    def register_model(self, model: nn.Module) -> int:
        """Register ``model``'s parameters, buffers and existing gradients; return bytes.

        Also makes each gradient kind ``"grads"`` as soon as autograd accumulates it
        (a post-accumulate-grad hook, installed while the tracker is active).
        """
        params = list(model.parameters())
        self._params.extend(p for p in params if p.requires_grad)
        added = self.register(params, "params")
        added += self.register(model.buffers(), "buffers")
        added += self.register((p.grad for p in params), "grads")
        return added

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> int:
        """Register the tensors in ``optimizer.state`` (momenta, step counters); return bytes."""
        return self.register(
            (v for state in optimizer.state.values() for v in state.values()
             if isinstance(v, Tensor)),
            "optimizer_state",
        )

    # ---- phases ------------------------------------------------------------------------

    @property
    def phase(self) -> str:
        """The phase set by :meth:`set_phase` (``"forward"`` initially)."""
        return self._phase

    def set_phase(self, phase: str) -> None:
        """Start ``phase`` (``"forward"``, ``"backward"`` or ``"optimizer"``).

        The first switch from forward to backward snapshots the activation bytes.
        """
        if phase not in ("forward", "backward", "optimizer"):
            raise ValueError(
                "MemoryTracker.set_phase: phase must be 'forward', 'backward' or 'optimizer', "
                f"got {phase!r} (recompute is detected from remat.recompute)"
            )
        if phase == "backward" and self._phase == "forward" and self._activation is None:
            self._snapshot_activations()
        self._phase = phase
        self._backward_block = None

    @contextmanager
    def phase_scope(self, phase: str) -> Iterator[None]:
        """Run the enclosed code in ``phase``, then return to the previous phase."""
        previous = self._phase
        self.set_phase(phase)
        try:
            yield
        finally:
            self._phase = previous

    def _snapshot_activations(self) -> None:
        total = 0
        per_block: dict[str, int] = {}
        for rec in self._live.values():
            if rec.kind == "forward" and rec.nbytes:
                total += rec.nbytes
                if rec.block is not None:
                    per_block[rec.block] = per_block.get(rec.block, 0) + rec.nbytes
        self._activation = total
        self._block_saved = per_block

    # ---- hooks -------------------------------------------------------------------------

    def _install_hooks(self) -> None:
        for name, module in self._blocks:
            self._handles.append(
                module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True)
            )
            self._handles.append(
                module.register_forward_hook(self._post_hook(name), with_kwargs=True,
                                             always_call=True)
            )
        for p in self._params:
            self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook))

    def _pre_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._forward_stack.append(name)
            if self._phase == "forward" and torch.is_grad_enabled() and not is_recomputing():
                x = _first_tensor(args)
                if x is None:
                    x = _first_tensor(kwargs)
                if x is not None and x.requires_grad:
                    x.register_hook(self._end_backward_block(name))
        return hook

    def _post_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 output: Any) -> None:
            if self._forward_stack and self._forward_stack[-1] == name:
                self._forward_stack.pop()
            if self._phase == "forward" and torch.is_grad_enabled() and not is_recomputing():
                y = _first_tensor(output)
                if y is not None and y.requires_grad:
                    y.register_hook(self._start_backward_block(name))
        return hook

    def _start_backward_block(self, name: str) -> Any:
        def hook(grad: Tensor) -> None:
            self._backward_block = name
        return hook

    def _end_backward_block(self, name: str) -> Any:
        def hook(grad: Tensor) -> None:
            if self._backward_block == name:
                self._backward_block = None
        return hook

    def _grad_hook(self, p: Tensor) -> None:
        if p.grad is None:
            return
        st = _storage_of(p.grad)
        rec = self._live.get(id(st)) if st is not None else None
        if rec is None or rec.kind == "grads":
            return
        self._by_kind[rec.kind] -= rec.nbytes
        self._by_kind["grads"] += rec.nbytes
        if self._peak_is_now:  # the peak is this very moment: keep its breakdown right
            self._peak_by_kind = dict(self._by_kind)
        rec.kind = "grads"

    @classmethod
    def _prime(cls) -> None:
        # See NOTE [ First dispatch ].
        if "_primed" in cls.__dict__:
            return
        cls._primed = True
        with cls(record_ops=False):
            torch.empty(0)

    def __enter__(self) -> MemoryTracker:
        if self._depth == 0:
            type(self)._prime()
            self._install_hooks()
        self._depth += 1
        super().__enter__()
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        super().__exit__(exc_type, exc_val, exc_tb)
        self._depth -= 1
        if self._depth == 0:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self._forward_stack.clear()

    # ---- dispatch ----------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA_OPS or func.namespace == "profiler":  # profiler: record_function
            return func(*args, **kwargs)
        packet = func.overloadpacket
        live = self._live
        inputs = _tensors(args, kwargs)
        input_keys: set[int] = set()
        fresh = packet in _FRESH_OPS
        for t in inputs:
            st = _storage_of(t)
            if st is None:
                continue
            key = id(st)
            input_keys.add(key)
            if key not in live and not fresh and self._counts(t):
                # NOTE [ What the tracker cannot see ], 2.: it predates the step.
                nbytes = self._add(st, "other", None)
                self._peak += nbytes
                self._peak_by_kind["other"] += nbytes
        out = func(*args, **kwargs)

        phase = "recompute" if is_recomputing() else self._phase
        stack = self._forward_stack
        block = stack[-1] if stack else self._backward_block
        outputs = [out] if isinstance(out, Tensor) else _tensors(
            out if isinstance(out, (tuple, list)) else ()
        )
        alloc = 0
        write = 0
        dtype_bytes = 0
        aliases_only = True
        for t in outputs:
            st = _storage_of(t)
            if st is None:
                continue
            write += t.nbytes
            if not dtype_bytes and t.is_floating_point():
                dtype_bytes = t.element_size()
            key = id(st)
            if key not in input_keys:
                aliases_only = False
            rec = live.get(key)
            if rec is None:
                if self._counts(t):
                    alloc += self._add(st, phase, block)
            elif rec.nbytes != st.nbytes():  # resized by an op (out=, resize_)
                delta = st.nbytes() - rec.nbytes
                rec.nbytes += delta
                self._current += delta
                self._by_kind[rec.kind] += delta
                self._peak_is_now = False
        self._update_peak()

        if self._record_ops:
            # NOTE [ Bytes moved ] in flops.py: views/aliases and empty allocations move none.
            if packet in UNINITIALISED_OPS:
                read = write = 0
            elif aliases_only and not func._schema.is_mutable:
                read = write = 0
            else:
                read = sum(t.nbytes for t in inputs)
            if not dtype_bytes:
                dtype_bytes = (outputs[0].element_size() if outputs
                               else inputs[0].element_size() if inputs else 0)
            formula = flop_formula(packet)
            flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
            self._raw_ops.append(
                (str(packet), phase, flops, read, write, block, dtype_bytes, alloc)
            )
            self._ops_cache = None
        return out

    # ---- results -----------------------------------------------------------------------

    @property
    def current_bytes(self) -> int:
        """Bytes of tracked storages alive now."""
        return self._current

    @property
    def peak_bytes(self) -> int:
        """Highest :attr:`current_bytes` seen (registered tensors included)."""
        return self._peak

    @property
    def peak_phase(self) -> str | None:
        """Phase in which the peak was reached (None before any op)."""
        return self._peak_phase

    @property
    def peak_breakdown(self) -> dict[str, int]:
        """Bytes per kind at the peak (non-zero kinds only)."""
        return {k: v for k, v in self._peak_by_kind.items() if v}

    @property
    def current_breakdown(self) -> dict[str, int]:
        """Bytes per kind now (non-zero kinds only)."""
        return {k: v for k, v in self._by_kind.items() if v}

    @property
    def activation_bytes(self) -> int:
        """Bytes created in forward and alive when backward started (0 before that)."""
        return self._activation or 0

    @property
    def block_saved_bytes(self) -> dict[str, int]:
        """Per block: its share of :attr:`activation_bytes` (blocks with none omitted)."""
        return dict(self._block_saved)

    @property
    def ops(self) -> tuple[OpRecord, ...]:
        """Every op recorded so far, in execution order."""
        if self._ops_cache is None:
            self._ops_cache = tuple(OpRecord(*raw) for raw in self._raw_ops)
        return self._ops_cache

    def bytes_of(self, tensors: Iterable[Tensor | None]) -> int:
        """Bytes of the distinct storages behind ``tensors`` on the tracked device."""
        seen: set[int] = set()
        total = 0
        for t in tensors:
            if t is None or not self._counts(t):
                continue
            st = _storage_of(t)
            if st is not None and id(st) not in seen:
                seen.add(id(st))
                total += st.nbytes()
        return total
