"""NOTE [ Priced head ]: a chunked output head where it undercuts the block-only plan."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import remat.planning.head as head_module
import remat.planning.planner as planner_module
from remat.models import build_model, make_batch
from remat.planning import Plan, PlanContext, plan, prepare
from remat.strategies.head import HEAD_KEY
from remat.validation import validate


def _gpt(vocab: int, layers: int) -> tuple[torch.nn.Module, Any, PlanContext]:
    torch.manual_seed(0)
    model = build_model("gpt-tiny", vocab_size=vocab, n_layer=layers, d_model=128,
                        max_seq_len=128)
    model.train()
    batch = make_batch(model, 4)
    return model, batch, prepare(model, batch)


@pytest.fixture(scope="module")
def shallow() -> tuple[torch.nn.Module, Any, PlanContext]:
    """2 layers, d 128, vocab 2048, 4 x 128 tokens: the log-softmax the loss saves
    (4 MiB) is a large share of the step."""
    return _gpt(2048, 2)


def _block_only(model: torch.nn.Module, batch: Any, context: PlanContext, budget: int,
                monkeypatch: pytest.MonkeyPatch) -> Plan:
    with monkeypatch.context() as patch:
        patch.setattr(planner_module, "cheaper_with_head", lambda s, c, b, found, **k: found)
        return plan(model, batch, budget=budget, context=context, simulate=True)


def test_the_head_is_chosen_where_it_undercuts_the_blocks(
        shallow: tuple[torch.nn.Module, Any, PlanContext],
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, batch, context = shallow
    budget = int(0.55 * context.no_checkpoint_peak_bytes)
    blocks = _block_only(model, batch, context, budget, monkeypatch)
    assert HEAD_KEY not in blocks.decisions  # the blocks alone fit
    priced = plan(model, batch, budget=budget, context=context, simulate=True)
    assert HEAD_KEY in priced.decisions
    assert priced.measured_peak_bytes <= budget
    # Measured: 18.2 us of block recompute, 12.8 us with the head (H100 roofline).
    assert priced.recompute_ms <= 0.8 * blocks.recompute_ms
    report = validate(model, batch, priced, rtol=1e-5)
    assert max(report.max_rel_error, report.loss_rel_error) < 1e-5


def test_the_head_is_not_measured_where_its_windows_barely_bind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Vocab 256, 4 layers: without the head's windows the blocks' plan costs 4% less.
    model, batch, context = _gpt(256, 4)
    budget = int(0.7 * context.no_checkpoint_peak_bytes)
    blocks = _block_only(model, batch, context, budget, monkeypatch)
    steps: list[int] = []
    original = head_module.head_options

    def counted(*args: Any, **kwargs: Any) -> Any:
        steps.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(head_module, "head_options", counted)
    priced = plan(model, batch, budget=budget, context=context, simulate=True)
    assert priced.recompute_ms == blocks.recompute_ms
    assert HEAD_KEY not in priced.decisions
    assert steps == []  # step 1 of the NOTE stopped it: no fake step ran
