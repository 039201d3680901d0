"""Choose one candidate per block: least recompute cost whose predicted peak fits.

The peak is a maximum over memory windows (see ``remat.core.peak``), so "fits" is one
linear constraint per window; together with "one candidate per block" this is
a multiple-choice knapsack with several knapsacks. It is solved exactly by a
dynamic program over the blocks (NOTE [ Prefix dynamic program ]); the 0/1
integer program with ``scipy.optimize.milp`` (HiGHS) is the fallback and the
reference the tests compare it with.

NOTE [ Exact costs ]
    Costs enter the program as integers (picoseconds of roofline time), and the
    solver runs with a zero optimality gap, so the optimum is exact: a larger
    budget only enlarges the feasible set and can never give a costlier plan
    (the monotonicity the tests check). Byte constraints are checked again in
    exact integer arithmetic after solving; a solution that HiGHS accepted
    within its floating-point tolerance but that exceeds the budget by a few
    bytes is re-solved with the budget tightened by the excess.

NOTE [ Byte units ]
    Byte counts of large models (1e10 and more) next to 0/1 variables make the
    program badly scaled for HiGHS's floating-point tolerances. Constraints are
    therefore written in units of a power of two chosen so that every coefficient is
    at most 2**24 (exact in floating point, and 1 byte for test-sized models); the
    exact integer check after solving catches any rounding.

NOTE [ Work, not time ]
    The integer program is bounded by work (``_NODE_LIMIT`` branch-and-bound nodes of
    HiGHS, whose MIP search is deterministic), never by a wall-clock limit: a time limit
    makes the plan depend on how busy the machine is (the best plan found so far when the
    clock ran out). A solve that reaches the node limit before proving its answer optimal
    still returns the best choice it found (the closed loop checks that it fits, as any
    other), and warns that a cheaper plan may exist. The dynamic program is exact and
    bounded by ``_MAX_FRONT`` states per block, so no solve reads the clock.

SciPy is imported inside the functions that run HiGHS, so importing this module
(as ``remat.jax`` does) loads NumPy only.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from remat.core.peak import PeakModel
from remat.errors import RematError, RematWarning, current_call, message
from remat.native import silenced

if TYPE_CHECKING:
    from scipy.optimize import Bounds, LinearConstraint


_PS_PER_MS = 10**9
_MAX_RESOLVES = 4
_MAX_COEFFICIENT = 2.0**24  # See NOTE [ Byte units ].
#: Branch-and-bound nodes HiGHS may explore: NOTE [ Work, not time ].
_NODE_LIMIT = 20_000


def _cost_ps(ms: float) -> int:
    return int(round(ms * _PS_PER_MS))


def choice_cost_ps(model: PeakModel, choice: Sequence[int]) -> int:
    """The exact integer cost (picoseconds) of ``choice``, as the solver sees it."""
    return sum(_cost_ps(model.tables[i][c].recompute_ms) for i, c in enumerate(choice))


def _layout(model: PeakModel) -> list[int]:
    offsets = [0]
    for table in model.tables:
        offsets.append(offsets[-1] + len(table))
    return offsets


def _window_rows(model: PeakModel, offsets: list[int]
                 ) -> tuple[np.ndarray, np.ndarray, float]:
    """Coefficients (one row per window), constants and the byte unit they are in.

    See NOTE [ Byte units ].
    """
    rows = np.zeros((len(model.windows), offsets[-1]))
    constants = np.zeros(len(model.windows))
    for r, window in enumerate(model.windows):
        constants[r] = window.constant_bytes
        for j in range(window.prefix):
            for c, cand in enumerate(model.tables[j]):
                rows[r, offsets[j] + c] += cand.saved_bytes
        if model.holds(window):  # micro-batches in flight hold every block's saved bytes
            constants[r] += model.held_copies * model.held_bytes
            for j, table in enumerate(model.tables):
                for c, cand in enumerate(table):
                    rows[r, offsets[j] + c] += model.held_copies * cand.saved_bytes
        if window.block is not None:
            b = window.block
            for c, cand in enumerate(model.tables[b]):
                rows[r, offsets[b] + c] += window.own_bytes(cand)
    largest = max(float(np.abs(rows).max(initial=0.0)), float(np.abs(constants).max()), 1.0)
    unit = 2.0 ** max(0, math.ceil(math.log2(largest / _MAX_COEFFICIENT)))
    return rows / unit, constants / unit, unit


def _one_per_block(model: PeakModel, offsets: list[int], extra_columns: int = 0
                   ) -> LinearConstraint:
    from scipy.optimize import LinearConstraint

    eq = np.zeros((model.num_blocks, offsets[-1] + extra_columns))
    for i in range(model.num_blocks):
        eq[i, offsets[i]:offsets[i + 1]] = 1.0
    return LinearConstraint(eq, 1.0, 1.0)


def _decode(x: np.ndarray, offsets: list[int]) -> list[int]:
    return [int(np.argmax(x[offsets[i]:offsets[i + 1]])) for i in range(len(offsets) - 1)]


def _run(c: np.ndarray, constraints: list[LinearConstraint], integrality: np.ndarray,
         bounds: Bounds) -> np.ndarray | None:
    from scipy.optimize import milp

    with silenced(1):  # HiGHS prints debug lines from C++ on large problems
        result = milp(c, constraints=constraints, integrality=integrality, bounds=bounds,
                      options={"mip_rel_gap": 0.0, "disp": False, "node_limit": _NODE_LIMIT})
    if result.status == 0:
        return np.asarray(result.x)
    if result.status == 2:  # infeasible
        return None
    if result.x is not None:  # NOTE [ Work, not time ]: stopped at the node limit
        warnings.warn(message(
            current_call("remat.plan"),
            "the solver reached its work limit before proving the plan optimal",
            {"limit": f"{_NODE_LIMIT} branch-and-bound nodes",
             "so": "the plan fits (the closed loop measured it) but a cheaper one may exist"},
            fix="plan fewer distinct blocks at once (blocks=...), or report the model"),
            RematWarning, stacklevel=2)
        return np.asarray(result.x)
    raise RematError(message(current_call("remat.plan"), "the solver stopped without an answer",
                             {"solver": result.message, "limit": f"{_NODE_LIMIT} nodes"},
                             fix="please report this with the model and budget"))


# NOTE [ Prefix dynamic program ]
#     Every window of the peak model reads ``S_p + own_p(d_p)``: the saved bytes of the
#     first p blocks plus (optionally) block p's working set (``remat.core.peak``). So the
#     program is a shortest path over blocks whose state is ``S_p``, and a state is
#     dominated by one with fewer saved bytes *and* no higher cost (every later constraint
#     only grows with ``S``). Keeping the Pareto front of ``(S_p, cost)`` after each block
#     solves the integer program exactly, in integers, in milliseconds where HiGHS needs
#     seconds (identical blocks make branch-and-bound symmetric: 32 blocks hit its time
#     limit).
#     A front larger than ``_MAX_FRONT`` falls back to the MILP.

_MAX_FRONT = 200_000
_BIG = np.iinfo(np.int64).max // 4


def _dp_tables(model: PeakModel, budget_bytes: int
               ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], np.ndarray] | None:
    """Per block: saved bytes, costs (ps), the largest ``S_p`` each candidate allows;
    per prefix p (0..L): the largest ``S_p`` windows without a block allow.
    ``None`` when a window does not have the prefix form (block == prefix), or the
    model holds other micro-batches (every window then reads every block)."""
    if model.held_copies:
        return None
    n = model.num_blocks
    caps = np.full(n + 1, _BIG, dtype=np.int64)
    slack = [np.full(len(t), _BIG, dtype=np.int64) for t in model.tables]
    for w in model.windows:
        if w.block is None:
            caps[w.prefix] = min(int(caps[w.prefix]), budget_bytes - w.constant_bytes)
        elif w.block != w.prefix:
            return None
        else:
            own = np.array([w.own_bytes(c) for c in model.tables[w.block]], dtype=np.int64)
            slack[w.block] = np.minimum(slack[w.block], budget_bytes - w.constant_bytes - own)
    saved = [np.array([c.saved_bytes for c in t], dtype=np.int64) for t in model.tables]
    costs = [np.array([_cost_ps(c.recompute_ms) for c in t], dtype=np.int64)
             for t in model.tables]
    for p in range(n):  # S_p can be at most what any candidate of block p allows
        caps[p] = min(int(caps[p]), int(slack[p].max()))
    caps = np.minimum.accumulate(caps[::-1])[::-1]  # S never shrinks: later caps bind now
    return saved, costs, slack, caps


def _front(s: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Indices of the Pareto front of (s, v), both minimised, sorted by s."""
    order = np.lexsort((v, s))
    best = np.minimum.accumulate(v[order])
    keep = np.ones(len(order), dtype=bool)
    keep[1:] = v[order][1:] < best[:-1]
    return order[keep]


class _NotApplicable(Exception):
    """NOTE [ Prefix dynamic program ] does not apply (or its front grew too large)."""


def _solve_dp(model: PeakModel, budget_bytes: int) -> list[int] | None:
    """Exact solve by NOTE [ Prefix dynamic program ].

    Raises:
        _NotApplicable: a window without the prefix form, or a front over ``_MAX_FRONT``.
    """
    tables = _dp_tables(model, budget_bytes)
    if tables is None:
        raise _NotApplicable
    saved, costs, slack, caps = tables
    s = np.zeros(1, dtype=np.int64)
    v = np.zeros(1, dtype=np.int64)
    if caps[0] < 0:
        return None
    parents: list[tuple[np.ndarray, np.ndarray]] = []
    for p in range(model.num_blocks):
        new_s, new_v, par, cand = [], [], [], []
        for c in range(len(saved[p])):
            ok = np.flatnonzero(s <= slack[p][c])
            new_s.append(s[ok] + saved[p][c])
            new_v.append(v[ok] + costs[p][c])
            par.append(ok)
            cand.append(np.full(len(ok), c, dtype=np.int64))
        s, v = np.concatenate(new_s), np.concatenate(new_v)
        par_all, cand_all = np.concatenate(par), np.concatenate(cand)
        fits = s <= caps[p + 1]
        s, v, par_all, cand_all = s[fits], v[fits], par_all[fits], cand_all[fits]
        if len(s) == 0:
            return None
        keep = _front(s, v)
        if len(keep) > _MAX_FRONT:
            raise _NotApplicable
        s, v = s[keep], v[keep]
        parents.append((par_all[keep], cand_all[keep]))
    index = int(np.lexsort((s, v))[0])  # least cost, then fewest saved bytes
    choice = []
    for par, cand in reversed(parents):
        choice.append(int(cand[index]))
        index = int(par[index])
    return choice[::-1]


def _min_peak_dp(model: PeakModel) -> int | None:
    """The smallest predicted peak of any choice, by the same front with the running
    peak in place of the cost; ``None`` when a window lacks the prefix form."""
    if model.held_copies:
        return None
    n = model.num_blocks
    floor = np.full(n + 1, -_BIG, dtype=np.int64)  # no-block windows: constant per prefix
    high = [np.full(len(t), -_BIG, dtype=np.int64) for t in model.tables]
    for w in model.windows:
        if w.block is None:
            floor[w.prefix] = max(int(floor[w.prefix]), w.constant_bytes)
        elif w.block != w.prefix:
            return None
        else:
            own = np.array([w.own_bytes(c) for c in model.tables[w.block]], dtype=np.int64)
            high[w.block] = np.maximum(high[w.block], w.constant_bytes + own)
    s = np.zeros(1, dtype=np.int64)
    peak = np.full(1, floor[0], dtype=np.int64)
    for p, table in enumerate(model.tables):
        new_s, new_peak = [], []
        for c, cand in enumerate(table):
            after = s + cand.saved_bytes
            new_s.append(after)
            new_peak.append(np.maximum(np.maximum(peak, s + high[p][c]), after + floor[p + 1]))
        s, peak = np.concatenate(new_s), np.concatenate(new_peak)
        keep = _front(s, peak)
        if len(keep) > _MAX_FRONT:
            return None
        s, peak = s[keep], peak[keep]
    return int(peak.min())


def solve(model: PeakModel, budget_bytes: int, *, exact: bool = False) -> list[int] | None:
    """The cheapest choice (candidate index per block) whose predicted peak fits.

    Args:
        model: the calibrated peak model with every block's candidates.
        budget_bytes: the peak the choice must not exceed.
        exact: solve the integer program with HiGHS instead of NOTE [ Prefix dynamic
            program ] (the same optimum cost; for tests). Default: False.

    Returns:
        One candidate index per block, or ``None`` when no choice fits.

    Example:
        >>> solve(peak_model, 2 * 1024**3)
        [0, 0, 3, 3, 5, 5]
    """
    if not exact:
        with contextlib.suppress(_NotApplicable):
            found = _solve_dp(model, budget_bytes)
            assert found is None or model.predict(found) <= budget_bytes
            return found
    return _solve_milp(model, budget_bytes)


def _solve_milp(model: PeakModel, budget_bytes: int) -> list[int] | None:
    """:func:`solve` as a 0/1 integer program (HiGHS); see NOTE [ Exact costs ]."""
    from scipy.optimize import Bounds, LinearConstraint

    offsets = _layout(model)
    n = offsets[-1]
    cost = np.array([float(_cost_ps(c.recompute_ms)) for t in model.tables for c in t])
    rows, constants, unit = _window_rows(model, offsets)
    target = budget_bytes
    for _ in range(_MAX_RESOLVES):
        limits = target / unit - constants
        if np.any((limits < 0) & ~rows.any(axis=1)):
            return None  # a window no decision changes is already over budget
        constraints = [_one_per_block(model, offsets), LinearConstraint(rows, -np.inf, limits)]
        x = _run(cost, constraints, np.ones(n), Bounds(0, 1))
        if x is None:
            return None
        choice = _decode(x, offsets)
        excess = model.predict(choice) - budget_bytes
        if excess <= 0:
            return choice
        target -= excess  # See NOTE [ Exact costs ].
    return None


def min_peak_choice(model: PeakModel, *, exact: bool = False) -> list[int]:
    """The choice with the smallest predicted peak (ties: the cheapest of them)."""
    from scipy.optimize import Bounds, LinearConstraint

    lowest = None if exact else _min_peak_dp(model)
    if lowest is not None:
        found = solve(model, lowest)
        if found is not None:
            return found
    offsets = _layout(model)
    n = offsets[-1]
    rows, constants, _ = _window_rows(model, offsets)
    # Variables: the candidates, then the peak z. Minimise z with rows·x - z <= -constant.
    with_z = np.hstack([rows, -np.ones((rows.shape[0], 1))])
    c = np.zeros(n + 1)
    c[-1] = 1.0
    constraints = [_one_per_block(model, offsets, extra_columns=1),
                   LinearConstraint(with_z, -np.inf, -constants)]
    integrality = np.concatenate([np.ones(n), [0.0]])
    bounds = Bounds(np.zeros(n + 1), np.concatenate([np.ones(n), [np.inf]]))
    x = _run(c, constraints, integrality, bounds)
    if x is None:  # cannot happen: every choice has some peak
        raise RematError(message(current_call("remat.plan"), "no candidate choice at all",
                                 fix="please report this with the model and budget"))
    choice = _decode(x, offsets)
    cheapest = solve(model, model.predict(choice), exact=exact)
    return cheapest if cheapest is not None else choice
