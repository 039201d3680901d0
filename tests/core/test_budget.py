"""parse_budget: bytes, units and percentages; clear errors for anything else."""

from __future__ import annotations

import pytest

from remat.core.budget import Budget, parse_budget


@pytest.mark.parametrize(("text", "expected"), [
    (1000, 1000),
    ("12GiB", 12 * 1024**3),
    ("800MB", 800 * 1000**2),
    ("1.5e9", 1_500_000_000),
    (" 64 KiB ", 64 * 1024),
])
def test_absolute_budgets_are_bytes(text: int | str, expected: int) -> None:
    budget = parse_budget(text)
    assert budget.bytes_ == expected and not budget.is_relative
    assert budget.resolve(123) == expected  # the reference does not matter


@pytest.mark.parametrize(("text", "fraction", "resolved"), [
    ("60%", 0.6, 600), ("12.5 %", 0.125, 125), ("150%", 1.5, 1500),
])
def test_percentages_are_fractions_of_the_uncheckpointed_peak(
        text: str, fraction: float, resolved: int) -> None:
    budget = parse_budget(text)
    assert budget.is_relative and budget.fraction == pytest.approx(fraction)
    assert budget.resolve(1000) == resolved
    assert str(budget) == f"{fraction * 100:g}%"


@pytest.mark.parametrize("bad", ["lots", "-5%", "0%", "%", "12 parsecs", 0, -1, True, 0.6,
                                 "0"])
def test_unreadable_budgets_say_how_to_write_one(bad: object) -> None:
    with pytest.raises(ValueError, match=r"remat\.plan: .*budget") as info:
        parse_budget(bad)  # type: ignore[arg-type]
    assert "60%" in str(info.value)


def test_budget_needs_exactly_one_form() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        Budget()
    with pytest.raises(ValueError, match="exactly one"):
        Budget(bytes_=1, fraction=0.5)
    assert parse_budget(Budget(bytes_=7)) == Budget(bytes_=7)


def test_an_activations_budget_keeps_the_static_bytes_and_a_share_of_the_rest() -> None:
    budget = parse_budget("activations:50%")
    assert budget == Budget(fraction=0.5, of="activations") and budget.is_relative
    assert str(budget) == "activations:50%" and str(parse_budget("50%")) == "50%"
    assert budget.resolve(1000, static_bytes=400) == 700  # 400 + 0.5 * (1000 - 400)
    assert parse_budget(" Activations: 150 % ").resolve(1000, static_bytes=400) == 1300
    with pytest.raises(ValueError, match=r"^Budget.resolve: activations:50% needs the step's"):
        budget.resolve(1000)
    # the other form, for messages
    assert budget.other_form(700, 1000, 400) == "70% of the peak"
    assert parse_budget("70%").other_form(700, 1000, 400) == "activations:50%"
    assert parse_budget("30%").other_form(300, 1000, 400).startswith("below the static bytes")


@pytest.mark.parametrize("text", ["activations:12GiB", "activations:", "activations:-5%"])
def test_a_bad_activations_budget_names_the_form(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_budget(text)
    assert str(info.value).startswith("remat.plan: ")
    assert "activations:" in str(info.value).splitlines()[-1]
