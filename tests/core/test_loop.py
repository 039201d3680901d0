"""The shared closed loop (NOTE [ Closed loop ]) on the hand-built table of test_solver."""

from __future__ import annotations

from core.test_solver import model
from remat.core.loop import close_loop
from remat.core.solver import solve


def test_a_choice_that_measures_within_budget_is_returned_at_once() -> None:
    pm = model()
    rounds: list[int] = []
    choice = close_loop(pm, 1400, lambda c: pm.predict(c), max_rounds=4,
                        on_round=lambda done, total: rounds.append(done))
    assert choice == solve(pm, 1400) and rounds == [0]


def test_an_overshoot_tightens_the_next_target_by_the_excess() -> None:
    pm = model()
    seen: list[tuple[int, ...]] = []

    def measure(choice: list[int]) -> int:  # the backend measures 30 B more than predicted
        seen.append(tuple(choice))
        return pm.predict(choice) + 30

    choice = close_loop(pm, 1400, measure, max_rounds=4)
    assert choice is not None and pm.predict(choice) + 30 <= 1400
    first = solve(pm, 1400)
    assert first is not None and seen[0] == tuple(first)
    # the second target: min(1400, predicted) - (measured - 1400)
    excess = pm.predict(first) + 30 - 1400
    assert excess > 0 and seen[1] == tuple(solve(pm, min(1400, pm.predict(first)) - excess) or ())


def test_without_prediction_the_target_falls_from_itself() -> None:
    pm = model()
    targets: list[int] = []
    first = solve(pm, 1400)
    assert first is not None

    def measure(choice: list[int]) -> int:
        targets.append(pm.predict(choice))
        return 1400 + 5  # always 5 B over

    assert close_loop(pm, 1400, measure, max_rounds=3, tighten_by_prediction=False) is None
    assert len(targets) == 3 and all(t <= 1400 - 5 * k for k, t in enumerate(targets))


def test_nothing_predicted_to_fit_returns_none() -> None:
    pm = model()
    calls: list[int] = []
    assert close_loop(pm, 100, lambda c: calls.append(1) or 0, max_rounds=5) is None
    assert calls == []
