"""The fake mode remat's simulated steps run under: PyTorch's, with cheaper cache keys.

NOTE [ Fake dispatch cache keys ]
    ``FakeTensorMode`` caches each op's output metadata under a key built from the op's
    arguments; a fake step's ops are mostly cache hits, so the key's cost is the mode's own
    cost per op. PyTorch builds the key of a fake-tensor argument field by field
    (``extract_tensor_metadata`` then ``_flatten_into``: a dataclass walk, sparse-layout
    checks, a contiguity test per memory format), general enough for symbolic shapes and
    sparse layouts. Simulated steps have neither, and the key was a fifth to a quarter of a
    fake step's time. :class:`_FakeMode` keys a fake tensor of its own, strided, with plain
    sizes and no constant, by one tuple of the same facts (dtype, sizes, strides, device,
    storage offset, storage bytes, requires_grad, quantized, conjugate and negative bits,
    inference): the memory format that PyTorch's key adds follows from the sizes and
    strides, and the sparse fields are empty for a strided tensor. Every other argument
    is keyed by PyTorch's own code, plain values as PyTorch keys them, so a key holds the
    same facts and two calls share an entry exactly when PyTorch's keys would. A tensor's
    tuple starts with a private marker, so these keys never equal a key PyTorch built (the
    cache is shared by every mode). Outputs, bypasses and cache entries are PyTorch's.

    ``aten._unsafe_view`` (what a matmul of a batch of rows reshapes its result with) is
    ``view`` without autograd's view tracking, and that tracking happens above the fake
    mode; PyTorch's mode cannot cache it (an alias the cache does not know as a view) and
    runs its meta decomposition on every call. :class:`_FakeMode` answers it as
    ``aten.view``, which it caches as the alias it is: the same sizes, strides and
    storage. Together the two cut an exact simulation's CPU time by a quarter
    (benchmarks/fake_dispatch.py; figures in benchmarks/RESULTS.md).
    Where this PyTorch's methods have other signatures the plain mode is used.

NOTE [ Fake outputs from the cache ]
    A cache hit still builds a new fake tensor for each output, through PyTorch's general
    path (symbolic sizes, constructor keywords checked one by one, every memo written
    through its descriptor), and that path cost about as much as the key. An output that
    is not an argument changed in place, strided, with plain sizes and no conjugate or
    negative bit, is built by :class:`_FakeMode` the way ``FakeTensor.__new__`` builds
    it: an empty meta tensor of the cached sizes and strides (a view's set onto its
    base's storage, as PyTorch's path does), wrapped with the fake device's dispatch
    keys, its attributes copied from a tensor PyTorch's path built (the fake device, the
    mode, no constant, empty memos). The first such output per device, once for a view
    and once for any other op, is built both ways and the two compared (type,
    attributes, dispatch keys, sizes, strides, storage); where they differ, and for
    every other output, PyTorch's path builds it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig, FakeTensorMode

from remat.measure.dispatch_modes import direct_dispatch

#: Values keyed by their type and the value itself: as PyTorch keys such an op argument,
#: and as a FLOP formula receives it (NOTE [ FLOPs by shapes ] in flops.py).
PLAIN_VALUES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                torch.memory_format)
#: Starts a fake tensor's key tuple (NOTE [ Fake dispatch cache keys ]).
_TENSOR_KEY = object()
_UNSAFE_VIEW, _VIEW = torch.ops.aten._unsafe_view.default, torch.ops.aten.view.default


@direct_dispatch
class _FakeMode(FakeTensorMode):
    """``FakeTensorMode`` with the cheaper cache key (NOTE [ Fake dispatch cache keys ])
    and outputs (NOTE [ Fake outputs from the cache ])."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Per device and whether a view: the attributes of such fake outputs, or ``None``
        #: where PyTorch's path builds them (NOTE [ Fake outputs from the cache ]).
        self._templates: dict[tuple[torch.device, bool], dict[str, Any] | None] = {}

    def _cached_dispatch_impl(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if func is _UNSAFE_VIEW:  # served as the view it is (see the module's NOTE)
            func = _VIEW
        return super()._cached_dispatch_impl(func, types, args, kwargs)

    def _prep_args_for_hash(self, result: list[object], args: Any, state: Any,
                            id_hashed_objects: list[object]) -> None:
        if isinstance(args, dict):
            super()._prep_args_for_hash(result, args, state, id_hashed_objects)
            return
        if isinstance(args, (list, tuple)):  # as PyTorch marks a sequence
            result.append(type(args))
            result.append(f"length_{len(args)}")
        for arg in args:
            kind = type(arg)
            if (kind is FakeTensor and arg.fake_mode is self and arg.constant is None
                    and arg.layout is torch.strided and not arg._has_symbolic_sizes_strides):
                result.append((_TENSOR_KEY, arg.dtype, arg.shape, arg.stride(), arg.device,
                               arg.storage_offset(), arg.untyped_storage().nbytes(),
                               arg.requires_grad, arg.is_quantized, arg.is_conj(),
                               arg.is_neg(), arg.is_inference()))
            elif kind in PLAIN_VALUES:
                result.append(kind)
                result.append(arg)
            elif kind is list or kind is tuple:
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            else:
                super()._prep_args_for_hash(result, (arg,), state, id_hashed_objects)

    def _get_output_tensor_from_cache_entry(self, state: Any, entry: Any, key: Any,
                                            func: Any, args: Any) -> Any:
        """An output built as NOTE [ Fake outputs from the cache ] says, else PyTorch's."""
        meta = entry.metadata
        view = func.is_view
        if (meta is None or entry.inplace_idx is not None or meta.layout is not torch.strided
                or meta.is_conj or meta.is_neg or self.shape_env is not None
                or FakeTensorConfig.debug or type(meta.storage_offset) is not int
                or (view and (entry.view_idx is None
                          or type(args[entry.view_idx]) is not FakeTensor))
                or not all(type(n) is int for n in (*meta.shape, *meta.stride))):
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        if (meta.device, view) not in self._templates:
            self._templates[meta.device, view] = self._template(state, entry, key, func, args)
        template = self._templates[meta.device, view]
        if template is None:
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        return self._lean(meta, args[entry.view_idx] if view else None, template)

    def _lean(self, meta: Any, base: FakeTensor | None, template: dict[str, Any]) -> FakeTensor:
        """``FakeTensor(self, empty, meta.device)`` without its general checks; a view
        shares ``base``'s storage."""
        with torch._C._DisableTorchDispatch():
            empty = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype,
                                        device="meta", requires_grad=meta.requires_grad)
            if base is not None:
                empty.set_(base.untyped_storage(), meta.storage_offset, meta.shape,
                           meta.stride)
        out = torch.Tensor._make_subclass(FakeTensor, empty, empty.requires_grad,
                                          dispatch_device=True,
                                          device_for_backend_keys=template["_fake_device"])
        if self._allow_unsafe_data_ptr_access:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(out)
        else:
            torch._C._set_throw_on_mutable_data_ptr(out)
        out.__dict__.update(template)
        return out

    def _template(self, state: Any, entry: Any, key: Any, func: Any,
                  args: Any) -> dict[str, Any] | None:
        """The attributes of a fake output on ``entry``'s device, from one built by
        PyTorch's path, if the lean build gives the same tensor (else ``None``)."""
        general = super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        if type(general) is not FakeTensor or general.fake_mode is not self:
            return None
        template = dict(general.__dict__)
        lean = self._lean(entry.metadata, args[entry.view_idx] if func.is_view else None,
                          template)

        def facts(t: FakeTensor) -> tuple[Any, ...]:
            storage = t.untyped_storage()
            return (torch._C._dispatch_keys(t), t.shape, t.stride(), t.dtype,
                    t.requires_grad, t.device, t.storage_offset(), storage.nbytes(),
                    storage._cdata if func.is_view else None, t.__dict__)

        return template if facts(lean) == facts(general) else None


def _keys_supported() -> bool:
    """Whether this PyTorch has the methods :class:`_FakeMode` overrides, with the
    signatures it overrides (cache keys, cached dispatch, outputs from the cache)."""
    keys = getattr(FakeTensorMode, "_prep_args_for_hash", None)
    dispatch = getattr(FakeTensorMode, "_cached_dispatch_impl", None)
    output = getattr(FakeTensorMode, "_get_output_tensor_from_cache_entry", None)
    if keys is None or dispatch is None or output is None or "constant" not in getattr(
            FakeTensor, "__annotations__", {}):
        return False
    return (list(inspect.signature(keys).parameters)
            == ["self", "result", "args", "state", "id_hashed_objects"]
            and list(inspect.signature(dispatch).parameters)
            == ["self", "func", "types", "args", "kwargs"]
            and list(inspect.signature(output).parameters)
            == ["self", "state", "entry", "key", "func", "args"])


_KEYS_SUPPORTED = _keys_supported()


def new_fake_mode() -> FakeTensorMode:
    """A fake mode for a simulated step: non-fake inputs allowed (a real parameter the
    copy missed is converted as it is used), cache keys built cheaply where this PyTorch
    allows (NOTE [ Fake dispatch cache keys ]).

    Example:
        >>> mode = new_fake_mode()
        >>> with mode:
        ...     x = torch.empty(4, 8)
        >>> tuple(x.shape)
        (4, 8)
    """
    cls = _FakeMode if _KEYS_SUPPORTED else FakeTensorMode
    return cls(allow_non_fake_inputs=True)
