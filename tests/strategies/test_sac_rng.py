"""NOTE [ Kept random ops and the RNG ]: a kept random op must not shift later draws."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat.strategies import sac
from remat.strategies.sac import sac_context_fn
from remat.strategies.sac_rng import names_random_op


class _Noisy(nn.Module):
    """Three rounds of linear, random scale (rand_like) and tanh; dropout at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.lins:
            h = lin(x)
            x = torch.tanh(h * torch.rand_like(h))
        return F.dropout(x, 0.3, training=True)


def _grads(model: nn.Module, x: torch.Tensor, save: list[str] | None) -> list[torch.Tensor]:
    model.zero_grad()
    torch.manual_seed(1)
    if save is None:
        out = model(x)
    else:
        out = checkpoint(model, x, use_reentrant=False, context_fn=sac_context_fn(save))
    out.square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _max_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def test_a_kept_random_op_leaves_later_draws_as_in_the_forward(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model, x = _Noisy(), torch.randn(4, 16)
    expected = _grads(model, x, None)
    assert _max_error(expected, _grads(model, x, ["aten.rand_like#0"])) == 0.0
    # Without the replay (SAC as PyTorch ships it) the same save set corrupts gradients.
    monkeypatch.setattr(sac, "names_random_op", lambda names: False)
    assert _max_error(expected, _grads(model, x, ["aten.rand_like#0"])) > 1e-3


@settings(max_examples=25, deadline=None)
@given(st.sets(st.sampled_from(["aten.rand_like#0", "aten.rand_like#1", "aten.rand_like#2",
                                "aten.addmm#1", "aten.tanh#0", "aten.mul#2",
                                "aten.bernoulli_", "aten.rand_like"])))
def test_any_save_set_keeps_gradients(save: set[str]) -> None:
    torch.manual_seed(0)
    model, x = _Noisy(), torch.randn(4, 16)
    assert _max_error(_grads(model, x, None), _grads(model, x, sorted(save))) == 0.0


def test_replay_drops_out_where_no_kept_random_op_draws() -> None:
    torch.manual_seed(0)
    q = torch.randn(1, 2, 8, 4, requires_grad=True)

    def attention(t: torch.Tensor) -> torch.Tensor:  # CPU flash attention, no dropout
        return F.dropout(F.scaled_dot_product_attention(t, t, t), 0.2, training=True)

    def step(fn: object) -> None:
        out = checkpoint(attention, q, use_reentrant=False, context_fn=fn)
        out.sum().backward()

    kept_attention = sac_context_fn(["aten._scaled_dot_product_flash_attention_for_cpu"])
    step(kept_attention)
    step(kept_attention)  # learns from the first forward: its kept op drew nothing
    assert kept_attention.replays is False  # type: ignore[attr-defined]
    kept_noise = sac_context_fn(["aten.rand_like#0"])
    torch.manual_seed(0)
    model, x = _Noisy(), torch.randn(4, 16)
    for _ in range(2):
        checkpoint(model, x, use_reentrant=False, context_fn=kept_noise).sum().backward()
    assert kept_noise.replays is True  # type: ignore[attr-defined]


def test_names_random_op() -> None:
    assert names_random_op(["aten.mm", "aten._scaled_dot_product_efficient_attention"])
    assert names_random_op(["aten.native_dropout"])
    assert not names_random_op(["aten.mm", "aten.addmm", "aten.no_such_op", "custom.op"])


def _attention_step(kept: object) -> None:
    """Four checkpointed attention regions (CPU flash attention, no dropout), forward and
    backward."""
    torch.manual_seed(0)
    x = torch.randn(2, 2, 64, 16, requires_grad=True)

    def attention(t: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(t, t, t).tanh()

    h = x
    for _ in range(4):
        h = checkpoint(attention, h, use_reentrant=False, context_fn=kept)
    h.sum().backward()


def test_a_kept_random_op_that_draws_nothing_keeps_no_state() -> None:
    """The first step after apply holds what later steps hold where no kept random op
    draws (attention without dropout): no generator state per region call (NOTE [ Kept
    random ops and the RNG ], last paragraph)."""
    from remat.measure.allocator import allocator_peak

    kept = sac_context_fn(["aten._scaled_dot_product_flash_attention_for_cpu"])
    first = allocator_peak(lambda: _attention_step(kept)).peak_bytes
    assert kept.rng_log.states == {}  # type: ignore[attr-defined]
    steady = allocator_peak(lambda: _attention_step(kept)).peak_bytes
    assert kept.replays is False  # type: ignore[attr-defined]
    assert first == steady
    # A kept op that draws leaves its state (replayed in the recompute).
    kept_noise = sac_context_fn(["aten.rand_like#0"])
    torch.manual_seed(0)
    checkpoint(_Noisy(), torch.randn(4, 16), use_reentrant=False,
               context_fn=kept_noise).sum().backward()
    assert list(kept_noise.rng_log.states) == [0]  # type: ignore[attr-defined]
