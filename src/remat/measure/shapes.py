"""A batch's tensor inputs by path, as a model's call receives them (NOTE [ Shape envelope ]
in remat/core/shapes.py), and a batch grown to a shape bucket.

A step calls the model as :func:`~remat.measure.step.call_model` does: ``model(**batch)``
for a mapping, ``model(*batch)`` for a tuple or list, ``model(batch)`` for a tensor. An
input's path starts with its keyword, or for a positional argument the name of the
``forward`` parameter it binds to (so ``model(x)`` and ``model(x=x)`` give the same
path; ``args.2`` past the named ones), then the keys and indices of nested mappings,
tuples and lists. The shape guard reads a call's inputs the same way from the
``(args, kwargs)`` of a forward pre-hook.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from remat.core.shapes import InputShapes, ShapeEnvelope
from remat.errors import message

#: Open :func:`unguarded` blocks; the shape guard checks nothing while one is open.
UNGUARDED = [0]


@contextmanager
def unguarded() -> Iterator[None]:
    """Within: a plan's shape guard lets every batch through (NOTE [ Shape guard ] in
    remat/strategies/guard.py). ``remat.profile`` measures in one, so a plan can be
    measured at shapes outside the ones it was made for. Process-wide (a plain counter,
    which the guard reads for a few nanoseconds and Dynamo traces as a constant).

    Example:
        >>> with unguarded():
        ...     model(**longer_batch)   # no ShapeOutsidePlan
    """
    UNGUARDED[0] += 1
    try:
        yield
    finally:
        UNGUARDED[0] -= 1


def positional_names(model: nn.Module) -> tuple[str, ...]:
    """The names positional arguments of ``type(model).forward`` bind to, in order (the
    class's own forward: an instance forward remat installed takes ``*args``)."""
    try:
        params = list(inspect.signature(type(model).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _walk(path: str, value: Any, out: dict[str, tuple[int, ...]]) -> None:
    if isinstance(value, Tensor):
        if value.dim() > 0:  # a scalar holds no activations (NOTE [ Shape envelope ])
            out[path] = tuple(value.shape)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _walk(f"{path}.{key}", item, out)
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            _walk(f"{path}.{index}", item, out)


def call_shapes(args: tuple[Any, ...], kwargs: Mapping[str, Any],
                names: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """The tensor inputs of a call ``model(*args, **kwargs)`` by path, with their shapes.

    Args:
        args: positional arguments.
        kwargs: keyword arguments.
        names: :func:`positional_names` of the model.

    Example:
        >>> call_shapes((torch.zeros(2, 8),), {"mask": None}, ("x",))
        {'x': (2, 8)}
    """
    out: dict[str, tuple[int, ...]] = {}
    for index, value in enumerate(args):
        _walk(names[index] if index < len(names) else f"args.{index}", value, out)
    for key, value in kwargs.items():
        _walk(key, value, out)
    return out


def as_call(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of the call a step makes with ``batch`` (``call_model``'s rule)."""
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def batch_shapes(model: nn.Module, batch: Any) -> dict[str, tuple[int, ...]]:
    """The tensor inputs ``model`` receives from ``batch`` by path, with their shapes.

    Example:
        >>> batch_shapes(model, {"input_ids": ids, "labels": ids})
        {'input_ids': (8, 512), 'labels': (8, 512)}
    """
    args, kwargs = as_call(batch)
    return call_shapes(args, kwargs, positional_names(model))


def batch_envelope(model: nn.Module, *batches: Any) -> ShapeEnvelope:
    """The :class:`~remat.core.shapes.ShapeEnvelope` of ``batches`` (one box each)."""
    return ShapeEnvelope.of(*(batch_shapes(model, b) for b in batches))


def _grown(value: Any, path: str, target: Mapping[str, tuple[int, ...]]) -> Any:
    if isinstance(value, Tensor):
        shape = target.get(path)
        if shape is None or value.dim() == 0:
            return value
        for dim, (size, want) in enumerate(zip(value.shape, shape, strict=True)):
            if want > size > 0:  # repeat the tensor's own slices: valid ids, masks, labels
                index = torch.arange(want, device=value.device) % size
                value = value.index_select(dim, index)
        return value
    if isinstance(value, Mapping):
        return {k: _grown(v, f"{path}.{k}", target) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_grown(v, f"{path}.{i}", target) for i, v in enumerate(value))
    return value


def grown_call(args: tuple[Any, ...], kwargs: Mapping[str, Any], names: tuple[str, ...],
               target: InputShapes | None = None) -> dict[str, Any] | tuple[Any, ...]:
    """A batch for the call ``(args, kwargs)`` with each tensor input grown to its shape in
    ``target`` (a shape bucket, NOTE [ Shape buckets ]) by repeating its own slices along
    each grown dimension, so token ids, masks, labels and position ids stay valid values
    (repeated position ids read as a packed row). The batch is a mapping when the call has
    keywords (positional arguments under their parameter names), else a tuple; with no
    ``target``, the call's own batch.

    Raises:
        ValueError: the call has keywords and more positional arguments than ``forward``
            names (no batch a step can call it with).
    """
    shapes = dict(target or ())
    if not kwargs:
        return tuple(_grown(v, names[i] if i < len(names) else f"args.{i}", shapes)
                     for i, v in enumerate(args))
    if len(args) > len(names):
        raise ValueError(message("", "the call has keyword and unnamed positional arguments",
                                 {"positional": len(args), "named by forward": len(names)},
                                 fix="call the model with keywords, or with positional "
                                     "arguments only"))
    named = dict(zip(names, args, strict=False))
    return {k: _grown(v, k, shapes) for k, v in {**named, **kwargs}.items()}
