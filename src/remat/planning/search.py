"""The search shared by the batch-size and sequence-length searches: the largest size that fits.

NOTE [ Grow then bisect ]
    Fitting is monotone in the size searched (a larger batch or a longer sequence never
    lowers a step's peak), so the sizes that fit are a prefix of the candidates. The
    search tries ``first, 2*first, 4*first, ...`` until one does not fit (or ``last`` is
    passed), then bisects between the largest that fits and the smallest that does not.
    Bisection stops after ``refine_steps`` halvings (the throughput search: its winner is
    rarely the largest size, so a few steps suffice) or, with ``refine_steps=None``, when
    the two are neighbours: the answer is then exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from remat.errors import message


@dataclass(frozen=True)
class Bracket:
    """Where a grow-then-bisect search ended.

    Args:
        fits: the largest size tried that fits, or 0 when ``first`` does not fit.
        fails: the smallest size tried that does not fit above ``fits``, or None when
            every size tried up to ``last`` fits.
    """

    fits: int
    fails: int | None


def largest_fitting(fits: Callable[[int], bool], *, first: int, last: int,
                    refine_steps: int | None = None) -> Bracket:
    """The largest ``k`` in ``[first, last]`` with ``fits(k)`` (NOTE [ Grow then bisect ]).

    Args:
        fits: ``k -> bool``, monotone (true up to some k, false after); called at most
            once per k by this function (callers cache if they call it themselves).
        first: the smallest size, >= 1.
        last: the largest size, >= ``first``.
        refine_steps: bisection steps after growing; ``None`` bisects until exact.
            Default: ``None``.

    Example:
        >>> largest_fitting(lambda k: k <= 37, first=1, last=100)
        Bracket(fits=37, fails=38)
    """
    if not 1 <= first <= last:
        raise ValueError(message("largest_fitting", "need 1 <= first <= last",
                                 {"first": first, "last": last}, fix="pass a non-empty range"))
    k, low, high = first, 0, None
    while k <= last:
        if not fits(k):
            high = k
            break
        low, k = k, k * 2
    if high is None and low < last:
        high = last + 1  # beyond the range: never tried, counts as not fitting
    steps = 0
    while (high is not None and low > 0 and high - low > 1
           and (refine_steps is None or steps < refine_steps)):
        steps += 1
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    if high is not None and high > last:
        high = None
    return Bracket(low, high)
