"""benchmarks/_bound.py: the LP lower bound is exact on a chain, at least the greedy bound,
and at most the recompute of every built-in strategy that fits and of the plan."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch
from torch import nn

from loading import ROOT, load_module
from remat.compare.frontier import frontier
from remat.planning import plan

_PLANNER = load_module(ROOT / "benchmarks" / "planner.py", "remat_planner_benchmark")
_BOUND = sys.modules["_bound"]  # as benchmarks/planner.py imports it


class _Chain(nn.Module):
    """``softmax(x @ w + mask)``: only the softmax output is saved for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64))
        self.register_buffer("mask", torch.randn(64, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x @ self.w + self.mask, dim=-1)


def test_a_chain_costs_all_its_ops() -> None:
    chain, x = _Chain(), torch.randn(64, 64)
    graph = _BOUND.forward_graph(lambda: chain(x).sum(), [*chain.parameters(),
                                                           *chain.buffers(), x])
    assert graph.saved_bytes == 64 * 64 * 4  # the softmax output alone
    names = {"aten.mm": 0.0, "aten.add": 0.0, "aten._softmax": 0.0}
    for ops, cost in zip(graph.ops, graph.cost_ms, strict=True):
        for op in ops:
            if op in names:
                names[op] += cost
    assert all(cost > 0 for cost in names.values()), names
    need = graph.saved_bytes
    assert _BOUND.knapsack_bound_ms(graph, need) == pytest.approx(names["aten._softmax"])
    assert _BOUND.lp_bound_ms(graph, need) == pytest.approx(sum(names.values()), rel=1e-6)
    assert _BOUND.lp_bound_ms(graph, need // 2) == pytest.approx(sum(names.values()) / 2,
                                                                 rel=1e-6)
    assert _BOUND.lp_bound_ms(graph, 0) == 0.0


def _tiny_gpt2() -> tuple[nn.Module, dict[str, torch.Tensor], str]:
    hf_tiny = load_module(ROOT / "tests" / "measure" / "hf_tiny.py", "hf_tiny")
    model, batch = hf_tiny.build_hf("gpt2")  # dropout 0.1: RNG ops, in-place masks
    return model, batch, "gpt2"


def _generated() -> tuple[nn.Module, dict[str, torch.Tensor], str]:
    generated_models = load_module(ROOT / "tests" / "generated_models.py", "generated_models")
    drawn = generated_models.generated_model(104, seq=16)  # llama, 2 layers, dropout, tied
    return drawn.model, drawn.batch, drawn.label


@pytest.mark.parametrize(("build", "plans"), [(_tiny_gpt2, False), (_generated, True)],
                         ids=["gpt2", "generated"])  # one plan: a plan is the slow part
def test_the_lp_bound_is_below_every_fitting_strategy_and_the_plan(build: object,
                                                                   plans: bool) -> None:
    model, batch, label = build()  # type: ignore[operator]
    manual = frontier(model, batch, budget_bytes=1, simulate=True)
    full, none = manual.point("full").peak_bytes, manual.point("none").peak_bytes
    graph = _PLANNER.saved_graph(model, batch, manual.cost_device)
    for fraction in (0.25, 0.75):
        budget = int(full + fraction * (none - full))
        need = none - budget
        lp, greedy = _PLANNER.bounds_ms(graph, need)
        assert lp == pytest.approx(_BOUND.lp_bound_ms(graph, need))  # greedy <= LP
        assert lp >= greedy > 0
        fitting = [p for p in manual.points if p.peak_bytes <= budget]
        assert fitting, label
        for point in fitting:
            assert lp <= point.recompute_ms * (1 + 1e-6), (label, fraction, point.name)
        if fraction == 0.25 and plans:
            result = plan(model, batch, budget=budget, simulate=True)
            assert lp <= result.recompute_ms * (1 + 1e-6), (label, result.label())


def _logits_heavy() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A 2-layer Llama whose logits dominate its step (vocabulary 2048, d 64)."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=2048, hidden_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=128, max_position_embeddings=64,
                            tie_word_embeddings=False)
    model = tf.LlamaForCausalLM(config)
    model.config.use_cache = False
    model.train()
    ids = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids.clone()}


def test_a_chunked_head_is_bounded_with_the_bytes_it_frees_besides_saved_storages() -> None:
    """NOTE [ A chunked head in the bound ]: on a decoder whose logits dominate, the bound
    with the head's branch stays below the recompute of a chunked head that fits, and never
    above the saved-storage program alone."""
    model, batch = _logits_heavy()
    manual = frontier(model, batch, budget_bytes=1, simulate=True,
                      strategies=("none", "full", "full+chunked_head:4"))
    none, chunked = manual.point("none").peak_bytes, manual.point("full+chunked_head:4")
    graph = _PLANNER.saved_graph(model, batch, manual.cost_device)
    assert graph.head_groups and graph.loss_ms > 0
    head_bytes = _PLANNER.head_freed_bytes(model, batch, graph)
    assert head_bytes >= 2 * 64 * 2048 * 4  # the logits' gradient at least
    need = none - chunked.peak_bytes
    assert need > 0 and chunked.peak_bytes < manual.point("full").peak_bytes
    bound, greedy = _PLANNER.bounds_ms(graph, need, head_bytes)
    assert 0 < greedy <= bound <= _BOUND.lp_bound_ms(graph, need) * (1 + 1e-9)
    assert bound <= chunked.recompute_ms * (1 + 1e-6)
    # the head's branch pays the projection and the loss: never below them
    head_ms = sum(graph.cost_ms[g] for g in graph.head_groups) + graph.loss_ms
    assert _BOUND.lp_bound_ms(graph, 1, 10 * none) == pytest.approx(
        min(_BOUND.lp_bound_ms(graph, 1), head_ms))


def test_every_moment_of_backward_binds_within_the_un_checkpointed_peak() -> None:
    """NOTE [ Moments of backward in the bound ]: at each first unpack the recording's
    kept storages and the bytes backward made are within the un-checkpointed step's
    peak (else a moment would ask more of a plan than any step holds), and the moments
    raise the chunked head's program above the end of forward alone (a mixture of experts
    decoder drawn for this test, whose chunked head frees its loss's temporaries), while
    the bound stays below every built-in strategy that fits."""
    generated_models = load_module(ROOT / "tests" / "generated_models.py", "generated_models")
    drawn = generated_models.generated_model(502, seq=16)  # olmoe, 4 layers, dropout
    model, batch = drawn.model, drawn.batch
    manual = frontier(model, batch, budget_bytes=1, simulate=True)
    full, none = manual.point("full").peak_bytes, manual.point("none").peak_bytes
    graph = _PLANNER.saved_graph(model, batch, manual.cost_device)
    head_bytes = _PLANNER.head_freed_bytes(model, batch, graph)
    start = none - graph.saved_bytes - head_bytes
    assert graph.unpacks and {t for t, _ in graph.unpacks} <= graph.saved
    for k, (_, made) in enumerate(graph.unpacks):
        kept = sum(graph.nbytes[t] for t, _ in graph.unpacks[k:])
        assert 0 <= made and start + kept + made <= none, k
    assert graph.op_moments and max(n for n, _ in graph.op_moments) == len(graph.unpacks)
    for n, made in graph.op_moments:  # just after an op: storages not unpacked yet
        kept = sum(graph.nbytes[t] for t, _ in graph.unpacks[n:])
        assert 0 <= made and start + kept + made <= none, n
    for fraction in (0.25, 0.5, 0.75):
        budget = int(full + fraction * (none - full))
        need = none - budget
        plain, chunked = _BOUND.programs(graph, need, head_bytes)
        assert (plain.label, chunked.label) == ("saved storages", "chunked head")
        assert chunked.need_bytes == need - head_bytes and len(chunked.rows) > 1
        end = _BOUND.program_lp_ms(graph, replace(chunked, rows=()))
        with_moments = _BOUND.program_lp_ms(graph, chunked)
        assert with_moments > end * 1.05, fraction  # 1.10-1.22x when written
        bound, _ = _PLANNER.bounds_ms(graph, need, head_bytes)
        fitting = [p for p in manual.points if p.peak_bytes <= budget]
        assert fitting
        assert all(bound <= p.recompute_ms * (1 + 1e-6) for p in fitting), fraction


def test_a_built_in_models_head_is_found_so_its_chunked_plans_are_bounded() -> None:
    """A built-in model has no ``get_output_embeddings``: its ``lm_head`` is still the head
    (``remat.strategies.head.output_head``), so a plan with a chunked head, which frees the
    loss's bytes besides saved storages, stays above the bound (without the head's program
    the saved-storage one alone read 93.3 us against a fitting plan's 87.8 us on
    llama-small)."""
    from remat.models import build_model, make_batch

    torch.manual_seed(0)
    model = build_model("llama-tiny")
    batch = make_batch(model, 4)
    manual = frontier(model, batch, budget_bytes=1, simulate=True,
                      strategies=("none", "full", "full+chunked_head:4"))
    none, chunked = manual.point("none").peak_bytes, manual.point("full+chunked_head:4")
    graph = _PLANNER.saved_graph(model, batch, manual.cost_device)
    assert graph.head_groups and graph.loss_ms > 0 and graph.head_grad_bytes > 0
    head_bytes = _PLANNER.head_freed_bytes(model, batch, graph)
    bound, _ = _PLANNER.bounds_ms(graph, none - chunked.peak_bytes, head_bytes)
    assert 0 < bound <= chunked.recompute_ms * (1 + 1e-6)
