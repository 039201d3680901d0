"""Pitfalls caught while a checkpointed model runs, and models that survive torch.save."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import remat
from remat.measure import profile
from remat.models import build_model, make_batch


def _grads(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("strategy", ["full", "sqrt", "ops", "every:2"])
def test_a_checkpointed_model_survives_torch_save_and_load(strategy: str) -> None:
    model = build_model("gpt-tiny", n_layer=4, dropout=0.0)
    batch = make_batch(model, 2)
    reference = copy.deepcopy(model)
    remat.apply(model, strategy)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    applied = remat.strategies.applied(loaded)
    assert applied is not None and applied.strategy == strategy
    got, want = _grads(loaded, batch), _grads(reference, batch)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    kept = profile(loaded, batch, timing=False).activation_bytes  # still checkpointed:
    assert kept < profile(reference, batch, timing=False).activation_bytes


class _Block(nn.Module):
    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            x.mul_(2)  # fine without checkpointing: nothing saved x before
        return self.inner(torch.tanh(x))


class _Net(nn.Module):
    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(_Block(inplace) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x.sum()


def test_an_in_place_op_on_a_blocks_input_names_checkpointing() -> None:
    model, x = _Net(inplace=True), torch.randn(4, 8)
    model(x).backward()  # un-checkpointed, it trains
    remat.apply(model, "full")
    with pytest.raises(remat.RematError,
                       match=r"(?s)^remat: _Block is checkpointed and modified its input in "
                             r"place.*fix: make the op out of place.*blocks="):
        model(x)


def test_a_hook_registered_inside_a_region_after_apply_warns_once() -> None:
    model, x = _Net(), torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remat.apply(model, "full")
        model.blocks[0].register_forward_hook(lambda *a: None)  # on the region: runs once
        model(x).backward()
    calls: list[bool] = []
    model.blocks[1].inner.register_forward_pre_hook(  # (post-hooks may be cut short by
        lambda *a: calls.append(remat.is_recomputing()))  # checkpoint's early stop)
    with pytest.warns(remat.RematWarning, match=r"(?s)after remat.apply.*_Block.inner.*fire again"):
        model(x).backward()
    assert calls == [False, True]  # what the warning is about: it ran again on recompute
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).backward()  # once per region


def test_validate_and_profile_refuse_disabled_gradients_with_the_fix() -> None:
    model = build_model("gpt-tiny")
    batch = make_batch(model, 2)
    with torch.no_grad(), pytest.raises(remat.RematError,
                                        match=r"(?s)^remat.validate: gradients are disabled"
                                              r".*active: torch.no_grad\(\)"
                                              r".*fix: call remat.validate outside"):
        remat.validate(model, batch, "full")
    with torch.inference_mode(), pytest.raises(
            remat.RematError, match=r"(?s)^remat.profile: .*active: torch.inference_mode\(\)"):
        remat.profile(model, batch)


def test_a_meta_model_asks_for_simulate() -> None:
    with torch.device("meta"):
        model = build_model("gpt-tiny")
    batch = make_batch(model, 2)
    with pytest.raises(ValueError,
                       match="(?s)^remat.profile: .*meta device.*fix: pass simulate=True"):
        remat.profile(model, batch)
    with pytest.raises(ValueError, match="(?s)^remat.validate: .*meta device.*fix: .*materialize"):
        remat.validate(model, batch, "full")
    assert remat.profile(model, batch, simulate=True).peak_bytes > 0


def test_a_save_set_naming_ops_the_region_never_runs_warns_with_the_ops_it_runs() -> None:
    from remat.strategies import apply_decisions
    from remat.strategies.builtin import Full, SelectiveOps

    model = build_model("gpt-tiny")
    batch = make_batch(model, 2)
    decision = SelectiveOps(frozenset({"aten.convolution", "aten.addmm", "aten.addmm#999"}))
    apply_decisions(model, {"blocks.0": decision, "blocks.1": Full()})
    with pytest.warns(remat.RematWarning,
                      match=r"names \['aten.addmm#999', 'aten.convolution'\], which its "
                            r"forward never runs\n  it runs: .*aten.addmm x4"):
        model(**batch).loss.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(**batch).loss.backward()  # checked once
        remat.apply(model, "ops")  # the default set names kernels this region never runs:
        model(**batch).loss.backward()  # fine, some of them run
    apply_decisions(model, {"blocks.0": SelectiveOps(frozenset({"aten.convolution"}))})
    with pytest.warns(remat.RematWarning, match=r"names \['aten.convolution'\]"):
        model(**batch).loss.backward()  # saves nothing at all


class _SelfCheckpointing(nn.Module):
    """A model whose own forward checkpoints each block, as hand-written training code does."""

    def __init__(self, own: bool) -> None:
        super().__init__()
        self.own = own
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + (torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
                     if self.own else block(x))
        return x.square().mean()


@pytest.mark.parametrize("strategy", ["full", "ops"])
def test_a_region_inside_the_models_own_checkpoint_warns(strategy: str) -> None:
    """NOTE [ A region inside another checkpoint ]: the block would be recomputed twice."""
    x = torch.randn(4, 16)
    for own in (False, True):
        model = _SelfCheckpointing(own)
        remat.apply(model, strategy, blocks=nn.Sequential)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(x).backward()
        said = [str(w.message) for w in caught if "inside another" in str(w.message)]
        if not own:
            assert said == []
            continue
        assert said, [str(w.message) for w in caught]
        assert said[0].startswith("remat: Sequential is checkpointed by remat and runs inside "
                                  "another torch.utils.checkpoint call")
        assert "fix: remove your own checkpoint calls" in said[0]
