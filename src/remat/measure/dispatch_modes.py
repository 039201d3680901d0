"""Dispatch modes that call their ``__torch_dispatch__`` directly while dynamo is idle.

NOTE [ Dynamo's wrapper around a dispatch mode ]
    PyTorch wraps the ``__torch_dispatch__`` of every ``TorchDispatchMode`` subclass in
    ``torch._disable_dynamo`` (``TorchDispatchMode.__init_subclass__``): while a
    ``torch.compile``'d frame runs, dynamo must not trace into the mode's Python. The
    wrapper costs a microsecond or so per op and per mode (two swaps of the
    frame-evaluation callback), paid on every op by each mode a step runs: two in a fake
    step (the fake mode and the tracker), more with checkpointing's own.

    Dynamo can only trace a frame while a frame-evaluation callback is installed; with
    none (``get_eval_frame_callback() is None``: no compiled frame is running) the
    wrapper only installs "none" again around the call, so calling the mode's own
    function is the same. :func:`direct_dispatch` gives a mode class a
    ``__torch_dispatch__`` that checks that and otherwise calls PyTorch's wrapper, as
    before: under ``torch.compile`` (any callback, the "run only" one included) nothing
    changes. A PyTorch whose modes are not wrapped (no ``__wrapped__``) keeps the class as
    it is. PyTorch's wrapper stays reachable as ``__torch_dispatch__.dynamo_wrapped`` (the
    tracker calls it once before its first step: NOTE [ First dispatch ] in tracker.py).
"""

from __future__ import annotations

from typing import Any, TypeVar

from torch._C._dynamo.eval_frame import get_eval_frame_callback

Mode = TypeVar("Mode", bound=type)


def direct_dispatch(cls: Mode) -> Mode:
    """Give the dispatch mode ``cls`` a ``__torch_dispatch__`` that skips dynamo's
    wrapper while no compiled frame runs (NOTE [ Dynamo's wrapper around a dispatch mode ]).

    The trade-off: none in behaviour; one C call per op instead of the wrapper's frame
    swaps, and the class's ``__torch_dispatch__`` is no longer PyTorch's wrapper object
    (code that inspects it for ``_torchdynamo_disable`` finds the flag on ours too).

    Args:
        cls: a ``TorchDispatchMode`` subclass; its own or an inherited
            ``__torch_dispatch__`` is used.

    Returns:
        ``cls``, changed in place (a class decorator).

    Example:
        >>> import torch
        >>> from torch.utils._python_dispatch import TorchDispatchMode
        >>> @direct_dispatch
        ... class Passthrough(TorchDispatchMode):
        ...     def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ...         return func(*args, **(kwargs or {}))
        >>> with Passthrough():
        ...     int(torch.ones(2).sum())
        2
    """
    wrapped = next((klass.__dict__["__torch_dispatch__"] for klass in cls.__mro__
                    if "__torch_dispatch__" in klass.__dict__), None)
    own = getattr(wrapped, "__wrapped__", None)
    if wrapped is None or own is None or getattr(wrapped, "__name__", "") != "__torch_dispatch__":
        return cls

    def __torch_dispatch__(self: Any, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if get_eval_frame_callback() is None:
            return own(self, func, types, args, kwargs)
        return wrapped(self, func, types, args, kwargs)

    __torch_dispatch__.__qualname__ = f"{cls.__qualname__}.__torch_dispatch__"
    __torch_dispatch__.__doc__ = own.__doc__
    __torch_dispatch__.__wrapped__ = own  # type: ignore[attr-defined]
    __torch_dispatch__.dynamo_wrapped = wrapped  # type: ignore[attr-defined]
    __torch_dispatch__._torchdynamo_disable = True  # type: ignore[attr-defined]
    cls.__torch_dispatch__ = __torch_dispatch__  # type: ignore[attr-defined]
    return cls
