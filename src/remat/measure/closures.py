"""Instance forwards that close over the original model, re-pointed at a copy.

NOTE [ Closures over the original model ]
    Training libraries patch a model's ``forward`` on the instance, and some keep the
    old forward in a closure: TRL's ``SFTTrainer`` (``add_fused_lm_head``) stores
    ``original_forward = model.forward``, a method bound to the original model, in a
    cell of the new function; accelerate wraps that again in an autocast function and
    a ``ConvertOutputsToFp32`` object. ``copy.deepcopy`` rebinds a bound method stored on
    the instance, but copies neither functions nor their cells, so the copy's forward
    still runs the *original* model: a fake copy (measure/fake.py NOTE [ Fake copies ])
    would compute on real tensors, and hooks on the copy's blocks would never fire
    (``remat.plan`` then reports its blocks as not called).

    :func:`rebind_closures` walks each copied module's instance attributes that are
    callables (functions, bound methods, ``functools.partial`` and plain callable
    objects, through their closure cells and attributes) and rebuilds every one that
    reaches an object the copy replaced, with the replacement: the ``memo`` deepcopy
    filled (original id -> copy). What reaches nothing replaced is left as it is, so
    module-level functions and remat's own regions are untouched.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

#: Attributes every function has that ``types.FunctionType(...)`` does not set.
_FUNCTION_ATTRS = ("__qualname__", "__doc__", "__module__", "__kwdefaults__", "__annotations__")


def rebind_closures(copied: nn.Module, memo: Mapping[int, Any]) -> int:
    """Point the instance callables of ``copied``'s modules at the copies in ``memo``.

    See NOTE [ Closures over the original model ]. Costs one walk of each module's
    instance callables; nothing is copied unless it reaches a replaced object.

    Args:
        copied: the copy ``copy.deepcopy(model, memo)`` returned.
        memo: the deepcopy memo: ``{id(original): copy}``.

    Returns:
        How many instance attributes were rebuilt.

    Example:
        >>> memo = {}
        >>> clone = copy.deepcopy(model, memo)
        >>> rebind_closures(clone, memo)   # 1 when model.forward closes over model
        1
    """
    rebuilt = 0
    seen: dict[int, Any] = {}
    for module in copied.modules():
        for key, value in list(vars(module).items()):
            if not _walkable(value):
                continue
            new = _rebind(value, memo, seen)
            if new is not value:
                vars(module)[key] = new
                rebuilt += 1
    return rebuilt


def _walkable(value: Any) -> bool:
    """A callable that may hide a reference: not a module, tensor or class."""
    return callable(value) and not isinstance(value, (nn.Module, torch.Tensor, type))


def _rebind(value: Any, memo: Mapping[int, Any], seen: MutableMapping[int, Any]) -> Any:
    """``value`` with every reference to a replaced object swapped (unchanged if none)."""
    key = id(value)
    if key in memo:
        return memo[key]
    if key in seen:
        return seen[key]
    if not _walkable(value):
        return value
    seen[key] = value  # a cycle back here keeps the original (placeholder)
    out = _rebuild(value, memo, seen)
    seen[key] = out
    return out


def _rebuild(value: Any, memo: Mapping[int, Any], seen: MutableMapping[int, Any]) -> Any:
    if isinstance(value, types.MethodType):
        func = _rebind(value.__func__, memo, seen)
        owner = memo.get(id(value.__self__), value.__self__)
        if func is value.__func__ and owner is value.__self__:
            return value
        return types.MethodType(func, owner)
    if isinstance(value, types.FunctionType):
        return _rebuild_function(value, memo, seen)
    if isinstance(value, functools.partial):
        func = _rebind(value.func, memo, seen)
        args = tuple(_swap(a, memo, seen) for a in value.args)
        keywords = {k: _swap(v, memo, seen) for k, v in value.keywords.items()}
        if func is value.func and _same(args, value.args) and \
                _same(keywords.values(), value.keywords.values()):
            return value
        return functools.partial(func, *args, **keywords)
    state = getattr(value, "__dict__", None)
    if not isinstance(state, dict):
        return value
    new_state = {k: _swap(v, memo, seen) for k, v in state.items()}
    if _same(new_state.values(), state.values()):
        return value
    # object.__new__, not copy.copy: accelerate's wrapper refuses to pickle (__getstate__).
    clone = object.__new__(type(value))
    clone.__dict__.update(new_state)
    return clone


def _rebuild_function(value: types.FunctionType, memo: Mapping[int, Any],
                      seen: MutableMapping[int, Any]) -> Any:
    cells = value.__closure__ or ()
    contents = [_cell(c) for c in cells]
    new_contents = [c if c is _EMPTY else _swap(c, memo, seen) for c in contents]
    new_dict = {k: _swap(v, memo, seen) for k, v in vars(value).items()}
    if _same(new_contents, contents) and _same(new_dict.values(), vars(value).values()):
        return value
    closure = tuple(types.CellType() if c is _EMPTY else types.CellType(c)
                    for c in new_contents)
    clone = types.FunctionType(value.__code__, value.__globals__, value.__name__,
                               value.__defaults__, closure or None)
    for attr in _FUNCTION_ATTRS:
        setattr(clone, attr, getattr(value, attr))
    clone.__dict__.update(new_dict)
    return clone


_EMPTY = object()


def _cell(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet assigned
        return _EMPTY


def _swap(value: Any, memo: Mapping[int, Any], seen: MutableMapping[int, Any]) -> Any:
    """A replaced object's copy, a rebuilt callable, or ``value`` itself."""
    return memo.get(id(value)) if id(value) in memo else _rebind(value, memo, seen)


def _same(new: Any, old: Any) -> bool:
    return all(a is b for a, b in zip(new, old, strict=True))
