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
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

#: Arguments keyed as PyTorch keys them: the type and the value.
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format)
#: Starts a fake tensor's key tuple (NOTE [ Fake dispatch cache keys ]).
_TENSOR_KEY = object()
_UNSAFE_VIEW, _VIEW = torch.ops.aten._unsafe_view.default, torch.ops.aten.view.default


class _FakeMode(FakeTensorMode):
    """``FakeTensorMode`` with the cheaper cache key (NOTE [ Fake dispatch cache keys ])."""

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
            elif kind in _PLAIN:
                result.append(kind)
                result.append(arg)
            elif kind is list or kind is tuple:
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            else:
                super()._prep_args_for_hash(result, (arg,), state, id_hashed_objects)


def _keys_supported() -> bool:
    """Whether this PyTorch has the two methods :class:`_FakeMode` overrides, with the
    signatures it overrides (cache keys, cached dispatch)."""
    keys = getattr(FakeTensorMode, "_prep_args_for_hash", None)
    dispatch = getattr(FakeTensorMode, "_cached_dispatch_impl", None)
    if keys is None or dispatch is None or "constant" not in getattr(
            FakeTensor, "__annotations__", {}):
        return False
    return (list(inspect.signature(keys).parameters)
            == ["self", "result", "args", "state", "id_hashed_objects"]
            and list(inspect.signature(dispatch).parameters)
            == ["self", "func", "types", "args", "kwargs"])


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
