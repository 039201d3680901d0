"""Exact byte accounting of a training step: a dispatch mode keyed on tensor storages.

:class:`MemoryTracker` sees every aten op that runs while it is active (forward,
the autograd engine's backward, recomputation, the optimizer) and keeps, per
device, the bytes of every storage alive: the ones registered up front
(parameters, buffers, optimizer state, batch) and every storage an op creates.
A storage is counted once, however many views or aliases point at it, and is
subtracted when PyTorch frees it.

NOTE [ What the tracker cannot see ]
    1. Scratch memory inside a kernel (temporaries an op frees before returning) is
       no output; scratch.py adds it for one moment after the op, by formula or as
       probed (NOTEs [ Kernel scratch the tracker models ], [ Kernel scratch measured
       by probes ]); CUDA workspaces, which probes skip, stay unseen.
    2. Storages created outside the dispatcher and first seen as an op's input
       (a tensor kept as a plain module attribute, ``torch.from_numpy``) are
       assumed to predate the step: they are counted as ``"other"`` from the
       start, i.e. added to the current *and* the peak bytes when discovered.
       ``torch.tensor(...)`` is the exception: its ``aten.lift_fresh`` marks it
       as created by the step.
    3. A storage resized from C++ without an aten op. Python's
       ``UntypedStorage.resize_`` (FSDP2 frees and re-gathers parameters with it)
       is seen: NOTE [ Sharded models in the tracker ] in distributed/sharded.py.
    4. Tensors C++ creates without an aten op: Python scalars autograd saves as
       8-byte wrapped tensors (``x * 0.5``). The RNG states checkpoint saves are
       the exception: NOTE [ RNG states saved by checkpoint ] in outside.py.
    Sizes are exact ``nbytes`` (the CUDA caching allocator rounds blocks up to 512 B).
    Against the CPU allocator (tests/measure/test_measure_allocator.py, test_scratch.py)
    4. leaves the peak at most 48 B low on the tiny models tested.
    Storage identity: NOTE in ledger.py; block attribution: NOTE in attribution.py.

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

NOTE [ Saved storages ]
    With ``record_saved=True`` the tracker notes, for every storage an op creates, the
    op's name and the shape and dtype of the output tensor it was created for (a
    multi-output op such as ``aten.native_layer_norm`` creates one storage per output;
    a view creates none). At the first switch from forward to backward, the forward
    storages still alive are :attr:`MemoryTracker.saved_storages`, in the order they
    were created: the terms of :attr:`MemoryTracker.activation_bytes`, which they sum
    to exactly, each attributed to the innermost unit that created it (pass every
    sub-module as a unit to name the linear, norm or dropout that made it).

NOTE [ Gradient accumulation in place ]
    When a tensor feeds several ops, autograd sums its gradients in the engine's input
    buffer. Without a dispatch mode the engine adds in place (``old.add_(new)``, or
    ``new.add_(old)``) when it holds the only reference to a dense buffer; with any
    Python dispatch mode active, ATen's ``isTensorSubclassLike`` is true for every
    tensor and the engine adds out of place (``old + new``), freeing both inputs just
    after. So the tracked step holds one more buffer for an instant than the real step
    ever does: invisible on most models (the buffers are small next to the peak), but
    a scan that slices one tensor per time step (Mamba's reference path: one
    full-size ``select_backward`` gradient per step, summed) would peak a whole buffer
    above the allocator. The tracker therefore recognises the
    engine's sums (``aten.add.Tensor`` of two same-shaped, same-dtype tensors called
    straight from ``torch.autograd.graph._engine_run_backward``, not from a Python
    ``backward``) and defers the op's peak update to the next event: if an input
    buffer that was dense has been freed by then, the real engine would have written
    into it, and the moment with all three alive is not a peak; otherwise the moment
    counts as it was.

NOTE [ First dispatch ]
    ``__torch_dispatch__`` is wrapped by ``torch._disable_dynamo`` (called where a
    frame-evaluation callback is installed: NOTE [ Dynamo's wrapper around a dispatch
    mode ] in dispatch_modes.py), whose first call sets up dynamo and leaves reference
    cycles through the frames then active (the forward's), keeping their tensors alive
    until a garbage collection: a process's first tracked step would show activations
    never freed. Each tracker class therefore runs one throwaway dispatch before its first
    use.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from types import FrameType
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.hooks import RemovableHandle

from remat.blocks import Sublayer
from remat.core.allocator_replay import AllocationLog
from remat.core.op_record import OpRecord
from remat.core.results import PhasePeak, SavedStorage
from remat.core.timeline import MemoryTimeline
from remat.distributed.sharded import (
    is_dtensor,
    local_tensor,
    unsharded_param_tensors,
    watch_collectives,
    watch_storage_resizes,
)
from remat.errors import message
from remat.measure import shadow
from remat.measure.attribution import BlockAttribution
from remat.measure.dispatch_modes import direct_dispatch
from remat.measure.flops import op_flops, op_info, op_traffic
from remat.measure.ledger import REGISTERED_KINDS, StorageLedger, storage_of, tensors_in
from remat.measure.outside import watch_rng_states
from remat.measure.scratch import scratch_bytes
from remat.recompute import is_recomputing

_ADD = torch.ops.aten.add.Tensor
_DEVICE = torch.ops.prim.device.default
_ENGINE_CODE = torch.autograd.graph._engine_run_backward.__code__
#: Frames between the engine and ``__torch_dispatch__``: its ``_disable_dynamo`` wrapper, or
#: ours around it (NOTE [ Dynamo's wrapper around a dispatch mode ] in dispatch_modes.py).
_WRAPPER_FILES = ("_compile.py", "eval_frame.py", "dispatch_modes.py")


def _engine_sum(func: Any, args: Any, kwargs: Any) -> bool:
    """The autograd engine summing two gradients (NOTE [ Gradient accumulation in place ])."""
    if func is not _ADD or kwargs or len(args) != 2:
        return False
    a, b = args
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.shape != b.shape \
            or a.dtype != b.dtype:
        return False
    frame: FrameType | None = sys._getframe(2)  # past __torch_dispatch__
    while frame is not None and frame.f_code.co_filename.endswith(_WRAPPER_FILES):
        frame = frame.f_back
    return frame is not None and frame.f_code is _ENGINE_CODE


@direct_dispatch
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
            to, e.g. ``remat.blocks.named_blocks(model)``; a method sub-layer
            (:class:`~remat.blocks.BlockMethod`) may stand for a module. Default: none.
        record_ops: keep an :class:`OpRecord` per op. Default: ``True``.
        after_op: called with no arguments after every op, once its outputs are counted
            (to read :attr:`current_bytes` op by op). Default: none.
        record_saved: note which op created each storage, for :attr:`saved_storages`
            (NOTE [ Saved storages ]). Default: ``False``.
        probe_scratch: measure the scratch of each distinct CPU call not yet measured
            (NOTE [ Kernel scratch measured by probes ]); ``False`` reads the cache only.
            Default: ``True``.

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
        blocks: Sequence[tuple[str, Sublayer]] = (),
        record_ops: bool = True,
        after_op: Callable[[], None] | None = None,
        record_saved: bool = False,
        probe_scratch: bool = True,
    ) -> None:
        super().__init__()
        self._probe = probe_scratch
        dev = torch.device(device) if device is not None else None
        self._device_type = dev.type if dev is not None else None
        self._device_index = dev.index if dev is not None else None
        self._record_ops = record_ops
        self._record_saved = record_saved
        self._saved: tuple[SavedStorage, ...] = ()
        self.after_op = after_op
        self._ledger = StorageLedger(cuda_streams=dev is None or dev.type == "cuda")
        # NOTE [ Gradient accumulation in place ]: (phase, reusable input storage keys,
        # current bytes, bytes per kind and events logged just after the op, the op's
        # outputs in the allocation log) of a deferred engine sum.
        self._pending: tuple[str, tuple[int, ...], int, dict[str, int], int, int, int] | None = None
        self._settling: int | None = None
        self._phase = "forward"
        self._activation: int | None = None
        self._block_saved: dict[str, int] = {}
        self._attribution = BlockAttribution(blocks, lambda: self._phase == "forward")
        self._ledger.block_now = lambda: self._attribution.current
        self._raw_ops: list[tuple[str, str, int, int, int, str | None, int, int]] = []
        self._ops_cache: tuple[OpRecord, ...] | None = None
        self._params: list[nn.Parameter] = []
        self._handles: list[RemovableHandle] = []
        self._exits = ExitStack()
        self._collectives = [0]  # torch.distributed collectives running (sharded.py)
        self._depth = 0

    # ---- registration ------------------------------------------------------------------

    def _counts(self, t: Tensor) -> bool:
        if self._device_type is None:
            return True
        d = t.device
        return d.type == self._device_type and (
            self._device_index is None or d.index == self._device_index
        )

    def _created_phase(self) -> str:
        return "recompute" if is_recomputing() else self._phase

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
            raise ValueError(message("MemoryTracker.register", "unknown kind",
                                     {"found": repr(kind)}, fix=f"pass one of {REGISTERED_KINDS}"))
        added = 0
        for t in tensors:
            if t is None or not isinstance(t, Tensor) or not self._counts(t):
                continue
            st = storage_of(t)
            if st is not None and id(st) not in self._ledger.live:
                added += self._ledger.add(st, kind, None)
        self._ledger.update_peak(self._created_phase())
        return added

    def register_model(self, model: nn.Module, *, grads: bool = True) -> int:
        """Register ``model``'s parameters, buffers and (with ``grads``) existing gradients;
        return bytes.

        Also makes each gradient kind ``"grads"`` as soon as autograd accumulates it
        (a post-accumulate-grad hook, installed while the tracker is active).
        """
        params = list(model.parameters())
        self._params.extend(p for p in params if p.requires_grad)
        added = self.register(params, "params")
        # FSDP2's gathered params: NOTE [ Sharded models in the tracker ], 3.
        # (distributed/sharded.py)
        added += self.register(unsharded_param_tensors(model), "params")
        added += self.register(model.buffers(), "buffers")
        if grads:
            added += self.register((p.grad for p in params), "grads")
        return added

    def register_step(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                      batch: Iterable[Tensor], *, grads: bool = True) -> int:
        """Register what a step starts with: ``model`` (:meth:`register_model`, its
        gradients with ``grads``), the ``optimizer``'s state if one is given and the
        ``batch``'s tensors; return bytes."""
        added = self.register_model(model, grads=grads)
        if optimizer is not None:
            added += self.register_optimizer(optimizer)
        return added + self.register(batch, "batch")

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
            raise ValueError(message(
                "MemoryTracker.set_phase", "unknown phase", {"found": repr(phase)},
                fix="phase must be one of 'forward', 'backward' or 'optimizer' (recompute is "
                    "detected from remat.recompute)"))
        self.settle()
        self._ledger.phase_started(phase)  # NOTE [ Allocation log ] in ledger.py
        if self._activation is None:  # NOTE [ Gradients held from the step's start ]
            for p in self._params:
                self._grad_hook(p)
        if phase == "backward" and self._phase == "forward" and self._activation is None:
            self._activation, self._block_saved = self._ledger.bytes_of_kind("forward")
            if self._record_saved:  # NOTE [ Saved storages ]
                self._saved = tuple(
                    SavedStorage(*(rec.origin or ("(unknown)", (), "")), rec.nbytes, rec.block)
                    for rec in self._ledger.records_of_kind("forward"))
        self._phase = phase
        self._attribution.backward_block = None

    @contextmanager
    def phase_scope(self, phase: str) -> Iterator[None]:
        """Run the enclosed code in ``phase``, then return to the previous phase."""
        previous = self._phase
        self.set_phase(phase)
        try:
            yield
        finally:
            self._phase = previous

    # ---- hooks and entry ---------------------------------------------------------------

    # NOTE [ Gradients held from the step's start ]
    #     A micro-step of gradient accumulation after the first, and a pipeline stage in
    #     1F1B's steady state, start with every gradient allocated (run_step allocates the
    #     missing ones as zeros for an ``accumulating`` loss, inside the step, before its
    #     forward starts); no backward has written them yet, so they would count as the
    #     forward's and read as activations. Nothing but a backward or a step's start
    #     makes a ``.grad``: until the first backward, every gradient there when a phase
    #     starts is one held from the start, and is a gradient.
    def _grad_hook(self, p: Tensor) -> None:
        if p.grad is None:
            return
        st = storage_of(p.grad)
        rec = self._ledger.live.get(id(st)) if st is not None else None
        if rec is not None and rec.kind != "grads":
            self._ledger.retag(rec, "grads")

    def _created_outside(self, t: Tensor) -> None:
        # NOTE [ RNG states saved by checkpoint ] in outside.py.
        self.settle()
        st = storage_of(t)
        if st is None or id(st) in self._ledger.live or not self._counts(t):
            return
        origin = ("torch.get_rng_state", tuple(t.shape), str(t.dtype).removeprefix("torch."))
        self._ledger.add(st, self._created_phase(), self._attribution.current,
                         origin if self._record_saved else None)
        self._ledger.update_peak(self._created_phase())

    def _resized_outside(self, st: torch.UntypedStorage) -> None:
        # NOTE [ Sharded models in the tracker ] in distributed/sharded.py, 2.
        self.settle()
        dev = st.device
        if self._device_type is not None and (dev.type != self._device_type or (
                self._device_index is not None and dev.index != self._device_index)):
            return
        rec = self._ledger.live.get(id(st))
        if rec is None:
            self._ledger.add(st, self._created_phase(), self._attribution.current)
        elif rec.nbytes != st.nbytes():
            self._ledger.resized(rec, st.nbytes())
        else:
            return
        self._ledger.update_peak(self._created_phase())
        if self.after_op is not None:
            self.after_op()

    @classmethod
    def _prime(cls) -> None:
        # See NOTE [ First dispatch ].
        if "_primed" in cls.__dict__:
            return
        cls._primed = True
        with cls(record_ops=False) as mode:
            torch.empty(0)
            # PyTorch's wrapper too, which a compiled frame's callback would call
            wrapped = getattr(cls.__torch_dispatch__, "dynamo_wrapped", None)
            if wrapped is not None:
                wrapped(mode, torch.ops.aten.empty.memory_format, (), ([0],), {})

    def __enter__(self) -> MemoryTracker:
        if self._depth == 0:
            type(self)._prime()
            self._ledger.start_step()
            self._attribution.install()
            self._handles.extend(p.register_post_accumulate_grad_hook(self._grad_hook)
                                 for p in self._params)
            self._exits.enter_context(watch_rng_states(self._created_outside))
            self._exits.enter_context(watch_storage_resizes(self._resized_outside))
            self._exits.enter_context(watch_collectives(self._collectives))
            self._exits.enter_context(shadow.eager_branches())
        self._depth += 1
        super().__enter__()
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        self.settle()
        super().__exit__(exc_type, exc_val, exc_tb)
        self._depth -= 1
        if self._depth == 0:
            self._ledger.end_step()
            self._attribution.remove()
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self._exits.close()

    # ---- dispatch ----------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        passthrough, fresh, _ = op_info(func)
        if passthrough:  # a metadata query, or the profiler's record_function
            # a fake tensor's device as its mode answers it (autograd asks several times
            # per op), read from the tensor rather than through the mode's dispatch
            out = (args[0].device if func is _DEVICE and len(args) == 1
                   and type(args[0]) is FakeTensor else func(*args, **kwargs))
            if self.after_op is not None:
                self.after_op()
            return out
        self.settle()
        inputs = tensors_in(args, kwargs)
        # NOTE [ What the tracker cannot see ], 2.: unknown inputs predate the step.
        adopt = ((self._created_phase(), self._attribution.current)
                 if func.namespace == "c10d" or self._collectives[0] else None)
        input_keys = self._ledger.see_inputs(inputs, self._counts, fresh=fresh, adopt=adopt)
        reusable = tuple(id(st) for t in inputs if (st := storage_of(t)) is not None
                         and is_non_overlapping_and_dense_or_false(t)) \
            if _engine_sum(func, args, kwargs) else ()
        out = self._run(func, args, kwargs)
        phase = self._created_phase()
        logged = len(self._ledger.allocations)
        outputs = [out] if isinstance(out, Tensor) else tensors_in(
            out if isinstance(out, (tuple, list)) else ()
        )
        alloc, aliases_only = self._ledger.see_outputs(
            outputs, input_keys, self._counts, phase, self._attribution.current,
            op_info(func)[2] if self._record_saved else None)
        scratch = scratch_bytes(func, args, kwargs, out, probe=self._probe,
                                allocated=bool(alloc), tensors=[*inputs, *outputs])
        if scratch:  # NOTEs [ Kernel scratch the tracker models ], [ ... measured by probes ]
            self._scratch_moment(phase, scratch)
        if self._record_ops:
            self._record(func, args, kwargs, out, inputs, outputs, phase, alloc, aliases_only)
        if reusable and alloc:
            ledger = self._ledger
            self._pending = (phase, reusable, ledger.current, dict(ledger.by_kind),
                             len(ledger.events), logged, len(ledger.allocations))
            return out
        self._ledger.update_peak(phase)
        if self.after_op is not None:
            self.after_op()
        return out

    def _scratch_moment(self, phase: str, nbytes: int) -> None:
        """The moment inside the op just run with ``nbytes`` of its kernel's temporaries
        alive besides its output (NOTE [ Kernel scratch the tracker models ])."""
        current = self._ledger.current
        self._ledger.transient(phase, nbytes)
        if self.after_op is not None:
            self._settling = current + nbytes
            try:
                self.after_op()
            finally:
                self._settling = None

    def settle(self) -> None:
        """Resolve a deferred engine sum (NOTE [ Gradient accumulation in place ])."""
        if self._pending is None:
            return
        phase, reusable, current, by_kind, events_then, logged, logged_to = self._pending
        self._pending = None
        ledger = self._ledger
        if any(key not in ledger.live for key in reusable):  # summed in place for real
            ledger.log_after_frees(logged, logged_to)
            ledger.update_peak(phase)
            if self.after_op is not None:
                self.after_op()
            return
        ledger.update_peak_at(phase, current, by_kind, events_then)
        if self.after_op is not None:
            self._settling = current
            try:
                self.after_op()
            finally:
                self._settling = None

    @staticmethod
    def _run(func: Any, args: Any, kwargs: Any) -> Any:
        if not shadow.active():
            return func(*args, **kwargs)
        # NOTE [ Data-dependent branches under fake tensors ] in shadow.py.
        known, value = shadow.local_scalar(func, args)
        if known:
            return value
        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException) as error:
            # see NOTE [ Data-dependent shapes ] in shadow.py
            raise shadow.data_dependent_error(func, error) from error
        shadow.propagate(func, args, kwargs, out)
        return out

    def _record(self, func: Any, args: Any, kwargs: Any, out: Any, inputs: list[Tensor],
                outputs: list[Tensor], phase: str, alloc: int, aliases_only: bool) -> None:
        stored = [t for t in outputs if storage_of(t) is not None]
        if any(type(t) is not Tensor and is_dtensor(t) for t in (*inputs, *outputs)):
            # an op on DTensors runs on their shards: FLOPs and traffic of this rank's
            # (NOTE [ Sharded models in the tracker ], 1.)
            args, kwargs, out = tree_map_only(Tensor, local_tensor, (args, kwargs, out))
            inputs, stored = [local_tensor(t) for t in inputs], [local_tensor(t) for t in stored]
        read, write, dtype_bytes = op_traffic(func, inputs, stored, aliases_only=aliases_only)
        flops = op_flops(func.overloadpacket, args, kwargs, out)
        self._raw_ops.append((op_info(func)[2], phase, flops, read, write,
                              self._attribution.current, dtype_bytes, alloc))
        self._ops_cache = None

    # ---- results -----------------------------------------------------------------------

    @property
    def samples(self) -> int:
        """Samples taken so far: one per op counted, and one per storage counted outside
        an op (NOTE [ Memory timeline ]); a step's work in ops."""
        return len(self._ledger.samples)

    @property
    def current_bytes(self) -> int:
        """Bytes of tracked storages alive now (just after a deferred engine sum, while
        it is settled: NOTE [ Gradient accumulation in place ])."""
        return self._ledger.current if self._settling is None else self._settling

    @property
    def peak_bytes(self) -> int:
        """Highest :attr:`current_bytes` seen (registered tensors included)."""
        return self._ledger.peak

    @property
    def peak_phase(self) -> str | None:
        """Phase in which the peak was reached (None before any op)."""
        return self._ledger.peak_phase

    @property
    def peak_breakdown(self) -> dict[str, int]:
        """Bytes per kind at the peak (non-zero kinds only)."""
        return {k: v for k, v in self._ledger.peak_by_kind.items() if v}

    @property
    def phase_peaks(self) -> dict[str, PhasePeak]:  # see PhasePeak in ledger.py
        return self._ledger.peaks_by_phase()

    @property
    def current_unit(self) -> str | None:
        """The attribution unit (block or sub-module) the running op belongs to, or None."""
        return self._attribution.current

    @property
    def current_breakdown(self) -> dict[str, int]:
        """Bytes per kind now (non-zero kinds only)."""
        return {k: v for k, v in self._ledger.by_kind.items() if v}

    @property
    def timeline(self) -> MemoryTimeline:
        """Live bytes by category at every sample so far (NOTE [ Memory timeline ] in
        remat/core/timeline.py)."""
        return self._ledger.timeline()

    @property
    def activation_bytes(self) -> int:
        """Bytes created in forward and alive when backward started (0 before that)."""
        return self._activation or 0

    @property
    def saved_storages(self) -> tuple[SavedStorage, ...]:
        """The forward storages alive when backward started, in creation order; they sum to
        :attr:`activation_bytes` (empty without ``record_saved``; NOTE [ Saved storages ])."""
        return self._saved

    @property
    def block_saved_bytes(self) -> dict[str, int]:
        """Per block: its share of :attr:`activation_bytes` (blocks with none omitted)."""
        return dict(self._block_saved)

    @property
    def allocations(self) -> AllocationLog:
        """Every storage the step allocated and freed, in order, and what it started with
        (NOTE [ Allocation log ] in ledger.py): what ``remat.measure.reserved`` replays."""
        return self._ledger.allocation_log()

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
            st = storage_of(t)
            if st is not None and id(st) not in seen:
                seen.add(id(st))
                total += st.nbytes()
        return total
