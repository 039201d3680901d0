"""Fake copies of models whose instance forward closes over the original (TRL, accelerate)."""

from __future__ import annotations

import functools
import pickle
import types
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import remat
from remat.measure.closures import rebind_closures
from remat.measure.fake import fake_copy


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU())
                                    for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _Wrapper:
    """Like accelerate's ConvertOutputsToFp32: a callable object that refuses to pickle."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __getstate__(self) -> None:
        raise pickle.PicklingError("no")


def _patched() -> nn.Module:
    """TRL's pattern (a closure over ``model.forward``) under accelerate's (a wrapper)."""
    torch.manual_seed(0)
    model = _Net()
    original_forward = model.forward

    def patched(self: nn.Module, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return original_forward(x) * scale

    model.forward = types.MethodType(patched, model)  # type: ignore[method-assign]
    inner = _Wrapper(model.forward.__func__)  # type: ignore[attr-defined]

    def outer(*args: Any, **kwargs: Any) -> Any:
        return inner(*args, **kwargs)

    model.forward = types.MethodType(outer, model)  # type: ignore[method-assign]
    return model


def test_a_fake_copy_runs_its_own_blocks_not_the_originals() -> None:
    model = _patched()
    called: list[str] = []
    mode = FakeTensorMode()
    copy = fake_copy(model, mode)
    model.blocks[0].register_forward_pre_hook(lambda *_: called.append("original"))
    copy.blocks[0].register_forward_pre_hook(lambda *_: called.append("copy"))
    with mode:
        out = copy(torch.empty(4, 16))
    assert called == ["copy"]
    assert out.shape == (4, 16) and type(out).__name__ == "FakeTensor"


def test_rebind_leaves_callables_that_reach_nothing_copied() -> None:
    model = _Net()
    model.helper = functools.partial(torch.add, alpha=2)  # type: ignore[assignment]
    memo: dict[int, Any] = {}
    import copy

    clone = copy.deepcopy(model, memo)
    helper = clone.helper
    assert rebind_closures(clone, memo) == 0
    assert clone.helper is helper
    patched = _patched()
    memo = {}
    clone = copy.deepcopy(patched, memo)
    assert rebind_closures(clone, memo) == 1  # the instance forward, rebuilt


def test_plan_and_profile_of_a_patched_model() -> None:
    model = _patched()
    x = torch.randn(64, 16)
    none = remat.profile(model, x, timing=False)
    simulated = remat.profile(model, x, simulate=True)
    assert simulated.peak_bytes == none.peak_bytes
    # Planning captures block inputs on a fake copy: before the copy's closures were
    # rebuilt, its blocks were never called (BlocksNotFound).
    # (1 KiB above the tracked peak: the allocator also sees a few bytes of kernel
    # scratch, NOTE [ Fits on the allocator ].)
    plan = remat.plan(model, x, budget=none.peak_bytes + 1024)
    assert plan.block_names == ("blocks.0", "blocks.1")
    assert plan.measured_peak_bytes == none.peak_bytes
