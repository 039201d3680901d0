"""Op-level save sets: by op name and by single op call (``"aten.mm#2"``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import remat
from remat.blocks import NamedBlocks
from remat.models import build_model, make_batch
from remat.strategies import apply_decisions, remove
from remat.strategies.builtin import SelectiveOps
from remat.strategies.dead_ops import supported
from remat.strategies.sac import SavePolicy, call_entry, parse_entry, sac_context_fn


@given(name=st.from_regex(r"aten\.[a-z_]{1,12}", fullmatch=True),
       index=st.integers(min_value=0, max_value=10_000))
def test_call_entries_round_trip(name: str, index: int) -> None:
    assert parse_entry(call_entry(name, index)) == (name, index)
    assert parse_entry(name) == (name, None)


@pytest.mark.parametrize("entry", ["", "#1", "aten.mm#", "aten.mm#x", "aten.mm#-1"])
def test_bad_entries_are_refused_with_the_form_expected(entry: str) -> None:
    with pytest.raises(ValueError, match="aten.mm#2"):
        parse_entry(entry)
    with pytest.raises(ValueError, match="SelectiveOps"):
        SelectiveOps(frozenset({entry}))


def _mlp_step(model: torch.nn.Module, batch: dict[str, torch.Tensor],
              save_ops: frozenset[str] | None) -> tuple[int, list[torch.Tensor]]:
    """Activation bytes of a step and the gradients, with every MLP under ``save_ops``."""
    remove(model)
    if save_ops is not None:
        names = tuple(f"blocks.{i}.mlp" for i in range(len(model.blocks)))
        apply_decisions(model, {n: SelectiveOps(save_ops) for n in names},
                        blocks=NamedBlocks(names))
    prof = remat.profile(model, batch, timing=False)
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    remove(model)
    return prof.activation_bytes, grads


def test_a_single_call_keeps_exactly_that_output_and_gradients_are_unchanged() -> None:
    torch.manual_seed(0)
    model = build_model("llama-tiny")
    batch = make_batch(model, 2)
    tokens = batch["input_ids"].numel()
    mlp = model.blocks[0].mlp
    per_call_bytes = {  # SwiGLU runs gate, up, down in that order: aten.mm calls 0, 1, 2
        0: tokens * mlp.gate_proj.out_features * 4,
        1: tokens * mlp.up_proj.out_features * 4,
        2: tokens * mlp.down_proj.out_features * 4,
    }
    blocks = len(model.blocks)
    _, reference = _mlp_step(model, batch, None)
    nothing, _ = _mlp_step(model, batch, frozenset())
    for index, nbytes in per_call_bytes.items():
        kept, grads = _mlp_step(model, batch, frozenset({f"aten.mm#{index}"}))
        assert kept - nothing == blocks * nbytes, index
        for got, want in zip(grads, reference, strict=True):
            assert torch.equal(got, want)
    # Every call named one by one keeps what the op name keeps.
    by_calls, _ = _mlp_step(model, batch, frozenset(f"aten.mm#{i}" for i in range(3)))
    by_name, _ = _mlp_step(model, batch, frozenset({"aten.mm"}))
    assert by_calls == by_name


def test_call_counts_start_afresh_on_every_checkpointed_call() -> None:
    model = build_model("llama-tiny")
    batch = make_batch(model, 2)
    first, _ = _mlp_step(model, batch, frozenset({"aten.mm#2"}))
    second, _ = _mlp_step(model, batch, frozenset({"aten.mm#2"}))
    assert first == second


def test_policy_counts_forward_and_recompute_separately() -> None:
    class Ctx:
        def __init__(self, is_recompute: bool) -> None:
            self.is_recompute = is_recompute

    policy = SavePolicy({"aten.mm#1", "aten.addmm"})
    mm, addmm = torch.ops.aten.mm.default, torch.ops.aten.addmm.default
    forward = [policy(Ctx(False), mm).name for _ in range(3)]
    recompute = [policy(Ctx(True), mm).name for _ in range(3)]
    assert forward == recompute == ["PREFER_RECOMPUTE", "MUST_SAVE", "PREFER_RECOMPUTE"]
    assert policy(Ctx(False), addmm).name == "MUST_SAVE"


@settings(max_examples=12, deadline=None)
@given(calls=st.sets(st.integers(min_value=0, max_value=6), max_size=7),
       names=st.sets(st.sampled_from(["aten.mul", "aten.silu", "aten.rsqrt", "aten.add"]),
                     max_size=2))
def test_any_save_set_leaves_gradients_unchanged(calls: set[int], names: set[str]) -> None:
    torch.manual_seed(0)
    model = build_model("llama-tiny")
    batch = make_batch(model, 2)
    torch.manual_seed(1)  # same dropout masks in both runs
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    reference = [p.grad.clone() for p in model.parameters()]
    save = frozenset({call_entry("aten.mm", i) for i in calls} | names)
    blocks = tuple(f"blocks.{i}" for i in range(len(model.blocks)))
    apply_decisions(model, {b: SelectiveOps(save) for b in blocks},
                    blocks=NamedBlocks(blocks))
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    remove(model)
    for got, want in zip((p.grad for p in model.parameters()), reference, strict=True):
        assert got is not None
        assert torch.equal(got, want)


@pytest.mark.skipif(supported(), reason="this PyTorch's SAC supports dead-op skipping "
                    "(storage by call index, torch.utils.checkpoint._RECOMPUTE)")
def test_without_storage_by_call_index_regions_fall_back_to_stock_sac() -> None:
    # remat.strategies.dead_ops.supported() is False (torch <= 2.12): skipping stays on by
    # default, yet every region gets SAC's own contexts and no ledger, and recomputes all.
    fn = sac_context_fn({"aten.tanh", "aten.addmm"})
    forward_ctx, recompute_ctx = fn()
    assert type(forward_ctx).__name__ == "_CachingTorchDispatchMode"
    assert type(recompute_ctx).__name__ == "_CachedTorchDispatchMode"
    assert fn.last_policy.ledger is None  # type: ignore[attr-defined]
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.1)
    batch = make_batch(model, 2)
    torch.manual_seed(1)
    model(**batch).loss.backward()
    reference = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    remat.apply(model, "ops")
    torch.manual_seed(1)
    model(**batch).loss.backward()
    remove(model)
    got = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(got) == len(reference)
    for g, want in zip(got, reference, strict=True):
        assert torch.equal(g, want)


def test_no_cached_output_outlives_the_recompute() -> None:
    # NOTE [ Cached outputs no recompute reads ] in sac.py: the saved ops a recompute that
    # stops early never reaches stayed cached until the next forward, alive through the
    # optimizer step (one hidden state per block) and at the backward peak.
    from remat.core.cost import Category

    torch.manual_seed(0)
    model = build_model("llama-tiny")
    batch = make_batch(model, 2)
    opt = torch.optim.AdamW(model.parameters())
    optimizer_activations = {}
    for strategy in ("none", "ops"):
        remat.apply(model, strategy)
        prof = remat.profile(model, batch, optimizer=opt, timing=False)
        remat.remove(model)
        phase = prof.phase_peaks["optimizer"]
        optimizer_activations[strategy] = phase.breakdown.get(Category.ACTIVATIONS, 0)
    assert optimizer_activations["ops"] == optimizer_activations["none"]


def test_a_second_backward_through_a_region_is_refused_as_sac_refuses_it() -> None:
    # The recompute context is re-entered by a second backward (regions.py,
    # _RecomputeContext): SAC's own error, not a context-manager error. The cache's
    # unread entries, marked consumed when the first recompute ended (NOTE [ Cached
    # outputs no recompute reads ] in sac.py), keep it so.
    torch.manual_seed(0)
    model = build_model("llama-tiny")
    batch = make_batch(model, 2)
    remat.apply(model, "ops")
    loss = model(**batch).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward an extra time"):
        loss.backward()
    remat.remove(model)
