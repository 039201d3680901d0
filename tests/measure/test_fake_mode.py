"""remat's fake mode (NOTE [ Fake dispatch cache keys ], NOTE [ Fake outputs from the
cache ]): the same outputs as PyTorch's own mode, keys that tell apart every fact of a
tensor, outputs built lean only where that build is checked, and a simulated step that uses
them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import remat.measure.fake_mode as fake_mode
from remat.measure.fake_mode import _TENSOR_KEY, new_fake_mode
from remat.models import build_model
from remat.simulate.run import simulate

pytestmark = pytest.mark.skipif(not fake_mode._KEYS_SUPPORTED,
                                reason="this PyTorch builds keys another way")

#: Ops on one (n, n) input, each reached through the dispatch cache.
OPS: list[Callable[[torch.Tensor], Any]] = [
    lambda x: x.t().contiguous(), lambda x: x @ x.t(), lambda x: x[1:, ::2] * 2.0,
    lambda x: torch.softmax(x, -1), lambda x: x.sum(0, keepdim=True),
    lambda x: x.reshape(-1).narrow(0, 1, 3).clone(), lambda x: x.to(torch.bfloat16),
    lambda x: torch.nn.functional.linear(x, x, x[0]), lambda x: x.transpose(0, 1).exp(),
    # a batch of rows times a matrix: a reshape, mm and _unsafe_view back
    lambda x: x.expand(3, *x.shape) @ x,
    lambda x: torch.ops.aten._unsafe_view(x.contiguous(), (-1,)),
]


def _facts(t: torch.Tensor) -> tuple[Any, ...]:
    # every attribute the fake tensor carries (its own mode's name, not the mode)
    attributes = sorted((k, "mode" if k == "fake_mode" else v) for k, v in t.__dict__.items())
    return (type(t), t.dtype, tuple(t.shape), t.stride(), t.storage_offset(),
            t.untyped_storage().nbytes(), t.requires_grad, t.device,
            repr(torch._C._dispatch_keys(t)), attributes)


def _run(mode: FakeTensorMode, n: int, transposed: bool, offset: int) -> list[Any]:
    with mode:
        base = torch.empty(n * n + 3)
        x = base[offset:offset + n * n].view(n, n)
        if transposed:
            x = x.t()
        outs = []
        for op in OPS:
            out = op(x)
            outs.append((_facts(out), out.untyped_storage() is x.untyped_storage()))
        return outs


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 9), transposed=st.booleans(), offset=st.integers(0, 3))
def test_outputs_equal_pytorchs_own_mode(n: int, transposed: bool, offset: int) -> None:
    # twice each: the second run is served from the cache the first filled
    ours = [_run(new_fake_mode(), n, transposed, offset) for _ in range(2)]
    theirs = [_run(FakeTensorMode(allow_non_fake_inputs=True), n, transposed, offset)
              for _ in range(2)]
    assert ours[0] == ours[1] == theirs[0] == theirs[1]


def test_outputs_are_built_lean_only_where_the_lean_build_is_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def outputs(mode: FakeTensorMode) -> list[torch.Tensor]:
        with mode:
            x = torch.empty(4, 6, requires_grad=True)
            return [op(x) for op in (lambda x: x * 2, lambda x: x.t()) for _ in range(2)]

    mode = new_fake_mode()
    plain = outputs(mode)
    # a plain output and a view, each on the lean path
    assert sorted(view for _, view in mode._templates) == [False, True]
    assert all(isinstance(t, dict) for t in mode._templates.values())
    assert plain[3].untyped_storage()._cdata == plain[2].untyped_storage()._cdata
    # a lean build that loses a fact fails its check: PyTorch's path builds every output
    real = fake_mode._FakeMode._lean

    def lossy(self: Any, meta: Any, base: Any, template: Any) -> torch.Tensor:
        out = real(self, meta, base, template)
        out.__dict__["constant"] = torch.zeros(())
        return out

    monkeypatch.setattr(fake_mode._FakeMode, "_lean", lossy)
    mode = new_fake_mode()
    general = outputs(mode)
    assert all(t is None for t in mode._templates.values())
    assert [_facts(t) for t in general] == [_facts(t) for t in plain]
    assert all(t.constant is None for t in general)


def _key(mode: FakeTensorMode, t: torch.Tensor) -> tuple[object, ...]:
    from torch._subclasses.fake_tensor import _CacheKeyState

    return mode._cache_key(_CacheKeyState(None), torch.ops.aten.mul.Tensor, (t, 2.0), {}).key


def test_keys_tell_apart_every_fact_of_a_tensor() -> None:
    mode = new_fake_mode()
    with mode:
        base = torch.empty(4, 6)
        variants = {
            "plain": base, "dtype": base.to(torch.float64), "shape": base.view(6, 4),
            "strides": base.t().contiguous().t(),
            # storage bytes and offset each alone
            "storage": torch.empty(48)[:24].view(4, 6), "offset": torch.empty(48)[24:].view(4, 6),
            "requires_grad": base.clone().requires_grad_(),
            "inference": None, "device": base.to("meta"),
        }
    with torch.inference_mode(), mode:
        variants["inference"] = torch.empty(4, 6)
    keys = {name: _key(mode, t) for name, t in variants.items()}
    assert len(set(keys.values())) == len(keys), keys
    assert all(any(isinstance(v, tuple) and v[:1] == (_TENSOR_KEY,) for v in key)
               for key in keys.values())
    # the same facts, another tensor: the same key
    with mode:
        assert _key(mode, torch.empty(4, 6)) == keys["plain"]


def test_a_simulated_step_reads_the_same_bytes_with_either_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    kwargs: dict[str, Any] = dict(seq_len=32, batch_sizes=[2], strategies=["none", "attn"],
                                  device="l4")
    factory = lambda: build_model("llama-tiny", n_layer=2)  # noqa: E731
    ours = simulate(factory, exact=True, **kwargs)
    monkeypatch.setattr(fake_mode, "_KEYS_SUPPORTED", False)
    FakeTensorMode.cache.clear()
    theirs = simulate(factory, exact=True, **kwargs)
    for a, b in zip(ours.rows, theirs.rows, strict=True):
        assert (a.peak_bytes, a.activation_bytes, a.flops, a.recompute_flops) == (
            b.peak_bytes, b.activation_bytes, b.flops, b.recompute_flops)


def test_the_tracker_answers_a_fake_tensors_device_as_its_mode_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from remat.measure.tracker import MemoryTracker

    mode = new_fake_mode()
    with mode:
        w = torch.empty(4, 4, requires_grad=True)
    asked: list[object] = []
    real_dispatch = FakeTensorMode.dispatch

    def dispatch(self: FakeTensorMode, func: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(func)
        return real_dispatch(self, func, *args, **kwargs)

    monkeypatch.setattr(FakeTensorMode, "dispatch", dispatch)
    with mode, MemoryTracker() as tracker:
        assert w.device == torch.device("cpu")
        (w * 2.0).sum().backward()  # autograd asks the tensors' devices
        assert w.grad is not None and w.grad.device == torch.device("cpu")
    assert tracker.peak_bytes > 0 and torch.ops.aten.mul.Tensor in asked
    assert torch.ops.prim.device.default not in asked  # the tracker answered each
