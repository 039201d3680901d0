"""direct_dispatch: a mode's own ``__torch_dispatch__`` while dynamo is idle, PyTorch's
wrapper while a compiled frame may run (NOTE [ Dynamo's wrapper around a dispatch mode ])."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import remat
import remat.measure.dispatch_modes as dispatch_modes
from remat.measure.dispatch_modes import direct_dispatch


def _mode() -> tuple[type, list[list[str]]]:
    callers: list[list[str]] = []

    @direct_dispatch
    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            frames, frame = [], sys._getframe(1)
            while frame is not None and len(frames) < 3:
                frames.append(frame.f_code.co_filename.rsplit("/", 1)[-1])
                frame = frame.f_back  # type: ignore[assignment]
            callers.append(frames)
            return func(*args, **(kwargs or {}))

    return Passthrough, callers


def test_an_idle_dynamo_calls_the_modes_own_dispatch() -> None:
    mode, callers = _mode()
    with mode():
        out = torch.ones(3) * 2
    assert out.tolist() == [2.0, 2.0, 2.0]
    assert callers and all(c[0] == "dispatch_modes.py" for c in callers), callers
    assert not any(name in ("eval_frame.py", "_compile.py") for c in callers for name in c)


def test_a_frame_callback_goes_through_dynamos_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    mode, callers = _mode()
    # any callback (here "run only", dynamo's False) means a compiled frame may be running
    monkeypatch.setattr(dispatch_modes, "get_eval_frame_callback", lambda: False)
    with mode():
        out = torch.ones(3) * 2
    assert out.tolist() == [2.0, 2.0, 2.0]
    assert callers and all("eval_frame.py" in c for c in callers), callers


def test_a_compiled_function_under_a_mode_runs_and_equals_eager() -> None:
    mode, callers = _mode()

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * 2).sum()

    compiled = torch.compile(f, backend="eager")
    x = torch.randn(8)
    with mode():
        got = compiled(x)
    assert torch.equal(got, f(x))
    assert callers  # the mode saw the ops


def test_every_remat_dispatch_mode_dispatches_directly() -> None:
    """A mode added to remat without the decorator pays dynamo's wrapper on every op."""
    found = []
    for info in pkgutil.walk_packages(remat.__path__, "remat."):
        if info.name.startswith(("remat.jax", "remat.cli")) or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, TorchDispatchMode) and cls.__module__ == info.name:
                found.append(cls)
    assert len(found) >= 6, found
    slow = [c.__qualname__ for c in found if not inspect.getsourcefile(
        c.__torch_dispatch__).endswith("dispatch_modes.py")]  # type: ignore[arg-type]
    assert not slow, slow
