"""NOTE [ Asynchronous offload ]: the region's hooks, on the CPU (the synchronous path)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat.strategies import offload
from remat.strategies.offload import offloading


class _Shared(nn.Module):
    """x feeds two linears (saved twice), then a product of their outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x)
        return self.a(h) * self.b(h)


def _grads(model: nn.Module, x: torch.Tensor, *, offloaded: bool) -> list[torch.Tensor]:
    model.zero_grad()
    if offloaded:
        with offloading(model, x.device, fake=True):
            out = model(x)
    else:
        out = model(x)
    out.square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def test_gradients_equal_and_each_tensor_copied_once(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model, x = _Shared(), torch.randn(4, 8, requires_grad=True)
    regions: list[offload._Region] = []
    real_region = offload._Region

    def spy(*args: object, **kwargs: object) -> offload._Region:
        region = real_region(*args, **kwargs)  # type: ignore[arg-type]
        regions.append(region)
        return region

    monkeypatch.setattr(offload, "_Region", spy)
    expected = _grads(model, x, offloaded=False)
    got = _grads(model, x, offloaded=True)
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)
    (region,) = regions
    # tanh's output (saved by tanh and by both linears: one copy), both linear outputs
    # (saved by the product); the weights are kept, never copied.
    assert len(region.host) == 3
    assert sorted(region.uses.values()) == [0, 0, 0]
    assert region.held == {} and region.back == {}


def test_parameters_and_views_of_them_are_kept() -> None:
    model = nn.Linear(4, 4)
    region = offload._Region(torch.device("cpu"), False, {
        offload.StorageWeakRef(p.untyped_storage()) for p in model.parameters()})
    assert region.pack(model.weight) is model.weight
    view = model.weight.t()
    assert region.pack(view) is view
    activation = torch.randn(3)
    assert isinstance(region.pack(activation), offload._Packed)


def test_retained_graph_backs_up_twice() -> None:
    torch.manual_seed(0)
    model, x = _Shared(), torch.randn(4, 8)
    with offloading(model, x.device, fake=True):
        out = model(x).square().sum()
    out.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    out.backward()
    for f, p in zip(first, model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, 2 * f)
