"""The peak model and the solver on a hand-built table (no measurement involved).

The candidates are plain records with the four numbers of
``remat.core.peak.CandidateLike``: the core knows no framework's candidate type.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.core.peak import PeakModel, Window
from remat.core.solver import choice_cost_ps, min_peak_choice, solve


@dataclass(frozen=True)
class Cand:
    """A candidate as the core sees it (``CandidateLike``)."""

    label: str
    saved_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    recompute_ms: float


# Per candidate: kept bytes, forward and backward working sets, recompute ms.
NONE = Cand("none", 100, 110, 150, 0.0)
OPS = Cand("ops", 40, 110, 150, 1.0)
MLP = Cand("mlp", 60, 100, 140, 0.6)
FULL = Cand("full", 10, 90, 150, 2.0)
TABLE = (NONE, OPS, MLP, FULL)
L = 3


def model() -> PeakModel:
    """Three blocks; 1000 B of parameters; logits 200 B at the head; grads grow in backward."""
    windows = [Window("pre", 1000, 0)]
    for i in range(L):
        windows.append(Window(f"fwd:{i}", 1000, i, i, "forward"))
    windows.append(Window(f"gap:{L - 1}", 1200, L))
    for i in reversed(range(L)):
        windows.append(Window(f"bwd:{i}", 1100 + 50 * (L - 1 - i), i, i, "backward"))
    windows.append(Window("tail", 1250, 0))
    return PeakModel(tuple(windows), (TABLE,) * L, tuple(f"b.{i}" for i in range(L)), 0)


def brute_force(pm: PeakModel, budget: int) -> int | None:
    costs = [choice_cost_ps(pm, c) for c in itertools.product(range(len(TABLE)), repeat=L)
             if pm.predict(c) <= budget]
    return min(costs) if costs else None


def test_peak_is_the_largest_window_not_a_sum() -> None:
    pm = model()
    assert pm.predict([0, 0, 0]) == 1500  # head: 1200 + 3 x 100
    assert pm.peak_window([0, 0, 0]) == "gap:2"
    windows = pm.window_bytes([3, 3, 3])
    assert windows["gap:2"] == 1230 and windows["bwd:2"] == 1100 + 20 + 150
    assert windows["bwd:0"] == 1200 + 0 + 150  # the most gradients, nothing kept before it
    assert pm.predict([3, 3, 3]) == 1350
    assert pm.peak_window([3, 3, 3]) == "bwd:0"


@pytest.mark.parametrize("budget", [1200, 1340, 1345, 1350, 1400, 1450, 1500, 10_000])
def test_solver_finds_the_cheapest_choice_that_fits(budget: int) -> None:
    pm = model()
    choice = solve(pm, budget)
    best = brute_force(pm, budget)
    if best is None:
        assert choice is None
        return
    assert choice is not None and pm.predict(choice) <= budget
    assert choice_cost_ps(pm, choice) == best


def test_three_regimes() -> None:
    pm = model()
    assert solve(pm, 10_000) == [0, 0, 0]  # not binding: the empty plan
    lowest = pm.predict(min_peak_choice(pm))
    assert solve(pm, lowest - 1) is None  # infeasible
    assert solve(pm, lowest) is not None
    binding = solve(pm, 1400)
    assert binding is not None and binding != [0, 0, 0]


def test_min_peak_choice_is_the_lowest_peak_then_the_cheapest() -> None:
    pm = model()
    choice = min_peak_choice(pm)
    lowest = min(pm.predict(c) for c in itertools.product(range(len(TABLE)), repeat=L))
    assert pm.predict(choice) == lowest
    assert choice_cost_ps(pm, choice) == brute_force(pm, lowest)


@settings(max_examples=80, deadline=None)
@given(st.integers(1200, 1600), st.integers(1200, 1600))
def test_more_budget_never_costs_more(a: int, b: int) -> None:
    pm = model()
    low, high = sorted((a, b))
    dear, cheap = solve(pm, low), solve(pm, high)
    if dear is None:
        return
    assert cheap is not None
    assert choice_cost_ps(pm, cheap) <= choice_cost_ps(pm, dear)


def test_the_solvers_native_output_never_reaches_stdout(
    capfd: pytest.CaptureFixture[str],
) -> None:
    from remat.native import silenced

    with silenced(1):  # what the solver wraps HiGHS in
        os.write(1, b"HighsMipSolverData::printDisplayLine\n")  # what HiGHS prints from C++
    print("after", flush=True)
    assert capfd.readouterr().out == "after\n"


def _random_model(rng: random.Random, blocks: int, kinds: int) -> PeakModel:
    """Blocks of ``kinds`` kinds with random candidates and random window constants."""
    tables = []
    for _ in range(kinds):
        table = [Cand("none", rng.randint(50, 120), rng.randint(80, 130),
                      rng.randint(120, 180), 0.0)]
        for k in range(rng.randint(1, 6)):
            table.append(Cand("full" if k == 0 else "mlp",
                              rng.randint(0, 120), rng.randint(60, 130),
                              rng.randint(100, 200), round(rng.uniform(0.01, 3), 3)))
        tables.append(tuple(table))
    per_block = tuple(tables[i % kinds] for i in range(blocks))
    windows = [Window("pre", rng.randint(500, 1000), 0)]
    for i in range(blocks):
        windows.append(Window(f"fwd:{i}", rng.randint(900, 1000), i, i, "forward"))
    windows.append(Window(f"gap:{blocks - 1}", rng.randint(1000, 1300), blocks))
    for i in reversed(range(blocks)):
        windows.append(Window(f"bwd:{i}", 1000 + rng.randint(0, 40) * (blocks - i), i, i,
                              "backward"))
    windows.append(Window("tail", rng.randint(1000, 1300), 0))
    return PeakModel(tuple(windows), per_block, tuple(f"b.{i}" for i in range(blocks)), 0)


@pytest.mark.parametrize("seed", range(12))
def test_dynamic_program_matches_the_integer_program(seed: int) -> None:
    """The fast path (NOTE [ Prefix dynamic program ]) against HiGHS at many budgets."""
    rng = random.Random(seed)
    pm = _random_model(rng, blocks=rng.randint(2, 12), kinds=rng.randint(1, 3))
    lowest = pm.predict(min_peak_choice(pm, exact=True))
    assert pm.predict(min_peak_choice(pm)) == lowest
    assert choice_cost_ps(pm, min_peak_choice(pm)) == \
        choice_cost_ps(pm, min_peak_choice(pm, exact=True))
    top = pm.predict([0] * pm.num_blocks)
    for budget in sorted({lowest - 1, lowest, top, top + 1,
                          *(rng.randint(lowest, top) for _ in range(6))}):
        fast, exact = solve(pm, budget), solve(pm, budget, exact=True)
        assert (fast is None) == (exact is None), budget
        if fast is not None and exact is not None:
            assert pm.predict(fast) <= budget
            assert choice_cost_ps(pm, fast) == choice_cost_ps(pm, exact), budget


def test_dynamic_program_matches_brute_force_on_the_hand_built_table() -> None:
    pm = model()
    for budget in range(1190, 1510, 5):
        choice = solve(pm, budget)
        best = brute_force(pm, budget)
        assert (choice is None) == (best is None)
        if choice is not None:
            assert choice_cost_ps(pm, choice) == best


def test_dynamic_program_is_fast_on_many_identical_blocks() -> None:
    """32 identical blocks: symmetric for branch-and-bound, a short front for the DP."""
    pm = _random_model(random.Random(0), blocks=32, kinds=1)
    lowest = pm.predict(min_peak_choice(pm))
    top = pm.predict([0] * 32)
    started = time.process_time()
    for budget in range(lowest, top + 1, max(1, (top - lowest) // 20)):
        choice = solve(pm, budget)
        assert choice is not None and pm.predict(choice) <= budget
    assert time.process_time() - started < 5.0


def test_a_window_without_the_prefix_form_falls_back_to_the_integer_program() -> None:
    pm = model()
    odd = PeakModel(pm.windows + (Window("odd", 1000, 1, 2, "backward"),), pm.tables,
                    pm.block_names, 0)
    found = 0
    for budget in range(1300, 1800, 25):
        choice, exact = solve(odd, budget), solve(odd, budget, exact=True)
        assert (choice is None) == (exact is None)
        if choice is not None and exact is not None:
            found += 1
            assert choice_cost_ps(odd, choice) == choice_cost_ps(odd, exact)
    assert found


def test_the_integer_program_is_bounded_by_work_and_says_when_it_stops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Work, not time ]: no wall-clock limit; a solve cut at the node limit still
    returns a choice that fits, and warns."""
    import inspect

    from remat.core import solver as solver_module
    from remat.errors import RematWarning

    assert "time_limit" not in inspect.getsource(solver_module._run)
    # a multiple-choice knapsack whose costs track its bytes: HiGHS must branch
    rng = random.Random(1)
    tables = []
    for _ in range(40):
        table = [Cand("none", 1000, 1000, 1000, 0.0)]
        for k in range(4):
            saved = rng.randint(100, 900)
            table.append(Cand(f"c{k}", saved, 1000, 1000,
                              (1000 - saved + rng.randint(0, 50)) * 0.001))
        tables.append(tuple(table))
    pm = PeakModel((Window("pre", 0, 0), Window("gap", 0, 40)), tuple(tables),
                   tuple(f"b.{i}" for i in range(40)), 0)
    budget = pm.predict([0] * 40) // 2
    full = solve(pm, budget, exact=True)
    assert full is not None
    monkeypatch.setattr(solver_module, "_NODE_LIMIT", 2)
    with pytest.warns(RematWarning, match="work limit"):
        cut = solve(pm, budget, exact=True)
    assert cut is not None and pm.predict(cut) <= budget
    assert choice_cost_ps(pm, cut) >= choice_cost_ps(pm, full)
