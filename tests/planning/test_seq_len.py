"""The sequence-length search: exact longest lengths per strategy, the plan, errors."""

from __future__ import annotations

import pytest
import torch

import remat
from remat.models import build_model, make_batch
from remat.planning.search import Bracket, largest_fitting
from remat.planning.seq_len import SeqLenSearch, plan_seq_len
from remat.strategies.apply import applied

BUDGET = 3 * 2**20
SEARCH = SeqLenSearch(min_seq_len=32, max_seq_len=256, multiple_of=32)


def _model() -> torch.nn.Module:
    return build_model("gpt-tiny", max_seq_len=256)


def _peak(model, strategy: str, seq_len: int) -> int:
    remat.apply(model, strategy)
    try:
        return remat.profile(model, make_batch(model, 1, seq_len=seq_len), timing=False).peak_bytes
    finally:
        remat.remove(model)


@pytest.mark.parametrize(("limit", "refine", "expected"), [
    (37, None, Bracket(37, 38)), (0, None, Bracket(0, 1)), (100, None, Bracket(100, None)),
    (37, 2, Bracket(32, 40)),
])
def test_largest_fitting_is_exact_or_stops_after_refine_steps(limit, refine, expected) -> None:
    calls: list[int] = []

    def fits(k: int) -> bool:
        calls.append(k)
        return k <= limit

    assert largest_fitting(fits, first=1, last=100, refine_steps=refine) == expected
    assert len(calls) == len(set(calls))


def test_none_and_full_longest_are_exact_against_profile() -> None:
    model = _model()
    result = plan_seq_len(model, lambda b, s: make_batch(model, b, seq_len=s), budget=BUDGET,
                          search=SEARCH, strategies=["none", "full"], plan=False)
    assert [r.strategy for r in result.rows] == ["none", "full"]
    for name in ("none", "full"):
        row = result.row(name)
        assert row.seq_len is not None and row.next_seq_len == row.seq_len + 32
        fits, over = _peak(model, name, row.seq_len), _peak(model, name, row.next_seq_len)
        assert fits == row.peak_bytes <= BUDGET < over == row.next_peak_bytes
    assert result.longest("full") > result.longest("none")  # 128 > 96 tokens
    assert applied(model) is None  # the model is left as it was


def test_plan_reaches_at_least_as_far_as_full_and_fits() -> None:
    model = _model()
    result = plan_seq_len(model, lambda b, s: make_batch(model, b, seq_len=s), budget=BUDGET,
                          # two lengths, two plans: 128 tokens fit, 192 do not (a plan per
                          # length tried is the cost; the property needs one of each)
                          search=SeqLenSearch(min_seq_len=128, max_seq_len=192, multiple_of=64),
                          strategies=["full"], simulate=True)
    plan_row, full = result.row("plan"), result.row("full")
    assert plan_row.seq_len is not None and full.seq_len is not None
    assert plan_row.seq_len >= full.seq_len
    assert result.plan is not None and result.plan.batch_size == 1
    assert result.plan.measured_peak_bytes == plan_row.peak_bytes <= BUDGET
    assert plan_row.next_peak_bytes is not None and plan_row.next_peak_bytes > BUDGET
    assert result.to_dict()["rows"][1]["seq_len"] == plan_row.seq_len


def test_make_batch_that_ignores_seq_len_is_refused() -> None:
    model = _model()
    with pytest.raises(ValueError, match="make_batch ignores seq_len") as info:
        plan_seq_len(model, lambda b, s: make_batch(model, b, seq_len=64), budget=BUDGET,
                     search=SEARCH, strategies=["none"], plan=False)
    assert "make_batch(1, 32): [(1, 64), (1, 64)]" in str(info.value)


def test_nothing_fits_at_the_shortest_length_is_budget_too_small() -> None:
    model = _model()
    with pytest.raises(remat.BudgetTooSmall, match="nothing fits 1.00 MiB") as info:
        plan_seq_len(model, lambda b, s: make_batch(model, b, seq_len=s), budget="1MiB",
                     search=SEARCH, strategies=["none", "full"], plan=False, simulate=True)
    smallest = _peak(model, "full", 32)
    assert info.value.min_peak_bytes == smallest
    assert sum(info.value.breakdown.values()) == smallest


@pytest.mark.parametrize("bad", [{"multiple_of": 0}, {"min_seq_len": 70, "max_seq_len": 90,
                                                      "multiple_of": 64}])
def test_bad_search_is_a_value_error(bad) -> None:
    with pytest.raises(ValueError, match="SeqLenSearch"):
        SeqLenSearch(**bad)
