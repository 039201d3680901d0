"""NOTE [ Fits on the card ]: reserved + workspaces against capacity less outside."""

from __future__ import annotations

import pytest

from remat.card_fit import CardBudget, CardFit, card_budget
from remat.device_memory import OutsideMemory, Term, Workspaces
from remat.devices import get_device

GIB = 2**30


def test_the_limit_is_capacity_less_outside_and_workspaces_count_in_the_reserved() -> None:
    budget = card_budget("h100-80gb", outside=OutsideMemory(context_bytes=GIB, nccl_bytes=0),
                         workspaces=Workspaces(cublas_bytes=32 * 2**20, cublaslt_bytes=0,
                                               cudnn_bytes=0), env={})
    capacity = get_device("h100-80gb").capacity_bytes
    assert budget.capacity_bytes == capacity
    assert budget.outside_bytes == GIB and budget.limit_bytes == capacity - GIB
    assert budget.workspace_bytes == 2 * 32 * 2**20  # two (handle, stream) pairs
    fit = budget.check(70 * GIB, 71 * GIB)
    assert fit.allocated_bytes == 70 * GIB + budget.workspace_bytes
    assert fit.reserved_bytes == 71 * GIB + budget.workspace_bytes
    assert fit.margin_bytes == capacity - GIB - 71 * GIB - budget.workspace_bytes
    assert fit.fits and not fit.needs_expandable_segments


def test_a_step_at_the_nominal_size_does_not_fit() -> None:
    """80 GiB of tensors do not fit an H100-80GB: PyTorch reports ~79.1 GiB."""
    budget = card_budget("h100-80gb", env={})
    assert not budget.check(80 * GIB, 80 * GIB).fits
    assert not budget.check(79 * GIB, 79 * GIB).fits  # the context and workspaces too


def test_expandable_segments_are_named_when_they_make_the_fit() -> None:
    budget = CardBudget("card", 10 * GIB, {"context": Term(GIB, "test")})
    fit = budget.check(8 * GIB, 9 * GIB + 1, expandable_reserved_bytes=8 * GIB + 2**21)
    assert not fit.fits and fit.needs_expandable_segments
    assert fit.margin_bytes == -1
    assert not budget.check(8 * GIB, 10 * GIB, 10 * GIB).needs_expandable_segments


def test_bad_figures_are_refused() -> None:
    with pytest.raises(ValueError, match="reserved_bytes is below allocated_bytes"):
        CardFit(10, 5, 100)
    with pytest.raises(ValueError, match="nothing of card is left"):
        CardBudget("card", GIB, {"context": Term(GIB, "test")})
