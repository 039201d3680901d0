"""Kernel scratch: temporaries a kernel makes and frees inside one op, which the tracker adds
by formula or as measured by a probe on the allocator.

NOTE [ Kernel scratch the tracker models ]
    A ``CompositeExplicitAutograd`` kernel calls other aten ops below the dispatch
    mode, so the tracker sees its output only (NOTE [ What the tracker cannot see ],
    1. in tracker.py). Where such a kernel's temporaries are a fixed function of its
    inputs' shapes, and large, the tracker adds them for one moment, with the output
    alive, as the allocator sees them:

    * ``aten._safe_softmax(x, dim)`` (the softmax of SDPA's math path, which CPU
      attention takes with a float mask or an expanded key/value, e.g. Falcon's
      multi-query attention): ``out = softmax(x, dim)``, then ``isneginf(x)`` (one
      bool per element), ``all(that, dim, keepdim=True)`` (one bool per row) and a
      0-dim tensor of ``out``'s dtype, all alive at once before the rows that are all
      ``-inf`` are zeroed in place: ``numel(x) + numel(x) / x.size(dim) +
      out.element_size()`` bytes on top of the output (PyTorch's
      aten/src/ATen/native/SoftMax.cpp; measured on the CPU allocator: 8452 B for a
      float32 ``(2, 4, 32, 32)`` input, 1.2% of a tiny Falcon's step). The
      intermediate bool tensors are a quarter of the scores in float32, half in
      bfloat16, so the term grows with the attention, not only on tiny models.


NOTE [ Kernel scratch measured by probes ]
    Other kernels allocate and free buffers inside one call that no formula here
    models: oneDNN's weight and activation reorders and im2col buffers in CPU
    convolution forward and backward, batch and group norm backward's per-channel
    buffers, on CUDA cuDNN/cuBLAS workspaces. :func:`probe_scratch` measures them on
    the allocator itself: it runs
    the op once more, on copies of its real inputs (same shapes, strides, dtypes),
    inside :func:`~remat.measure.allocator.allocator_peak`, and keeps the high-water
    mark of the call above the bytes its outputs hold at its end. The result is
    cached per process, keyed by the op and its arguments' shapes, strides, dtypes,
    devices and other (non-tensor) values, floats by type only (a float is a value, such
    as Adam's bias correction, which changes every step, not a size), so each distinct
    call is probed once; the
    tracker adds a non-zero result for one moment after the op, as for the formula
    above. Which ops have scratch is decided by the probe, not by a list; the cost
    is bounded by skipping what cannot be probed or need not be:

    * fake tensors: a *simulated* profile counts no probed scratch, not even what a
      real measurement in the same process probed, so a simulation's bytes (and the
      plans made from them) never depend on what the process ran before; it reads
      the tracker's figure without probed scratch, the formula above included;
    * tensor subclasses (DTensor), tensors off the CPU, and any call while a profiler
      already runs (one process holds one);
    * ops outside ``aten`` (a collective run twice would hang its peers; custom ops
      may have side effects), ops that draw random numbers (a second call would move
      the generator), and calls that create no storage (views, in-place ops: the
      tracker probes only a call that allocated, and reads the cache for no other, since
      whether a call allocates is fixed by the op and its arguments' layouts, which the
      cache key holds);
    * scratch under :data:`MIN_PROBED_BYTES` (512 B) counts 0: it is the 8- and
      4-byte tensors Python scalars become inside a kernel (on CUDA those stay on the
      host, wrapped numbers are CPU tensors) and buffers smaller than one block of
      the CUDA caching allocator; counting them would make a real step differ from
      its simulation by bytes no card holds;
    * every call past :data:`MAX_PROBES` in one process, and a call that raises when
      run again on the copies (it counts 0: a probe never fails a measurement).
    Probes run on CPU tensors only: on CUDA, reading the caching allocator's peak
    inside a step resets ``max_memory_allocated``, which callers around the tracked
    step may read, so cuBLAS/cuDNN workspaces stay uncounted there (NOTE [ What the
    tracker cannot see ], 1.). The copies of the inputs exist before the window
    opens and are not counted; each distinct call runs once more, so the first
    tracked step of a model costs up to about twice its ops' time plus a few ms per
    distinct call (the profiler's start and stop); later steps in the process read
    the cache. :class:`~remat.measure.tracker.MemoryTracker` probes unless built with
    ``probe_scratch=False``; it is remat's measurement, never the user's training loop.
    Inside :func:`without_probed_scratch` no probed scratch counts, as on fake tensors (a
    real copy standing in for a fake one, NOTE [ A real copy standing in for the fake
    one ] in planning/context.py).
"""

from __future__ import annotations

from collections.abc import Hashable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import FakeTensor, is_fake

from remat.core.switch import Switch
from remat.measure.allocator import allocator_peak


def scratch_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
                  *, probe: bool = False, allocated: bool = True,
                  tensors: list[Tensor] | None = None) -> int:
    """Bytes ``func``'s kernel holds besides its output at its own peak: by formula
    (NOTE [ Kernel scratch the tracker models ]), else as probed (NOTE [ Kernel scratch
    measured by probes ]; ``probe=False`` reads the cache only); 0 for the rest.

    ``allocated=False``: the call created no storage, so no probed figure exists for it
    (only the formula counts). ``tensors``: every tensor among the arguments and the
    output, where the caller has them already. Default: found here.

    Example:
        >>> x = torch.randn(2, 8)
        >>> scratch_bytes(torch.ops.aten._safe_softmax.default, (x, -1), {},
        ...               torch.ops.aten._safe_softmax.default(x, -1))
        22
    """
    if func is not torch.ops.aten._safe_softmax.default:
        if not allocated:
            return 0
        return probe_scratch(func, args, kwargs, out, probe=probe, tensors=tensors)
    if not isinstance(out, Tensor):
        return 0
    x = args[0] if args else kwargs.get("self")
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if not isinstance(x, Tensor) or not isinstance(dim, int) or x.dim() == 0:
        return 0
    numel = x.numel()
    rows = numel // x.size(dim) if x.size(dim) else 0
    return int(numel + rows + out.element_size())


#: Probed scratch below this counts 0 (NOTE [ Kernel scratch measured by probes ]).
MIN_PROBED_BYTES = 512

#: Calls probed per process at most (NOTE [ Kernel scratch measured by probes ]).
MAX_PROBES = 4096

_PROBED: dict[Hashable, int] = {}
_probes = [0]
_counted = Switch()

#: Types whose instances are fake only as a functional wrapper of a fake tensor (a fake
#: parameter is a ``FakeTensor``): checked before ``is_fake``, which costs microseconds.
_REAL = (Tensor, torch.nn.Parameter)


def _fake(t: Tensor) -> bool:
    """``is_fake(t)``, answered without it for a fake tensor, a plain tensor or a parameter."""
    kind = type(t)
    if kind is FakeTensor:
        return True
    if kind in _REAL and not torch._is_functional_tensor(t):
        return False
    return is_fake(t)


def without_probed_scratch() -> AbstractContextManager[None]:
    """Count no probed scratch inside (NOTE [ Kernel scratch measured by probes ]): real
    tensors measure as fake ones do.

    Example:
        >>> with without_probed_scratch():
        ...     pass
    """
    return _counted.turned_off()


def _arg_key(value: Any) -> Hashable:
    """A hashable description of one argument: a tensor by layout, lists element-wise."""
    if isinstance(value, Tensor):
        return ("T", tuple(value.shape), value.stride(), value.dtype, value.device.type,
                value.storage_offset())
    if isinstance(value, (list, tuple)):
        return tuple(_arg_key(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _arg_key(v)) for k, v in value.items()))
    if isinstance(value, (float, complex)):  # a value (Adam's bias correction), not a size
        return type(value).__name__
    if value is None or isinstance(value, (bool, int, str, torch.dtype, torch.device,
                                           torch.layout, torch.memory_format)):
        return value
    return repr(value)


def probe_key(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    """The cache key of a call: the op and its arguments' layouts and values.

    Example:
        >>> probe_key(torch.ops.aten.relu.default, (torch.ones(2, 3),), {})[1]
        (('T', (2, 3), (3, 1), torch.float32, 'cpu', 0),)
    """
    return (func, _arg_key(args), _arg_key(kwargs))


def _probeable(func: Any, tensors: list[Tensor]) -> bool:
    if func.namespace != "aten" or torch.Tag.nondeterministic_seeded in func.tags \
            or func.is_view:
        return False
    if any(type(t) not in (Tensor, torch.nn.Parameter) or t.device.type != "cpu"
           for t in tensors):
        return False
    return not torch._C._autograd._profiler_enabled()


def _copy(value: Any) -> Any:
    """A copy of ``value`` with every tensor replaced by one of the same layout."""
    if isinstance(value, Tensor):
        if not is_non_overlapping_and_dense_or_false(value) and value.numel():
            # expanded (stride 0) and other overlapping layouts: a copy of the storage
            return torch.empty(0, dtype=value.dtype, device=value.device).set_(
                value.untyped_storage().clone(), value.storage_offset(), value.shape,
                value.stride())
        copy = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                   device=value.device)
        return copy.copy_(value) if value.numel() else copy
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


def probe_scratch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
                  *, probe: bool = True, tensors: list[Tensor] | None = None) -> int:
    """Bytes ``func``'s call held at its peak above its outputs, as the allocator saw it
    on a second call with copies of the same inputs, cached per call key (NOTE [ Kernel
    scratch measured by probes ]); with ``probe=False``, or where the call cannot be
    probed, the cached figure or 0. ``tensors``: the call's tensors (arguments and
    output), where the caller has them. Default: found here.

    Example:
        >>> x = torch.randn(1, 8, 16, 16)
        >>> w = torch.randn(8, 8, 3, 3)
        >>> conv = torch.ops.aten.convolution.default
        >>> call = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        >>> probe_scratch(conv, call, {}, conv(*call)) > 0
        True
    """
    if not _counted.on:
        return 0
    if tensors is None:
        tensors = [t for t in _leaves((args, kwargs, out)) if isinstance(t, Tensor)]
    if any(_fake(t) for t in tensors):
        return 0  # a simulated step: no probed scratch, whatever this process ran before
    key = probe_key(func, args, kwargs)
    known = _PROBED.get(key)
    if known is not None or not probe or _probes[0] >= MAX_PROBES:
        return known or 0
    if not tensors or not _probeable(func, tensors):
        return 0
    _probes[0] += 1
    kept: list[Any] = []
    try:
        with torch.no_grad():
            call_args, call_kwargs = _copy(args), _copy(kwargs)
            peak = allocator_peak(lambda: kept.append(func(*call_args, **call_kwargs)),
                                  device=tensors[0].device)
    except Exception:  # a call that cannot run twice: count no scratch
        _PROBED[key] = 0
        return 0
    scratch = max(peak.peak_bytes - peak.end_bytes, 0)
    _PROBED[key] = scratch = scratch if scratch >= MIN_PROBED_BYTES else 0
    return scratch


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    return [value]


def clear_probes() -> None:
    """Forget every probed figure (the next measurement probes again).

    Example:
        >>> clear_probes()
    """
    _PROBED.clear()
    _probes[0] = 0
