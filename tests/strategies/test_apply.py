"""remat.apply / remat.remove: structure, parity, recomputation, errors."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from remat.blocks import find_blocks, find_sublayer
from remat.errors import BlocksNotFound, RematError, RematWarning, StrategyError
from remat.models import build_model, make_batch
from remat.strategies import (
    applied,
    apply,
    apply_decisions,
    is_recomputing,
    remove,
    sqrt_segments,
)
from remat.strategies.builtin import Full, Mlp, SelectiveOps
from remat.strategies.regions import region_of
from remat.validation import validate


class KwBlock(nn.Module):
    """A residual MLP block that takes a keyword tensor (like an attention mask)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(0.2),
                                 nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x)) * scale


class KwStack(nn.Module):
    """A stack of KwBlocks; the parent passes a different keyword tensor to each block."""

    def __init__(self, width: int = 16, depth: int = 5) -> None:
        super().__init__()
        self.layers = nn.ModuleList(KwBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, scale=torch.full((1,), 1.0 + 0.1 * i))
        return self.head(x).square().mean()


ALL = ["none", "full", "every:2", "every:3", "sqrt", "attn", "mlp", "ops", "offload"]


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", message=".*offload.*no-op.*")


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("strategy", ALL)
def test_gradient_parity_with_dropout(preset: str, strategy: str) -> None:
    torch.manual_seed(0)
    model = build_model(preset, n_layer=4, dropout=0.1)
    batch = make_batch(model, 2, seed=1)
    report = validate(model, batch, strategy)
    assert report.passed, report
    assert report.max_rel_error <= 1e-6


def test_state_dict_keys_and_params_unchanged() -> None:
    model = build_model("llama-tiny", n_layer=3)
    keys = list(model.state_dict())
    names = [n for n, _ in model.named_parameters()]
    blocks = find_blocks(model)
    for strategy in ALL:
        apply(model, strategy)
        assert list(model.state_dict()) == keys
        assert [n for n, _ in model.named_parameters()] == names
        assert find_blocks(model) == blocks
    remove(model)
    assert all(region_of(m) is None for m in model.modules())
    assert "forward" not in model.blocks[0].__dict__


def test_state_dict_round_trip_between_applied_and_plain() -> None:
    src = apply(build_model("gpt-tiny"), "full")
    dst = build_model("gpt-tiny")
    dst.load_state_dict(src.state_dict())
    apply(dst, "sqrt")
    src.load_state_dict(dst.state_dict())


def test_apply_twice_replaces_and_remove_restores() -> None:
    model = build_model("gpt-tiny", n_layer=4)
    apply(model, "full")
    apply(model, "every:2")
    labels = [label for _, label in applied(model).decisions]  # type: ignore[union-attr]
    assert labels == ["full", "none", "full", "none"]
    assert [region_of(b) is not None for b in model.blocks] == [True, False, True, False]
    assert remove(model) is model
    assert applied(model) is None
    assert all(region_of(m) is None for m in model.modules())


def test_sub_layer_strategies_touch_only_that_sub_layer() -> None:
    model = build_model("llama-tiny", n_layer=2)
    apply(model, "attn")
    for block in model.blocks:
        assert region_of(block) is None
        assert region_of(find_sublayer(block, "attn")[1]) is not None
        assert region_of(find_sublayer(block, "mlp")[1]) is None


@pytest.mark.parametrize("num_blocks, expected", [
    (1, [[0]]), (2, [[0], [1]]), (3, [[0, 1], [2]]), (4, [[0, 1], [2, 3]]),
    (5, [[0, 1, 2], [3, 4]]),
    (9, [[0, 1, 2], [3, 4, 5], [6, 7, 8]]), (12, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]),
])
def test_sqrt_segments(num_blocks: int, expected: list[list[int]]) -> None:
    assert [list(r) for r in sqrt_segments(num_blocks)] == expected


def _step_flops(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, int]:
    with FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    return {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
def test_flops_prove_recomputation(preset: str) -> None:
    model = build_model(preset, n_layer=4, dropout=0.0)
    batch = make_batch(model, 2)
    base = _step_flops(model, batch)
    totals = {}
    for strategy in ("full", "sqrt", "every:2", "attn", "mlp", "ops"):
        apply(model, strategy)
        totals[strategy] = _step_flops(model, batch)
        remove(model)
    matmul = ("aten.mm", "aten.addmm", "aten.bmm")
    none_total = sum(base.values())
    assert sum(totals["full"].values()) > none_total
    assert sum(totals["sqrt"].values()) > none_total
    assert none_total < sum(totals["every:2"].values()) < sum(totals["full"].values())
    assert none_total < sum(totals["mlp"].values()) < sum(totals["full"].values())
    assert none_total < sum(totals["attn"].values()) < sum(totals["full"].values())
    # op-level SAC keeps every matmul output: no matmul is run again in backward
    assert sum(totals["ops"].get(op, 0) for op in matmul) == sum(base.get(op, 0) for op in matmul)


def test_recompute_is_marked() -> None:
    model = build_model("gpt-tiny", n_layer=2)
    seen: list[bool] = []
    model.blocks[0].attn.register_forward_pre_hook(lambda *_: seen.append(is_recomputing()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply(model, "full")
    model(**make_batch(model, 2)).loss.backward()
    assert seen == [False, True]
    assert not is_recomputing()


def test_kwargs_pass_through_and_segments_replay_per_block_kwargs() -> None:
    torch.manual_seed(0)
    model = KwStack(depth=5)
    x = torch.randn(3, 16)
    for strategy in ("full", "sqrt", "every:2", "ops", "mlp"):
        assert validate(model, x, strategy).passed, strategy


def test_sqrt_several_forwards_before_one_backward() -> None:
    torch.manual_seed(0)
    model = build_model("llama-tiny", n_layer=5, dropout=0.1)
    b1, b2 = make_batch(model, 2, seed=1), make_batch(model, 2, seed=2)

    def grads() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        (model(**b1).loss + 2 * model(**b2).loss).backward()
        return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    ref = grads()
    apply(model, "sqrt")
    got = grads()
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_no_grad_forward_runs_plain() -> None:
    model = apply(build_model("gpt-tiny"), "sqrt")
    batch = make_batch(model, 2)
    model.eval()
    with torch.no_grad():
        out = model(**batch)
    remove(model)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, out.logits)


@pytest.mark.parametrize("strategy", ["full", "sqrt", "ops"])
def test_deepcopy_rebinds_regions_to_the_copy(strategy: str) -> None:
    model = apply(build_model("gpt-tiny", n_layer=4), strategy)
    clone = copy.deepcopy(model)
    assert clone.blocks[0].forward.__self__ is clone.blocks[0]
    segment = region_of(clone.blocks[0]).segment  # type: ignore[union-attr]
    if segment is not None:
        assert segment.members[0] is clone.blocks[0]
        assert region_of(clone.blocks[1]).segment is segment  # type: ignore[union-attr]
    batch = make_batch(clone, 2)
    torch.manual_seed(0)
    clone(**batch).loss.backward()
    torch.manual_seed(0)
    model(**batch).loss.backward()
    for p, q in zip(model.parameters(), clone.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_existing_instance_forward_is_kept() -> None:
    model = build_model("gpt-tiny", n_layer=2)
    block = model.blocks[0]
    calls: list[int] = []
    original = block.forward

    def traced(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return original(*args, **kwargs)

    block.forward = traced
    apply(model, "full")
    model(**make_batch(model, 2)).loss.backward()
    assert len(calls) == 2  # forward + recompute
    remove(model)
    assert block.forward is traced


def test_unknown_strategy_lists_valid_ones() -> None:
    model = build_model("gpt-tiny")
    with pytest.raises(StrategyError,
                       match=r"(?s)^remat.apply: unknown strategy 'fulll'.*every:N.*sqrt"):
        apply(model, "fulll")
    with pytest.raises(StrategyError, match="every:N with an integer N >= 1"):
        apply(model, "every:0")
    with pytest.raises(StrategyError, match="must be a string or a Plan"):
        apply(model, 3)


def test_plan_with_foreign_block_names_is_refused() -> None:
    model = build_model("gpt-tiny")
    with pytest.raises(StrategyError, match="plan names blocks this model does not have"):
        apply_decisions(model, {"layers.0": Full()})


def test_plan_like_object_is_applied() -> None:
    class FakePlan:
        decisions = {"blocks.0": SelectiveOps(frozenset({"aten.addmm"})),
                     "blocks.1": Mlp()}
        blocks = None

    model = build_model("gpt-tiny", n_layer=2)
    apply(model, FakePlan())
    assert applied(model).decisions == (  # type: ignore[union-attr]
        ("blocks.0", "ops[aten.addmm]"), ("blocks.1", "mlp"))
    assert validate(model, make_batch(model, 2), FakePlan()).passed


def test_no_blocks_error_says_how_to_pass_blocks() -> None:
    class TwoLayers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    model = TwoLayers()
    with pytest.raises(BlocksNotFound, match="blocks="):
        apply(model, "full")


def test_segment_refuses_hidden_state_transformed_between_blocks() -> None:
    class Rescaling(KwStack):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x, scale=torch.ones(1)) * 0.5
            return self.head(x).mean()

    model = apply(Rescaling(depth=4), "sqrt")
    with pytest.raises(RematError, match="did not receive the previous block's output"):
        model(torch.randn(2, 16))
    # the failed pass left no hooks behind: the model still trains without remat
    remove(model)
    model(torch.randn(2, 16)).backward()


@settings(max_examples=12, deadline=None)
@given(
    strategy=st.sampled_from(ALL),
    n_layer=st.integers(1, 6),
    batch_size=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_any_strategy_keeps_gradients(strategy: str, n_layer: int, batch_size: int,
                                      seed: int) -> None:
    torch.manual_seed(seed)
    model = build_model("llama-tiny", n_layer=n_layer, dropout=0.1)
    report = validate(model, make_batch(model, batch_size, seq_len=16, seed=seed), strategy)
    assert report.max_rel_error <= 1e-6, report


def test_sqrt_segments_never_cross_stacks() -> None:
    class EncoderDecoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.ModuleList(KwBlock(16) for _ in range(4))
            self.decoder = nn.ModuleList(KwBlock(16) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            memory = x
            for layer in self.encoder:
                memory = layer(memory, scale=torch.ones(1))
            y = x.flip(0)  # the decoder starts from another tensor
            for layer in self.decoder:
                y = layer(y, scale=torch.ones(1)) + memory
            return y.square().mean()

    torch.manual_seed(0)
    model = EncoderDecoder()
    apply(model, "sqrt")
    encoder_segments = {id(region_of(b).segment) for b in model.encoder}  # type: ignore[union-attr]
    decoder_segments = {id(region_of(b).segment) for b in model.decoder}  # type: ignore[union-attr]
    assert len(encoder_segments) == 2 and len(decoder_segments) == 2
    assert not encoder_segments & decoder_segments
    assert validate(model, torch.randn(3, 16), "full").passed


class _AttnLayer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x).tanh()
        return x + self.mlp(x)


class _ConvLayer(nn.Module):  # no attention: a Mamba-like mixing layer
    def __init__(self, d: int) -> None:
        super().__init__()
        self.conv = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.conv(x).sigmoid()
        return x + self.mlp(x)


class _Hybrid(nn.Module):
    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_a_sublayer_strategy_on_a_hybrid_stack_skips_the_blocks_without_it() -> None:
    torch.manual_seed(0)
    model = _Hybrid([_ConvLayer(16), _AttnLayer(16), _ConvLayer(16), _AttnLayer(16)])
    x = torch.randn(2, 8, 16)
    with pytest.warns(RematWarning, match=r"(?s)'attn' left 2 of 4 blocks alone.*"
                                          r"no attn sub-layer: layers\.0, layers\.2"):
        apply(model, "attn")
    info = applied(model)
    assert info is not None and dict(info.decisions) == {
        "layers.0": "none", "layers.1": "attn", "layers.2": "none", "layers.3": "attn"}
    assert region_of(model.layers[1].attn) is not None and region_of(model.layers[0]) is None
    remove(model)
    with pytest.warns(RematWarning, match="left 2 of 4 blocks alone"):
        report = validate(model, x, "attn", loss_fn=lambda out, batch: out)
    assert report.passed, report
    # mlp: every block has one, nothing skipped
    with warnings.catch_warnings():
        warnings.simplefilter("error", RematWarning)
        apply(model, "mlp")
    without = _Hybrid([_ConvLayer(16), _ConvLayer(16)])
    with pytest.raises(BlocksNotFound, match="attn"):
        apply(without, "attn")


@pytest.mark.parametrize("strategy", ["full", "sqrt", "attn"])
def test_a_retained_graph_backs_up_twice_as_without_checkpointing(strategy: str) -> None:
    # The recompute context is entered again by the second backward (it recomputes the
    # region again): it must be re-enterable, and the gradients add up as without remat.
    import remat
    from remat.models import build_model, make_batch

    torch.manual_seed(0)
    model = build_model("llama-tiny")
    batch = make_batch(model, 2)
    loss = model(**batch).loss
    loss.backward(retain_graph=True)
    loss.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    remat.apply(model, strategy)
    loss = model(**batch).loss
    loss.backward(retain_graph=True)
    loss.backward()
    for p, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, want, rtol=1e-6, atol=1e-7)
    remat.remove(model)
