"""The closed loop both planners share: solve, measure the choice, tighten until it fits.

NOTE [ Closed loop ]
    Rule: a choice is returned only when its *measured* peak fits the budget. The peak
    model predicts; the backend measures (a tracked step for PyTorch, XLA's compiled
    peak for JAX). Each round solves for the cheapest choice whose predicted peak fits
    a target, measures it, and, when it is over the budget by ``d`` bytes, asks the
    solver for ``d`` bytes less the next round: the target becomes
    ``min(target, predicted) - d`` when the backend's peak model predicts each choice
    (the model under-predicted this one by at least ``d``), else ``target - d``.
    Targets only fall, so the loop ends: after ``max_rounds`` rounds or when nothing
    is predicted to fit, it returns ``None`` and the backend falls back to measuring
    its lowest choices itself.

Both the PyTorch loop (``remat.planning.loop``) and the JAX loop (``remat.jax.loop``)
call :func:`close_loop`; what "measure" means is theirs.
"""

from __future__ import annotations

from collections.abc import Callable

from remat.core.peak import PeakModel
from remat.core.solver import solve

Choice = list[int]
"""One candidate index per block, in the peak model's block order."""


def close_loop(peak_model: PeakModel, budget_bytes: int, measure: Callable[[Choice], int], *,
               max_rounds: int, tighten_by_prediction: bool = True,
               on_round: Callable[[int, int], None] | None = None) -> Choice | None:
    """The first solved choice whose measured peak fits ``budget_bytes`` (NOTE
    [ Closed loop ]), or ``None``.

    Args:
        peak_model: the calibrated peak model the solver reads.
        budget_bytes: the budget the *measured* peak must fit, bytes.
        measure: ``choice -> measured peak bytes`` (the backend's step).
        max_rounds: solve at most this many times.
        tighten_by_prediction: start each next target from the lower of the target and
            the choice's predicted peak. Default: ``True``.
        on_round: called as ``on_round(round, max_rounds)`` before each round (progress).
            Default: none.

    Example:
        >>> choice = close_loop(pm, 10 * 2**30, lambda c: profile_of(c).peak_bytes,
        ...                     max_rounds=6)
    """
    target = budget_bytes
    for round_ in range(max_rounds):
        if on_round is not None:
            on_round(round_, max_rounds)
        choice = solve(peak_model, target)
        if choice is None:
            return None
        peak_bytes = measure(choice)
        if peak_bytes <= budget_bytes:
            return choice
        start = min(target, peak_model.predict(choice)) if tighten_by_prediction else target
        target = start - (peak_bytes - budget_bytes)
    return None

