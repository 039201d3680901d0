"""``attn`` / ``mlp`` on blocks that write attention and MLP as methods, not sub-modules
(NOTE [ Method sub-layers ] in remat/blocks.py, NOTE [ Method regions ] in regions.py)."""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.blocks import BlockMethod, block_methods, find_sublayer, sublayer_at
from remat.errors import BlocksNotFound, RematWarning, StrategyError
from remat.strategies import applied, apply, apply_decisions, remove
from remat.strategies.builtin import Full, NoCheckpoint, SelectiveOps
from remat.strategies.regions import has_region, method_regions, region_of
from tiny_nets import MethodLayer, MethodLM, MhaNet

X_SHAPE = (2, 16, 32)


def _grads(model: nn.Module, x: torch.Tensor, seed: int = 0
           ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(x)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def _assert_parity(model: nn.Module, x: torch.Tensor, strategy: str) -> None:
    remove(model)
    loss_ref, ref = _grads(model, x)
    apply(model, strategy)
    loss, got = _grads(model, x)
    remove(model)
    assert torch.equal(loss, loss_ref), (strategy, loss, loss_ref)
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-6, msg=name)


def _method_lm() -> MethodLM:
    torch.manual_seed(0)
    return MethodLM()


def test_the_matcher_finds_methods_by_name_and_keeps_modules_first() -> None:
    layer = MethodLayer()
    assert block_methods(layer) == ["_rotate", "_attention_forward", "_ffn_forward"]
    assert find_sublayer(layer, "attn") == ("_attention_forward",
                                             BlockMethod(layer, "_attention_forward"))
    assert find_sublayer(layer, "mlp") == ("_ffn_forward", BlockMethod(layer, "_ffn_forward"))

    class Spellings(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def helper(self) -> None: ...
        def forward_attn(self) -> None: ...
        def feed_forward(self) -> None: ...  # matches as written, not as "feed"

    odd = Spellings()
    assert find_sublayer(odd, "attn")[0] == "forward_attn"
    assert find_sublayer(odd, "mlp")[0] == "feed_forward"
    assert sublayer_at(odd, "helper") == BlockMethod(odd, "helper")
    assert sublayer_at(odd, "proj") is odd.proj and sublayer_at(odd, "forward") is None
    assert sublayer_at(odd, "missing.helper") is None
    odd.mlp = nn.Linear(4, 4)  # a module of the kind wins over the method
    assert find_sublayer(odd, "mlp") == ("mlp", odd.mlp)
    with pytest.raises(ValueError, match="defines no method 'forward'"):
        BlockMethod(odd, "forward")


@pytest.mark.parametrize("strategy", ["attn", "mlp"])
def test_method_sublayers_are_gradient_exact(strategy: str) -> None:
    model = _method_lm()
    _assert_parity(model, torch.randn(*X_SHAPE), strategy)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("strategy", ["attn", "mlp"])
def test_multihead_attention_child_is_checkpointed_gradient_exact(strategy: str,
                                                                  dropout: float) -> None:
    torch.manual_seed(0)
    model = MhaNet(dropout=dropout)
    name, sub = find_sublayer(model.layers[0], "attn")  # found by its class name
    assert name == "attention_layer" and isinstance(sub, nn.MultiheadAttention)
    _assert_parity(model, torch.randn(*X_SHAPE), strategy)
    apply(model, strategy)
    target = model.layers[0].attention_layer if strategy == "attn" else model.layers[0].mlp
    assert region_of(target) is not None and region_of(model.layers[0]) is None


def test_method_region_recomputes_and_drops_saved_bytes_like_a_module_region(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _method_lm()
    x = torch.randn(*X_SHAPE)
    as_modules = _ModuleLM(model)
    for strategy in ("attn", "mlp"):
        none = remat.profile(remove(model), x, timing=False).activation_bytes
        kept = remat.profile(apply(model, strategy), x, timing=False).activation_bytes
        same = remat.profile(apply(as_modules, strategy), x, timing=False).activation_bytes
        assert kept < none, (strategy, kept, none)
        # The method region keeps exactly what a module around the same code keeps.
        assert kept == same, (strategy, kept, same)
    calls: list[int] = []
    original = MethodLayer._ffn_forward

    def counted(self: MethodLayer, h: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return original(self, h)

    monkeypatch.setattr(MethodLayer, "_ffn_forward", counted)
    apply(model, "mlp")
    model(x).backward()
    assert len(calls) == 4  # 2 layers: forward and recompute each


def test_state_dict_copies_pickles_and_remove() -> None:
    model = _method_lm()
    x = torch.randn(*X_SHAPE)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reference = copy.deepcopy(model)
    apply(model, "attn")
    layer = model.layers[0]
    assert set(method_regions(layer)) == {"_attention_forward"} and has_region(layer)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    want = _grads(reference, x)[1]
    clone = copy.deepcopy(model)
    assert clone.layers[0]._attention_forward.__self__ is clone.layers[0]
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for copied in (clone, loaded, pickle.loads(pickle.dumps(model))):
        assert set(method_regions(copied.layers[1])) == {"_attention_forward"}
        got = _grads(copied, x)[1]
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
        kept = remat.profile(copied, x, timing=False).activation_bytes
        assert kept < remat.profile(reference, x, timing=False).activation_bytes
    apply(model, "mlp")  # re-apply replaces the attention region
    assert set(method_regions(layer)) == {"_ffn_forward"}
    assert "_attention_forward" not in layer.__dict__
    remove(model)
    assert not has_region(layer) and applied(model) is None
    leftover = [k for k in layer.__dict__ if k.startswith("_remat") or k.endswith("_forward")]
    assert leftover == []
    assert layer._ffn_forward.__func__ is MethodLayer._ffn_forward  # the class's own


def test_an_instance_attribute_the_method_had_is_kept() -> None:
    model = _method_lm()
    layer = model.layers[0]
    calls: list[int] = []
    own = layer._ffn_forward

    def traced(h: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return own(h)

    layer._ffn_forward = traced
    apply(model, "mlp")
    model(torch.randn(*X_SHAPE)).backward()
    assert len(calls) == 2  # forward and recompute run the instance's own
    remove(model)
    assert layer.__dict__["_ffn_forward"] is traced


def test_names_accepts_a_method_and_misses_list_children_and_methods() -> None:
    layer = MethodLayer()
    assert find_sublayer(layer, "attn", names=["_rotate"]) == ("_rotate",
                                                              BlockMethod(layer, "_rotate"))
    assert find_sublayer(layer, "mlp", names=["w1"]) == ("w1", layer.w1)  # modules first

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def _mix(self, x: torch.Tensor) -> torch.Tensor:
            return x

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(self._mix(x))

    with pytest.raises(BlocksNotFound, match=r"(?s)no attn sub-layer in Plain\n.*"
                                             r"children: proj \(Linear\)\n  methods: _mix\n"
                                             r".*names=.*method name"):
        find_sublayer(Plain(), "attn")
    stack = nn.Sequential(Plain(), Plain())
    with pytest.raises(BlocksNotFound, match="methods: _mix"):
        apply(stack, "mlp")


def test_plan_keys_resolve_to_methods_and_unknown_keys_are_refused() -> None:
    model = _method_lm()
    x = torch.randn(*X_SHAPE)
    decisions = {"layers.0._ffn_forward": Full(),
                 "layers.1._attention_forward": SelectiveOps(frozenset({"aten.bmm"}))}
    remove(model)
    loss_ref, ref = _grads(model, x)
    apply_decisions(model, decisions)
    assert applied(model).decisions == (  # type: ignore[union-attr]
        ("layers.0", "none"), ("layers.0._ffn_forward", "full"),
        ("layers.1", "none"), ("layers.1._attention_forward", "ops[aten.bmm]"))
    loss, got = _grads(model, x)
    assert torch.equal(loss, loss_ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-6, msg=name)
    with pytest.raises(StrategyError, match=r"(?s)does not have.*layers\.0\._nope"):
        apply_decisions(model, {"layers.0._nope": Full()})
    with pytest.raises(StrategyError, match="cannot be installed on a method"):
        apply_decisions(model, {"layers.0": Full(), "layers.1._ffn_forward": _ModuleOnly()})
    assert not any(has_region(m) for m in model.modules())  # nothing half-applied


def test_a_hybrid_stack_with_method_blocks_skips_the_blocks_without_them() -> None:
    torch.manual_seed(0)
    model = _Hybrid([MethodLayer(), _ConvLayer(), MethodLayer(), _ConvLayer()])
    x = torch.randn(*X_SHAPE)
    with pytest.warns(RematWarning, match=r"(?s)'attn' left 2 of 4 blocks alone.*"
                                          r"no attn sub-layer: layers\.1, layers\.3"):
        apply(model, "attn")
    assert set(method_regions(model.layers[0])) == {"_attention_forward"}
    assert not has_region(model.layers[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematWarning)
        _assert_parity(model, x, "attn")


def test_validate_warns_when_a_method_region_never_runs() -> None:
    model = _method_lm()
    x = torch.randn(*X_SHAPE)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RematWarning)
        assert remat.validate(model, x, "mlp").passed  # the regions ran: no warning
    model.layers = nn.ModuleList(_Bypass() for _ in range(2))
    with pytest.warns(RematWarning, match=r"(?s)installed 2 checkpointed region\(s\), but "
                                          r"none ran.*layers\.0\._ffn_forward"):
        remat.validate(model, x, "mlp")


# ---- models for the tests above -----------------------------------------------------------


class _Sub(nn.Module):
    """A module whose forward calls a function it holds (not a registered child)."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.__dict__["fn"] = fn

    def forward(self, *args: Any) -> torch.Tensor:
        return self.fn(*args)  # type: ignore[no-any-return]


class _ModuleLayer(nn.Module):
    """A :class:`MethodLayer` whose methods are called through ``attn`` / ``mlp`` modules."""

    def __init__(self, layer: MethodLayer) -> None:
        super().__init__()
        self.layer = layer
        self.attn = _Sub(layer._attention_forward)
        self.mlp = _Sub(layer._ffn_forward)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.layer.norm1(x), mask)
        return x + self.mlp(self.layer.norm2(x))


class _ModuleLM(MethodLM):
    def __init__(self, source: MethodLM) -> None:
        nn.Module.__init__(self)
        copied = copy.deepcopy(source)
        self.inp, self.head = copied.inp, copied.head
        self.layers = nn.ModuleList(_ModuleLayer(layer) for layer in copied.layers)


class _Bypass(MethodLayer):
    """Calls its methods through the class, so a region on the instance never runs."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + MethodLayer._attention_forward(self, self.norm1(x), mask)
        return x + MethodLayer._ffn_forward(self, self.norm2(x))


class _ConvLayer(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, 3, padding=1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x.transpose(1, 2)).transpose(1, 2)


class _Hybrid(MethodLM):
    def __init__(self, layers: list[nn.Module]) -> None:
        nn.Module.__init__(self)
        self.inp, self.head = nn.Linear(32, 32), nn.Linear(32, 8)
        self.layers = nn.ModuleList(layers)


class _ModuleOnly(NoCheckpoint):
    """A block-level strategy that does not install on methods (the default)."""

    def label(self) -> str:
        return "module-only"


class _TorchStack(nn.Module):
    """PyTorch's own encoder or decoder stack: MLP written as ``_ff_block``, attention as
    the ``self_attn`` module (and ``_sa_block`` / ``_mha_block`` methods)."""

    def __init__(self, decoder: bool) -> None:
        super().__init__()
        self.decoder = decoder
        if decoder:
            self.stack: nn.Module = nn.TransformerDecoder(
                nn.TransformerDecoderLayer(32, 4, 64, dropout=0.1, batch_first=True), 2)
        else:
            self.stack = nn.TransformerEncoder(
                nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True,
                                           norm_first=True), 2, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.stack(x, x) if self.decoder else self.stack(x)
        return out.square().mean()


@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
def test_torch_transformer_layers_find_their_ff_block_and_are_gradient_exact(
        decoder: bool) -> None:
    """Rule 2 strips a ``_block`` suffix: ``nn.TransformerEncoderLayer._ff_block`` is the
    MLP sub-layer (``mlp`` raised BlocksNotFound on PyTorch's own layers before)."""
    torch.manual_seed(0)
    model = _TorchStack(decoder).train()
    layer = model.stack.layers[0]
    name, found = find_sublayer(layer, "mlp")
    assert name == "_ff_block" and isinstance(found, BlockMethod)
    assert find_sublayer(layer, "attn")[0] == "self_attn"  # a module beats a method
    x = torch.randn(*X_SHAPE)
    for strategy in ("mlp", "attn", "ops"):
        report = remat.validate(model, x, strategy)
        assert report.passed, (strategy, report.max_rel_error)
    apply(model, "mlp")
    assert len(method_regions(layer)) == 1
