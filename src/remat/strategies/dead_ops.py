"""Selective checkpointing whose recompute skips dead ops.

SAC's recompute re-runs every op of a region it did not keep, in forward order,
so later ops see the same inputs they saw in forward. But backward only reads
the tensors autograd *packed* in forward; an op whose outputs are never packed
and feed only ops SAC hands back from its cache (or other such ops) computes
values nothing reads. Phi's ``gelu_new`` is the typical case,
``0.5*x*(1+tanh(c*(x+0.044715*x**3)))`` with the ``tanh`` cached: tanh's
backward saves its result, so the ``pow``, ``mul``, ``add``, ``mul`` before it
are recomputed only to be thrown away. Here they are skipped.

NOTE [ Dead ops in recompute ]
    1. Forward. :class:`_TrackingMode` is SAC's caching mode plus a ledger: for
       each op call it notes the op calls whose outputs it reads (by storage, so
       views and ``.data`` aliases count), and a saved-tensors hook pushed on top
       of the checkpoint's own (which it calls) notes which op call produced
       each tensor autograd packs. Per op this is a few dictionary look-ups.
    2. Recompute (once, when SAC's recompute mode is entered, so every pack of
       the forward and every save decision, NOTE [ Saved outputs mutated in
       place ] included, are final): walking the calls backwards, a call is
       *live* when its kind cannot be skipped (item 3), one of its outputs was
       packed, is a region output or is read by nothing in the region (it may
       escape), or a live call that recompute runs reads it. Cached calls are
       not run, so they make nothing live. A call that is neither live nor
       cached is *dead*: its SAC entry, ``_RECOMPUTE``, becomes a placeholder
       whose ``get_val`` (the interface of SAC's cache entries) returns an
       uninitialised tensor of the output's shape, stride, dtype and device
       (a fake one under FakeTensorMode; it takes the bytes the output would, so
       recompute memory is unchanged, only time). SAC's recompute mode returns
       it as it returns cached outputs, so its per-op counters, the policy's
       and autograd's packs line up exactly as before; autograd records nodes
       for the placeholders, which nothing ever backwards (recompute's graph is
       only a source of saved tensors).
    3. Never skipped: random ops (``nondeterministic_seeded``, a Generator or
       dropout argument: skipping would shift the RNG stream of later live
       ops), mutating ops, ops whose outputs alias an input (schema alias
       annotations, or an output sharing an input's storage), ops returning
       anything but Tensors, non-aten ops (collectives, custom ops with side
       effects), tensor subclasses other than FakeTensor (as outputs, or as
       inputs when their type runs its own ``__torch_dispatch__``: sequence
       parallelism's ``AsyncCollectiveTensor`` waits on its collective in the
       first op that reads it, and a skipped reader would leave the collective
       unwaited), outputs at a storage
       offset, ``detach`` (SAC's other ignored ops only read metadata, which a
       placeholder has, and are not recorded).
    4. Skipping is off for a region whose bookkeeping saw something it cannot
       follow: a saved-tensors hook pushed inside the region (a nested
       checkpoint or ``save_on_cpu`` packs where the ledger cannot see), a
       tensor without storage, a PyTorch whose SAC internals differ (storage
       entries by call index, ``_RECOMPUTE``), a forward run under autocast with
       its cast cache on. Autocast serves the cast of a weight it already cast in
       the same autocast region from its cache, without dispatching a
       ``_to_copy``; with the backward inside that region the recompute finds the
       forward's casts cached and dispatches fewer, with shared weights or the
       backward outside it can dispatch more, so SAC's per-op counters no longer
       name the forward's calls and a placeholder would stand in for a live
       output (a backward under ``torch.autocast`` failed on a view of one).
       Under ``torch.compile`` stock SAC contexts are used (AOT's partitioner
       decides recompute there).
    5. Views run but pass liveness on only when used. A pure view (schema alias,
       nothing written, ``split``'s list included, or an op whose outputs all share
       an input's storage, such as ``_unsafe_view``) costs nothing and is never
       skipped, but it needs its input's *values* only if its own output is packed,
       escapes, or is read by a live call. Otherwise it runs on the placeholder of
       a dead input (same size, stride and dtype, so the view's metadata is the
       same). Llama's ``q_proj(x).view(...).transpose(1, 2)`` feeds only the rotary
       embedding; with the rotary output cached the projection is dead, where
       before its view kept it live.
    6. Early stop ends the recompute at the pack that refills the forward's last
       saved tensor (``torch.utils.checkpoint``'s default), so the calls after the
       last pack of the forward never run: they make nothing live. A region's
       last ops (an MoE's weighted sum of expert outputs, read only by the residual
       add that ends the block) would otherwise keep the calls feeding them live,
       and every save set of the region would recompute them, although the full
       checkpoint does not. The save-set models (``save_set_chain``, NOTE [ Save
       sets as minimum cuts ]) leave out the same calls, so the recompute now runs
       what they price. With early stop off (``set_checkpoint_early_stop(False)``
       when the forward ran) every call counts.
    Values read outside the dispatcher (``Tensor.numpy()``, ``tolist()`` on CPU)
    are invisible to the ledger; a region that branches on such a value of an
    op it would skip must turn skipping off (:func:`skipping_dead_ops`).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as _checkpoint
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_leaves

from remat.errors import message
from remat.measure.dispatch_modes import direct_dispatch
from remat.strategies.op_kinds import DETACH, METADATA, SKIPPABLE, UNKNOWN, VIEW, op_kind

_RECOMPUTE: Any = getattr(_checkpoint, "_RECOMPUTE", None)
_top_hooks: Callable[[bool], Any] = torch._C._autograd._top_saved_tensors_default_hooks

_enabled = True


def skip_dead_ops_enabled() -> bool:
    """Whether SAC regions made from now on skip dead ops (default ``True``)."""
    return _enabled


@contextlib.contextmanager
def skipping_dead_ops(enabled: bool) -> Iterator[None]:
    """Turn dead-op skipping on or off for regions whose forward runs inside.

    Example:
        >>> with skipping_dead_ops(False):
        ...     pass  # loss = model(**batch).loss; regions recompute every op
    """
    global _enabled
    previous, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = previous


def _autocast_caching() -> bool:
    """Whether autocast is on for any device with its cast cache on (item 4 of the NOTE)."""
    if not torch.is_autocast_cache_enabled():
        return False
    any_enabled = getattr(torch._C, "_is_any_autocast_enabled", None)
    if any_enabled is not None:
        return bool(any_enabled())
    return any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))


def supported() -> bool:
    """Whether this PyTorch's SAC keeps entries by call index (what skipping relies on)."""
    modes = ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode")
    return _RECOMPUTE is not None and all(hasattr(_checkpoint, m) for m in modes)


class _Placeholder:
    """A dead output in SAC's storage: ``get_val`` makes an empty tensor shaped like it."""

    __slots__ = ("device", "dtype", "fake_mode", "size", "stride")

    def __init__(self, size: Any, stride: Any, dtype: torch.dtype, device: torch.device,
                 fake_mode: Any) -> None:
        self.size, self.stride, self.dtype, self.device = size, stride, dtype, device
        self.fake_mode = fake_mode

    def get_val(self, allow_cache_entry_mutation: bool) -> Tensor:
        with self.fake_mode if self.fake_mode is not None else contextlib.nullcontext():
            return torch.empty_strided(self.size, self.stride, dtype=self.dtype,
                                       device=self.device)


def _placeholders(meta: tuple[bool, list[Any]]) -> Any:
    single, outputs = meta
    made = tuple(_Placeholder(*m) for m in outputs)
    return made[0] if single else made


def _storage(t: Tensor) -> int:
    return int(t.untyped_storage()._cdata)


_PLAIN_DISPATCH = Tensor.__torch_dispatch__


def _own_dispatch(cls: type) -> bool:
    """Whether tensors of ``cls`` run a ``__torch_dispatch__`` of their own (item 3): an
    ``AsyncCollectiveTensor`` waits on its collective there, so an op reading one is not
    only its math. ``Parameter`` and plain tensors do not; ``FakeTensor`` does, but a
    placeholder stands in for its outputs exactly (a fake one)."""
    return (cls is not Tensor and getattr(cls, "__torch_dispatch__", _PLAIN_DISPATCH)
            is not _PLAIN_DISPATCH and not issubclass(cls, FakeTensor))


class Ledger:
    """What a region's forward did, and which op calls its recompute can skip."""

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        #: per op call: SAC storage key (None: an ignored op), call index, the calls it
        #: reads, and (single output?, per-output meta) when its kind can be skipped
        self.calls: list[tuple[Any, int, list[int], Any]] = []
        self.read: list[bool] = []  # whether anything read the call's outputs
        self.producer: dict[int, int] = {}  # storage id -> the op call that wrote it last
        self.packed: set[int] = set()
        self.escaped: set[int] = set()
        self.views: set[int] = set()  # calls whose outputs all alias their inputs (item 5)
        #: the last op call before which autograd packed something: with early stop the
        #: recompute ends at that pack, so later calls never run (item 6)
        self.last_pack = -1
        #: every pack's position as ``last_pack`` records it, where a caller asks for them
        #: (the planner's op graphs cut sub-regions out; a training step's regions don't)
        self.pack_points: list[int] | None = None
        self.early_stop = True
        self.broken = False
        self.finished = False
        self.skipped = 0
        self._hooks: Any = None
        self._pack: Any = None

    def start(self) -> None:
        top = _top_hooks(False)
        if top is None or _autocast_caching():  # item 4 of the NOTE
            self.broken = True
            return
        inner_pack, inner_unpack = top
        producer, packed = self.producer, self.packed
        # The checkpoint reads the global when its forward starts (item 6).
        self.early_stop = _checkpoint._enable_checkpoint_early_stop is not False

        points = self.pack_points

        def pack(x: Tensor) -> Any:
            self.last_pack = len(self.calls) - 1
            if points is not None:
                points.append(self.last_pack)
            try:
                call = producer.get(_storage(x))
            except Exception:  # no storage (a subclass): see item 4 of the NOTE
                self.broken = True
            else:
                if call is not None:
                    packed.add(call)
            return inner_pack(x)

        self._pack = pack
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, inner_unpack)
        self._hooks.__enter__()

    def stop(self) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
        # The pack hook refers back to the ledger: break the cycle, or the SAC storage
        # (cached outputs early stop never hands back) lives until the next gc.
        self._hooks = self._pack = None

    def record(self, skippable: bool, key: Any, index: int, args: tuple[Any, ...],
               kwargs: dict[str, Any], out: Any, *, view: bool = False) -> None:
        """Note one op call of the forward (item 1 of the NOTE); kept lean, it runs per op.

        ``view``: the op is a pure view by its schema (item 5); skippable ops whose
        outputs all alias an input (``_unsafe_view``) count as views too."""
        top = _top_hooks(False)
        if top is None or top[0] is not self._pack:
            self.broken = True  # item 4: someone else's saved-tensors hook
            return
        producer, read = self.producer, self.read
        call = len(self.calls)
        inputs: list[int] = []
        dispatched = False  # an input whose type runs its own dispatch (item 3)
        for arg in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(arg, Tensor):
                inputs.append(arg.untyped_storage()._cdata)
                dispatched = dispatched or _own_dispatch(type(arg))
            elif isinstance(arg, (list, tuple)):
                for a in arg:
                    if isinstance(a, Tensor):
                        inputs.append(a.untyped_storage()._cdata)
                        dispatched = dispatched or _own_dispatch(type(a))
        reads = []
        for st in inputs:
            p = producer.get(st)
            if p is not None:
                reads.append(p)
                read[p] = True
        single = isinstance(out, Tensor)
        meta: Any = [] if skippable and not dispatched else None
        aliased = view or skippable
        for t in (out,) if single else out if isinstance(out, (tuple, list)) else ():
            if not isinstance(t, Tensor):
                meta = None
                aliased = False
                continue
            st = t.untyped_storage()._cdata
            producer[st] = call
            if aliased and st not in inputs:
                aliased = False
            if meta is not None:
                if (st in inputs or t.layout != torch.strided or t.storage_offset() != 0
                        or (type(t) is not Tensor and not isinstance(t, FakeTensor))):
                    meta = None  # an alias of an input, sparse, a subclass: item 3
                else:
                    meta.append((t.size(), t.stride(), t.dtype, t.device,
                                 getattr(t, "fake_mode", None)))
        if not meta or not (single or isinstance(out, tuple)):
            meta = None
        if aliased and (single or (isinstance(out, (tuple, list)) and len(out) > 0)):
            self.views.add(call)
        self.calls.append((key, index, reads, None if meta is None else (single, meta)))
        read.append(False)

    def mark_outputs(self, output: Any) -> None:
        try:
            for t in tree_leaves(output):
                if isinstance(t, Tensor):
                    call = self.producer.get(_storage(t))
                    if call is not None:
                        self.escaped.add(call)
        except Exception:
            self.broken = True

    def dead_calls(self, cached: Callable[[int], bool]) -> list[int]:
        """The calls a recompute can skip when ``cached`` ones are not run (item 2)."""
        needed = [False] * len(self.calls)
        dead = []
        # Item 6: with early stop, calls after the last pack never run, so read nothing.
        last = self.last_pack if self.early_stop else len(self.calls) - 1
        for call in range(last, -1, -1):
            if cached(call):
                continue  # not run: makes nothing live
            key, _, reads, meta = self.calls[call]
            used = (needed[call] or call in self.packed or call in self.escaped
                    or not self.read[call])
            if call in self.views and key is not None and not used:
                continue  # runs, on whatever its input is (item 5)
            if meta is None or key is None or used:
                for p in reads:
                    needed[p] = True
            else:
                dead.append(call)
        return dead

    def finish(self) -> None:
        """Replace the SAC entries of dead op calls by placeholders (item 2 of the NOTE)."""
        if self.finished:
            return
        self.finished = True
        if not self.broken:
            storage = self.storage

            def cached(call: int) -> bool:
                key, index = self.calls[call][:2]
                entries = storage.get(key) if key is not None else None
                return entries is not None and entries.get(index) is not _RECOMPUTE

            for call in self.dead_calls(cached):
                key, index, _, meta = self.calls[call]
                storage[key][index] = _placeholders(meta)
                self.skipped += 1
        self.calls, self.read, self.pack_points = [], [], None
        self.producer, self.packed, self.escaped, self.views = {}, set(), set(), set()


if supported():
    # SAC's own dispatch without its torch._disable_dynamo wrapper: this mode's
    # dispatch already has one (a second costs about a microsecond per op).
    _caching = _checkpoint._CachingTorchDispatchMode.__torch_dispatch__
    _stock_dispatch = getattr(_caching, "__wrapped__", _caching)

    @direct_dispatch
    class _TrackingMode(_checkpoint._CachingTorchDispatchMode):  # type: ignore[misc]
        """SAC's forward caching mode that also fills a :class:`Ledger`."""

        def __init__(self, policy_fn: Any, storage: Any, ledger: Ledger) -> None:
            super().__init__(policy_fn, storage)
            self.ledger = ledger
            self.counts: dict[int, int] = {}

        def __enter__(self) -> Any:
            self.ledger.start()
            return super().__enter__()

        def __exit__(self, *exc: Any) -> Any:
            try:
                return super().__exit__(*exc)
            finally:
                self.ledger.stop()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            kwargs = {} if kwargs is None else kwargs
            out = _stock_dispatch(self, func, types, args, kwargs)
            ledger = self.ledger
            if ledger.broken:
                return out
            kind = op_kind(func)
            if kind == METADATA:
                return out  # a placeholder answers the same
            if kind == UNKNOWN:
                ledger.broken = True  # item 4
                return out
            key, index = None, -1
            if func is not DETACH:  # SAC's func_counter, without hashing func
                key, index = func, self.counts.get(id(func), 0)
                self.counts[id(func)] = index + 1
            try:
                ledger.record(kind == SKIPPABLE, key, index, args, kwargs, out,
                              view=kind == VIEW)
            except Exception:  # e.g. a tensor without storage (item 4)
                ledger.broken = True
            return out

    @direct_dispatch
    class _SkippingMode(_checkpoint._CachedTorchDispatchMode):  # type: ignore[misc]
        """SAC's recompute mode; placeholders replace dead entries before it starts."""

        def __init__(self, storage: Any, ledger: Ledger) -> None:
            super().__init__(None, storage)
            self.ledger = ledger

        def __enter__(self) -> Any:
            self.ledger.finish()
            return super().__enter__()


def dead_op_contexts(policy: Any) -> tuple[Any, Any, Ledger]:
    """SAC's two contexts for ``policy``, with dead-op skipping, and their ledger.

    Raises:
        RuntimeError: this PyTorch's SAC is not the one skipping builds on
            (check :func:`supported` first).
    """
    if not supported():
        raise RuntimeError(message("remat", "dead-op skipping needs SAC storage by call index "
                                   "(torch.utils.checkpoint._RECOMPUTE)",
                                   {"torch": torch.__version__},
                                   fix="check supported() first"))
    storage: Any = defaultdict(dict)
    ledger = Ledger(storage)
    return _TrackingMode(policy, storage, ledger), _SkippingMode(storage, ledger), ledger


def mark_region_outputs(context_fn: Any, output: Any) -> None:
    """Keep the op calls that made a region's ``output`` live (item 2 of the NOTE).

    ``context_fn`` is the region's :func:`~remat.strategies.sac.sac_context_fn` (or
    ``None``); its last policy is the one the region's forward just used.
    """
    if torch.compiler.is_compiling():
        return  # stock SAC contexts there: no ledger
    ledger = getattr(getattr(context_fn, "last_policy", None), "ledger", None)
    if isinstance(ledger, Ledger):
        ledger.mark_outputs(output)
