"""The shape guard an applied plan checks batches with (NOTE [ Shape guard ])."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import remat
from measure.hf_tiny import build_hf
from remat.core.cost import StepCost
from remat.errors import RematError, RematWarning, ShapeOutsidePlan, StrategyError
from remat.measure.shapes import batch_envelope
from remat.planning import Plan
from remat.strategies import apply, preserved_strategy, remove
from remat.strategies.builtin import Full
from remat.strategies.guard import shape_guard
from tiny_nets import Block, net

SEQ = 16


@pytest.fixture(scope="module")
def llama() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, batch = build_hf("llama", batch_size=2, seq=SEQ)
    positions = torch.arange(SEQ).expand(2, SEQ)
    return model, {**batch, "attention_mask": torch.ones_like(batch["input_ids"]),
                   "position_ids": positions}


def plan_for(model: nn.Module, *batches: Any, on_new_shape: str = "error") -> Plan:
    """A plan checkpointing the first layer, made for ``batches``' shapes."""
    names = ("model.layers.0", "model.layers.1")
    return Plan(decisions={names[0]: Full()}, block_names=names, budget_bytes=1 << 20,
                cost=StepCost(peak_bytes=1), shape_envelope=batch_envelope(model, *batches),
                on_new_shape=on_new_shape)


def longer(batch: dict[str, torch.Tensor], seq: int) -> dict[str, torch.Tensor]:
    return {k: v.repeat(1, -(-seq // SEQ))[:, :seq] for k, v in batch.items()}


def test_a_batch_outside_the_plan_raises_before_any_block_runs(llama: Any) -> None:
    model, batch = llama
    apply(model, plan_for(model, batch))
    calls: list[int] = []
    handle = model.model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(ShapeOutsidePlan) as info:
            model(**longer(batch, 2 * SEQ))
        assert calls == []  # nothing ran, nothing allocated for activations
        lines = str(info.value).splitlines()
        assert lines[0] == ("LlamaForCausalLM.forward with a remat plan: a batch outside the "
                            "shapes the applied plan was made for")
        assert lines[1] == ("  batch's shapes: attention_mask (2, 32), input_ids (2, 32), "
                            "labels (2, 32), position_ids (2, 32)")
        assert "  outside: attention_mask (2, 32) > (2, 16); input_ids (2, 32) > (2, 16);" \
            in lines[2]
        assert lines[3].startswith("  plan's shapes: attention_mask (2, 16), input_ids (2, 16)")
        fix = lines[-1]
        assert fix.startswith("  fix: plan for the largest shape") and \
            "remat.plan_seq_len" in fix and 'on_new_shape="warn"' in fix and '"replan"' in fix
        assert isinstance(info.value, RematError) and isinstance(info.value, ValueError)
        assert info.value.shapes["input_ids"] == (2, 32)
        with pytest.raises(ShapeOutsidePlan, match="input_ids"):  # positionally, the same
            model(longer(batch, 2 * SEQ)["input_ids"])
        bare = {k: batch[k] for k in ("input_ids", "labels")}
        apply(model, plan_for(model, bare))  # an input the plan never saw: named, and why
        with pytest.raises(ShapeOutsidePlan) as info:
            model(**batch)
        assert "attention_mask (2, 16): not an input of the plan's batch" in str(info.value)
        assert "fix: plan with a batch that has every input the loader yields" in str(info.value)
    finally:
        handle.remove()
        remove(model)


def test_packed_padded_and_smaller_batches_pass(llama: Any) -> None:
    model, batch = llama
    apply(model, plan_for(model, batch))
    packed = {**batch, "position_ids": torch.cat([torch.arange(10), torch.arange(6)]).expand(
        2, SEQ)}  # two documents in each row: positions restart
    padded = {**batch, "attention_mask": torch.cat(
        [torch.ones(2, 11, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long)], 1)}
    shorter = {k: v[:1, :9] for k, v in batch.items()}
    try:
        for each in (batch, packed, padded, shorter):
            model(**each).loss.backward()
        model.zero_grad(set_to_none=True)
        # not a training forward: evaluation keeps no activations, any shape passes
        with torch.no_grad():
            model(**longer(batch, 2 * SEQ))
        model.eval()
        model(**longer(batch, 2 * SEQ))
    finally:
        model.train()
        remove(model)


def test_warn_warns_once_per_bucket_and_runs(llama: Any) -> None:
    model, batch = llama
    apply(model, plan_for(model, batch), on_new_shape="warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for seq in (20, 30, 32, 40):  # buckets 32, 32, 32, 64
                model(**longer(batch, seq)).loss.backward()
        found = [str(w.message) for w in caught if issubclass(w.category, RematWarning)]
        assert len(found) == 2 and "(on_new_shape='warn'" in found[0]
        assert "input_ids (2, 20) > (2, 16)" in found[0]
    finally:
        model.zero_grad(set_to_none=True)
        remove(model)


def test_the_guard_comes_and_goes_with_the_plan(llama: Any) -> None:
    model, batch = llama
    keys = list(model.state_dict())
    plan = Plan.from_json(plan_for(model, batch).to_json())
    assert plan.shape_envelope is not None and plan.on_new_shape == "error"
    apply(model, plan)
    guard = shape_guard(model)
    assert guard is not None and list(model.state_dict()) == keys
    with preserved_strategy(model):
        apply(model, "full")  # a trial: the guard is off, then back
        assert shape_guard(model) is None
        model(**longer(batch, 2 * SEQ))
    assert shape_guard(model) is guard
    remat.validate(model, longer(batch, 2 * SEQ), plan)  # validation runs any shape
    assert shape_guard(model) is guard
    # a measurement, not training: the plan measured at a shape outside its envelope
    assert remat.profile(model, longer(batch, 2 * SEQ), timing=False).peak_bytes > 0
    assert shape_guard(model) is guard
    with pytest.raises(ShapeOutsidePlan):  # and training is checked again after it
        model(**longer(batch, 2 * SEQ))
    assert shape_guard(copy.deepcopy(model)) is not None
    apply(model, plan, on_new_shape="off")
    assert shape_guard(model) is None
    apply(model, plan)
    remove(model)
    assert shape_guard(model) is None and not model._forward_pre_hooks
    with pytest.raises(StrategyError, match="on_new_shape='replan' needs a plan"):
        apply(model, "full", on_new_shape="replan")
    with pytest.raises(ValueError, match="unknown on_new_shape"):
        apply(model, plan, on_new_shape="ignore")
    old = {k: v for k, v in plan.to_dict().items() if k not in ("shape_envelope",
                                                                 "on_new_shape")}
    assert Plan.from_dict(old).shape_envelope is None  # an older file: applied unchecked
    apply(model, Plan.from_dict(old))
    assert shape_guard(model) is None
    remove(model)


class Keywords(nn.Module):
    """Two MLP blocks called with keywords, one input nested (as a Hugging Face batch)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                extra: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        if mask is not None:
            x = x * mask[..., None]
        if extra is not None:
            x = x + extra["bias"][..., None]
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _keywords_batch(seq: int) -> dict[str, Any]:
    return {"x": torch.randn(2, seq, 64), "mask": torch.ones(2, seq),
            "extra": {"bias": torch.zeros(2, seq)}}


@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()"])
def test_a_compiled_model_keeps_the_guard_without_a_graph_break(how: str) -> None:
    """NOTE [ Shape guard under torch.compile ]: inside the envelope no graph break (the
    check traced as comparisons of sizes); outside, the error as in eager mode."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    model = Keywords()
    names = ("blocks.0", "blocks.1")
    plan = Plan(decisions={names[0]: Full()}, block_names=names, budget_bytes=1,
                cost=StepCost(peak_bytes=1),
                shape_envelope=batch_envelope(model, _keywords_batch(8)))
    apply(model, plan)
    dynamo.reset()
    counters.clear()
    try:
        if how == "model.compile()":
            model.compile(backend="eager")
            compiled: nn.Module = model
        else:
            compiled = torch.compile(model, backend="eager")
        for seq in (8, 5):  # the plan's shape, then a shorter one (a recompile, no break)
            compiled(**_keywords_batch(seq)).backward()
        assert dict(counters["graph_break"]) == {}
        with pytest.raises(ShapeOutsidePlan, match="a batch outside the shapes"):
            compiled(**_keywords_batch(12))
        with pytest.warns(RematWarning, match="without replan_with="):  # no optimizer given
            apply(model, plan, on_new_shape="replan")
        with pytest.raises(ShapeOutsidePlan, match="cannot plan inside torch.compile"):
            compiled(**_keywords_batch(12))
    finally:
        remove(model)
        dynamo.reset()


def test_replan_plans_each_bucket_once_and_keeps_gradients_exact() -> None:
    model = net()
    small, big = torch.randn(4, 16, 64), torch.randn(4, 50, 64)
    budget = int(0.85 * remat.profile(model, torch.randn(4, 64, 64), timing=False).peak_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = remat.auto(model, small, budget=budget, on_new_shape="replan")
    assert plan.on_new_shape == "replan" and plan.is_empty
    reference = copy.deepcopy(model)
    remove(reference)
    reference(big).backward()
    model(big).backward()  # outside: planned for bucket (4, 64, 64) before the forward
    guard = shape_guard(model)
    assert guard is not None and list(guard.replanned) == [(("x", (4, 64, 64)),)]
    replanned = guard.replanned[(("x", (4, 64, 64)),)]
    assert not replanned.is_empty and replanned.budget_bytes == budget
    assert replanned.measured_peak_bytes is not None
    assert replanned.measured_peak_bytes <= budget
    for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and ref.grad is not None
        torch.testing.assert_close(p.grad, ref.grad, rtol=1e-5, atol=1e-6, msg=name)
    model(torch.randn(4, 60, 64)).backward()  # the same bucket: no new plan
    assert len(guard.replanned) == 1 and guard.active is replanned
    model(small).backward()  # inside the replanned plan's shapes: it stays
    assert guard.active is replanned
    assert remat.validate(model, big, replanned).passed
    assert shape_guard(model) is guard
    remove(model)


def test_a_loaded_accumulating_plan_replans_a_gradient_accumulation_step() -> None:
    # A plan for a gradient-accumulation micro-step (gradients held from the start) keeps
    # that in its file, and the guard's replan of a new shape plans the same kind of step:
    # its measured peak is that of the micro-step, and it fits there.
    model = net()
    small, big = torch.randn(4, 16, 64), torch.randn(4, 50, 64)
    held = remat.profile(model, torch.randn(4, 64, 64), timing=False, accumulating=True)
    budget = int(0.85 * held.peak_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = remat.plan(model, small, budget=budget, accumulating=True)
    assert plan.accumulating
    assert not remat.plan(model, small, budget=budget).accumulating
    loaded = Plan.from_json(plan.to_json())
    assert loaded == plan and loaded.accumulating
    older = plan.to_dict()
    del older["accumulating"]  # a file written before the field: a plain step's plan
    assert not Plan.from_dict(older).accumulating
    apply(model, loaded, on_new_shape="replan", replan_with={})
    model(big).backward()  # outside: replanned before the forward
    guard = shape_guard(model)
    assert guard is not None and len(guard.replanned) == 1
    (replanned,) = guard.replanned.values()
    assert replanned.accumulating and not replanned.is_empty
    remove(model)
    model.zero_grad(set_to_none=True)
    apply(model, replanned)
    bucket = torch.randn(4, 64, 64)  # the shape bucket's largest batch, which it plans
    again = remat.profile(model, bucket, timing=False, accumulating=True)
    plain = remat.profile(model, bucket, timing=False)
    remove(model)
    assert replanned.measured_peak_bytes == again.peak_bytes > plain.peak_bytes
    assert again.peak_bytes <= budget
