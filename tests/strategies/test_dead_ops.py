"""SAC recompute that skips dead ops (NOTE [ Dead ops in recompute ])."""

from __future__ import annotations

import gc
import math
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from remat.blocks import NamedBlocks
from remat.models import build_model, make_batch
from remat.recompute import is_recomputing
from remat.strategies import apply_decisions, remove
from remat.strategies.builtin import SelectiveOps
from remat.strategies.dead_ops import dead_op_contexts, skipping_dead_ops, supported
from remat.strategies.regions import install_checkpoint, region_of, uninstall
from remat.strategies.sac import SavePolicy, call_entry, sac_context_fn

pytestmark = pytest.mark.skipif(not supported(), reason="SAC without storage by call index")


class RecomputedOps(TorchDispatchMode):
    """The aten ops that run while remat recomputes (below SAC's modes)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if is_recomputing():
            self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))

    def computed(self) -> list[str]:
        """Ops that computed something (placeholders and detaches left out)."""
        return [op for op in self.ops if op not in ("aten.empty_strided", "aten.detach")]


def gelu_new(x: Tensor) -> Tensor:
    """Hugging Face's ``NewGELUActivation`` (GPT-2, Phi)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3.0))))


class Mlp(nn.Module):
    def __init__(self, act: Callable[[Tensor], Tensor] = gelu_new, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)
        self.act, self.drop = act, nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(self.act(self.drop(self.fc1(x)))))


def _grads(module: nn.Module, x: Tensor, *, seed: int = 0) -> tuple[Tensor, list[Tensor]]:
    torch.manual_seed(seed)
    loss = module(x).square().sum()
    grads = torch.autograd.grad(loss, [x, *module.parameters()])
    return loss.detach(), list(grads)


def _run(module: nn.Module, x: Tensor, save: set[str], skip: bool,
         seed: int = 0) -> tuple[tuple[Tensor, list[Tensor]], RecomputedOps, int]:
    """Loss and grads, the recomputed ops, and how many op calls were skipped."""
    install_checkpoint(module, label="ops", save_ops=frozenset(save))
    try:
        with skipping_dead_ops(skip), RecomputedOps() as ops:
            result = _grads(module, x, seed=seed)
        info = region_of(module)
        assert info is not None
        ledger = info.sac_contexts.last_policy.ledger  # type: ignore[union-attr]
        return result, ops, 0 if ledger is None else ledger.skipped
    finally:
        uninstall(module)


def _assert_same(got: tuple[Tensor, list[Tensor]], want: tuple[Tensor, list[Tensor]]) -> None:
    assert torch.equal(got[0], want[0])
    for g, w in zip(got[1], want[1], strict=True):
        assert torch.equal(g, w)


def _on_and_off(module: nn.Module, x: Tensor, save: set[str], seed: int = 0
                ) -> tuple[RecomputedOps, RecomputedOps, int]:
    """Recompute with skipping on and off, both with the un-checkpointed gradients:
    the ops each ran and how many calls skipping skipped."""
    reference = _grads(module, x, seed=seed)
    on, ops_on, skipped = _run(module, x, save, skip=True, seed=seed)
    off, ops_off, _ = _run(module, x, save, skip=False, seed=seed)
    _assert_same(on, reference)
    _assert_same(off, reference)
    return ops_on, ops_off, skipped


def test_gelu_new_chain_before_a_cached_tanh_is_not_recomputed() -> None:
    torch.manual_seed(0)
    mlp, x = Mlp(), torch.randn(4, 8, requires_grad=True)
    ops_on, ops_off, skipped = _on_and_off(mlp, x, {"aten.tanh", "aten.addmm"})
    # pow, mul (0.044715 x^3), add, mul (c * ...) feed only the cached tanh.
    assert skipped == 4
    assert ops_off.computed().count("aten.pow") == 1
    assert "aten.pow" not in ops_on.computed()
    assert len(ops_on.computed()) == len(ops_off.computed()) - 4


@pytest.mark.parametrize(("cached", "dead"), [
    ("aten.tanh", True), ("aten.sigmoid", True), ("aten.exp", True),  # save their result
    ("aten.sin", False), ("aten.cos", False),  # save their input: the chain is packed
])
def test_a_chain_is_skipped_only_when_the_cached_op_does_not_save_its_input(
        cached: str, dead: bool) -> None:
    fn = getattr(torch, cached.removeprefix("aten."))
    torch.manual_seed(0)
    mlp, x = Mlp(act=lambda h: fn(h.pow(2) * 0.5 + 1.0) * h), torch.randn(4, 8, requires_grad=True)
    reference = _grads(mlp, x)
    on, ops_on, skipped = _run(mlp, x, {cached}, skip=True)
    _assert_same(on, reference)
    assert ("aten.pow" not in ops_on.computed()) == dead
    assert (skipped == 3) == dead


def test_an_output_a_cached_op_saves_for_backward_is_recomputed() -> None:
    # mm's backward saves both inputs: the scaled input of the cached mm must be
    # recomputed, though only a cached op reads it.
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x: Tensor) -> Tensor:
            return torch.tanh((x * 3.0 + 1.0) @ self.w)

    torch.manual_seed(0)
    module, x = Scaled(), torch.randn(4, 8, requires_grad=True)
    reference = _grads(module, x)
    on, ops_on, skipped = _run(module, x, {"aten.mm"}, skip=True)
    _assert_same(on, reference)
    assert skipped == 0
    assert {"aten.mul", "aten.add"} <= set(ops_on.computed())


class Tail(nn.Module):
    """``fc1(x) * 2`` is read only by the residual-like add after the region's last pack
    (the sigmoid saves its output): an MoE's weighted expert sum before its block's add."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        tail = self.fc1(x) * 2.0
        return tail + torch.sigmoid(self.fc2(x))


@pytest.mark.parametrize("early_stop", [True, False])
def test_calls_read_only_after_the_last_pack_are_not_recomputed(early_stop: bool) -> None:
    # NOTE [ Dead ops in recompute ], item 6: early stop ends the recompute at the
    # sigmoid's pack, so the add never runs and fc1 * 2 is dead; without early stop the
    # add runs and needs it.
    torch.manual_seed(0)
    module, x = Tail(), torch.randn(4, 8, requires_grad=True)
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        ops_on, ops_off, skipped = _on_and_off(module, x, set())
    def kernels(ops: RecomputedOps) -> list[str]:
        return [op for op in ops.computed() if op != "aten.t"]  # the weights' views

    assert kernels(ops_off) == ["aten.addmm", "aten.mul", "aten.addmm", "aten.sigmoid"] + (
        [] if early_stop else ["aten.add"])
    assert kernels(ops_on) == (["aten.addmm", "aten.sigmoid"] if early_stop
                               else kernels(ops_off))
    assert skipped == (2 if early_stop else 0)


class Waiting(Tensor):
    """A wrapper whose own dispatch does work beyond the op's math, as sequence
    parallelism's ``AsyncCollectiveTensor`` waits on its collective: it counts the ops
    that read it and hands back plain tensors."""

    reads = 0

    @staticmethod
    def __new__(cls, elem: Tensor) -> Waiting:
        return Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, elem.size(), strides=elem.stride(), dtype=elem.dtype, device=elem.device)

    def __init__(self, elem: Tensor) -> None:
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        Waiting.reads += 1
        def unwrap(t: Any) -> Any:
            return t.elem if isinstance(t, Waiting) else t
        return func(*[unwrap(a) for a in args],
                    **{k: unwrap(v) for k, v in (kwargs or {}).items()})


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return Waiting(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


class WaitingTail(Tail):
    """:class:`Tail` with ``fc1``'s output wrapped: the mul that reads it is read only
    after the last pack, but its dispatch must still run in the recompute."""

    def forward(self, x: Tensor) -> Tensor:
        tail = _Wait.apply(self.fc1(x)) * 2.0
        return tail + torch.sigmoid(self.fc2(x))


def test_an_op_reading_a_tensor_with_its_own_dispatch_is_never_skipped() -> None:
    # NOTE [ Dead ops in recompute ], item 3: skipping the mul would skip the wrapper's
    # dispatch (an AsyncCollectiveTensor's wait under sequence parallelism).
    torch.manual_seed(0)
    module, x = WaitingTail(), torch.randn(4, 8, requires_grad=True)
    Waiting.reads = 0
    _grads(module, x)
    assert Waiting.reads == 1  # the forward's mul
    Waiting.reads = 0
    _, ops_on, _ = _run(module, x, set(), skip=True)
    assert Waiting.reads == 2  # the forward's mul and the recompute's
    assert "aten.mul" in ops_on.computed()


class Heads(nn.Module):
    """A projection viewed into heads, then ``act``; the shape Llama's attention has."""

    def __init__(self, act: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.q, self.act = nn.Linear(8, 8, bias=False), act

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.q(x).view(4, 2, 4).transpose(0, 1)).sum(0)


def _rotary(q: Tensor) -> Tensor:  # halves by slicing (Hugging Face Llama)
    return (q * 2.0 + torch.cat((-q[..., 2:], q[..., :2]), dim=-1)).square()


def _rotary_split(q: Tensor) -> Tensor:  # halves by split: a view returning a list
    first, second = q.split(2, dim=-1)
    return (q * 2.0 + torch.cat((-second, first), dim=-1)).square()


@pytest.mark.parametrize("rotary", [_rotary, _rotary_split], ids=["slice", "split"])
def test_a_projection_whose_views_feed_only_dead_ops_is_skipped(
        rotary: Callable[[Tensor], Tensor]) -> None:
    # With the rotary add cached, the mul, neg and cat before it are dead, and the
    # views of the projection run on a placeholder: the matmul is dead too (item 5).
    torch.manual_seed(0)
    module, x = Heads(rotary), torch.randn(4, 8, requires_grad=True)
    ops_on, ops_off, skipped = _on_and_off(module, x, {"aten.add"})
    assert skipped == 4
    assert "aten.mm" in ops_off.computed() and "aten.mm" not in ops_on.computed()


def test_a_view_autograd_saves_keeps_its_base_live() -> None:
    # sin saves its input, a view of the projection: the matmul must run again.
    torch.manual_seed(0)
    module, x = Heads(torch.sin), torch.randn(4, 8, requires_grad=True)
    reference = _grads(module, x)
    on, ops_on, skipped = _run(module, x, {"aten.sin"}, skip=True)
    _assert_same(on, reference)
    assert skipped == 0 and "aten.mm" in ops_on.computed()


def test_random_ops_in_a_dead_chain_still_run_so_later_masks_match() -> None:
    torch.manual_seed(0)
    mlp = Mlp(act=lambda h: torch.tanh(nn.functional.dropout(h, 0.3) * 2.0) * h, dropout=0.2)
    x = torch.randn(4, 8, requires_grad=True)
    ops_on, ops_off, skipped = _on_and_off(mlp, x, {"aten.tanh"}, seed=7)
    # On CPU dropout is empty_like, bernoulli_, div_, mul: the mask is drawn again,
    # the mul applying it and the `* 2.0` after it are skipped.
    assert skipped == 2
    assert ops_on.computed().count("aten.bernoulli_") == ops_off.computed().count(
        "aten.bernoulli_") > 0


def test_an_in_place_op_after_a_cached_op_keeps_its_inputs_live() -> None:
    # The add is cached, then mutated: SAC recomputes it (NOTE [ Saved outputs
    # mutated in place ]), so the chain feeding it must run too.
    def act(h: Tensor) -> Tensor:
        c = h.pow(3) * 0.5 + 1.0
        c.mul_(2.0)
        return c * h

    torch.manual_seed(0)
    mlp, x = Mlp(act=act), torch.randn(4, 8, requires_grad=True)
    ops_on, ops_off, skipped = _on_and_off(mlp, x, {"aten.add"})
    assert skipped == 0
    assert ops_on.computed() == ops_off.computed()


def test_a_saved_tensors_hook_inside_the_region_turns_skipping_off() -> None:
    class Offloaded(Mlp):
        def forward(self, x: Tensor) -> Tensor:
            with torch.autograd.graph.save_on_cpu():
                return super().forward(x)

    torch.manual_seed(0)
    mlp, x = Offloaded(), torch.randn(4, 8, requires_grad=True)
    reference = _grads(mlp, x)
    on, _, skipped = _run(mlp, x, {"aten.tanh", "aten.addmm"}, skip=True)
    _assert_same(on, reference)
    assert skipped == 0


def test_fake_tensors_get_fake_placeholders() -> None:
    torch.manual_seed(0)
    with FakeTensorMode():
        mlp, x = Mlp(), torch.randn(4, 8, requires_grad=True)
        (loss, grads), ops, skipped = _run(mlp, x, {"aten.tanh", "aten.addmm"}, skip=True)
    assert skipped == 4
    assert [g.shape for g in grads] == [x.shape] + [p.shape for p in mlp.parameters()]
    assert "aten.pow" not in ops.computed()


def test_compiled_regions_get_stock_sac_contexts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    forward_ctx, recompute_ctx = sac_context_fn({"aten.mm"})()
    assert type(forward_ctx).__name__ == "_CachingTorchDispatchMode"
    assert type(recompute_ctx).__name__ == "_CachedTorchDispatchMode"


def _model_grads(model: nn.Module, batch: dict[str, Tensor], save: frozenset[str] | None,
                 skip: bool) -> tuple[list[Tensor], list[str]]:
    blocks = tuple(f"blocks.{i}" for i in range(len(model.blocks)))  # type: ignore[arg-type]
    if save is not None:
        apply_decisions(model, {b: SelectiveOps(save) for b in blocks},
                        blocks=NamedBlocks(blocks))
    torch.manual_seed(1)  # same dropout masks in every run
    model.zero_grad(set_to_none=True)
    with skipping_dead_ops(skip), RecomputedOps() as ops:
        model(**batch).loss.backward()
    remove(model)
    return [p.grad.clone() for p in model.parameters() if p.grad is not None], ops.computed()


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
def test_built_in_models_with_dropout_get_exact_gradients_and_recompute_less(preset: str) -> None:
    torch.manual_seed(0)
    model = build_model(preset, dropout=0.1)
    batch = make_batch(model, 2)
    reference, _ = _model_grads(model, batch, None, skip=True)
    save = frozenset({"aten.native_layer_norm", "aten.addmm#1", "aten.mul#3"}
                     if preset == "gpt-tiny" else {"aten.rsqrt", "aten.mm#1", "aten.mul#3"})
    on, ops_on = _model_grads(model, batch, save, skip=True)
    off, ops_off = _model_grads(model, batch, save, skip=False)
    for got_on, got_off, want in zip(on, off, reference, strict=True):
        assert torch.equal(got_on, want)
        assert torch.equal(got_off, want)
    assert len(ops_on) <= len(ops_off)
    if preset == "llama-tiny":  # RMSNorm's pow and mean feed only the cached rsqrt
        assert ops_on.count("aten.pow") < ops_off.count("aten.pow")


@settings(max_examples=10, deadline=None)
@given(calls=st.sets(st.integers(min_value=0, max_value=6), max_size=4),
       names=st.sets(st.sampled_from(["aten.mul", "aten.tanh", "aten.add", "aten.pow",
                                      "aten.addmm", "aten.rsqrt", "aten.mean"]), max_size=3))
def test_any_save_set_gives_the_same_gradients_with_skipping_on_and_off(
        calls: set[int], names: set[str]) -> None:
    save = {call_entry("aten.mul", i) for i in calls} | names

    def act(h: Tensor) -> Tensor:  # gelu_new on heads (views), then an RMSNorm
        g = gelu_new(h.view(4, 4, 8).transpose(1, 2)).transpose(1, 2).reshape(4, 32)
        return g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-6)

    torch.manual_seed(0)
    mlp, x = Mlp(act=act, dropout=0.1), torch.randn(4, 8, requires_grad=True)
    ops_on, ops_off, _ = _on_and_off(mlp, x, save)
    assert len(ops_on.computed()) <= len(ops_off.computed())


def test_cached_outputs_recompute_never_reaches_die_without_gc() -> None:
    # The region's last op is cached, but recompute stops at tanh's (last) pack, so its
    # entry is never handed back: only dropping SAC's storage frees it (the planner
    # measures with gc held; a ledger <-> pack-hook cycle once kept it alive).
    linear, x = nn.Linear(8, 8), torch.randn(4, 8, requires_grad=True)
    policy = SavePolicy({"aten.addmm", "aten.mul"})
    forward_ctx, recompute_ctx, ledger = dead_op_contexts(policy)
    gc.disable()
    try:
        out = checkpoint(lambda t: torch.tanh(linear(t)) * 2.0, x, use_reentrant=False,
                         context_fn=lambda c=(forward_ctx, recompute_ctx): c)
        cached = [weakref.ref(entry.val) for entries in forward_ctx.storage.values()
                  for entry in entries.values() if isinstance(getattr(entry, "val", None), Tensor)]
        assert len(cached) == 2
        out.sum().backward()
        del out, forward_ctx, recompute_ctx, ledger, policy
        assert [ref() is None for ref in cached] == [True, True]
    finally:
        gc.enable()


def test_regions_without_dead_ops_drop_the_bookkeeping_after_their_first_recompute() -> None:
    # NOTE [ Skipping only where it pays ] in sac.py.
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    for save, skips in (({"aten.tanh", "aten.addmm"}, True), ({"aten.addmm"}, False)):
        mlp = Mlp()
        reference = _grads(mlp, x)
        install_checkpoint(mlp, label="ops", save_ops=frozenset(save))
        try:
            info = region_of(mlp)
            assert info is not None
            context_fn: Any = info.sac_contexts
            assert context_fn.skips is None
            for step in range(3):
                _assert_same(_grads(mlp, x), reference)
                # Learned at the forward after the first recompute.
                assert context_fn.skips is (None if step == 0 else skips)
                ledger = context_fn.last_policy.ledger
                assert (ledger is not None) is (step == 0 or skips)
                if step == 0 or skips:
                    assert ledger.skipped == (4 if skips else 0)
        finally:
            uninstall(mlp)



@pytest.mark.parametrize("backward_inside", [True, False])
def test_under_autocast_a_region_recomputes_every_op_and_its_gradients_match(
        backward_inside: bool) -> None:
    """Item 4 of NOTE [ Dead ops in recompute ]: autocast's cast cache makes the recompute
    dispatch another number of weight casts than the forward (the backward inside the
    autocast region finds them cached), so skipping is off there; the gradients are the
    un-checkpointed model's under the same autocast. With skipping on, the backward inside
    autocast failed on a view of a placeholder (gpt-tiny, ``ops``)."""
    model = build_model("gpt-tiny", n_layer=1)
    batch = make_batch(model, 2)

    def step(module: nn.Module) -> list[Tensor]:
        module.zero_grad(set_to_none=True)
        torch.manual_seed(0)  # the same dropout masks
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = module(**batch).loss
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        return [p.grad.clone() for p in module.parameters()]  # type: ignore[union-attr]

    reference = step(model)
    block = model.blocks[0]
    install_checkpoint(block, label="ops", save_ops=frozenset({"aten.addmm"}))
    try:
        got = step(model)
    finally:
        uninstall(block)
    for g, w in zip(got, reference, strict=True):
        assert torch.equal(g, w)


def test_a_chain_skipped_without_autocast_is_recomputed_under_it() -> None:
    torch.manual_seed(0)
    mlp, x = Mlp(), torch.randn(4, 8, requires_grad=True)
    _, _, skipped = _on_and_off(mlp, x, {"aten.tanh", "aten.addmm"})
    assert skipped == 4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = _grads(mlp, x)
        on, _, skipped = _run(mlp, x, {"aten.tanh", "aten.addmm"}, skip=True)
    assert skipped == 0
    _assert_same(on, reference)
