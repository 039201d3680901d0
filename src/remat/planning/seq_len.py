"""The sequence-length search: the longest sequence each strategy, and a plan, fits in a budget.

NOTE [ Sequence-length search ]
    A step's peak never falls as the sequence grows (every activation is a multiple of
    it, attention's quadratically), so for each strategy the sequence lengths that fit
    are a prefix of the candidates ``multiple_of * k``; the search grows then bisects
    until exact (NOTE [ Grow then bisect ] in search.py). A manual strategy fits at a
    length when its measured peak (:func:`remat.profile`, real or simulated) is within
    the budget; the plan fits when :func:`remat.plan` finds one (its closed loop keeps
    the measured peak within the budget). So the answer for each is a pair: the longest
    length that fits and the next candidate, which does not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from remat.blocks import BlocksSpec
from remat.core.budget import Budget, BudgetLike
from remat.core.cost import Category
from remat.devices import DeviceSpec
from remat.errors import BudgetTooSmall, message, names_the_call
from remat.measure.profile import profile_step
from remat.measure.step import LossFn, Step, batch_tensors
from remat.planning.card import card_of, reserved_on_card
from remat.planning.options import PlanOptions
from remat.planning.planner import plan_step
from remat.planning.plans import Plan
from remat.planning.search import largest_fitting
from remat.planning.throughput import search_budget_bytes
from remat.progress import report
from remat.strategies import trial
from remat.strategies.base import Strategy
from remat.strategies.registry import default_strategies
from remat.units import format_bytes

_API = "remat.plan_seq_len"
PLAN = "plan"
"""The row name of the planner's result in :class:`SeqLenResult`."""


@dataclass(frozen=True)
class SeqLenSearch:
    """Which sequence lengths :func:`remat.plan_seq_len` searches, at which batch size.

    The candidates are the multiples of ``multiple_of`` from ``min_seq_len`` to
    ``max_seq_len``; a coarser ``multiple_of`` costs fewer steps (about two per doubling
    of the range) and gives a less precise answer.

    Args:
        batch_size: sequences per micro-batch. Default: 1.
        min_seq_len: the shortest length tried, tokens (a percentage budget refers to
            the un-checkpointed step at this length). Default: 128.
        max_seq_len: the longest length tried, tokens. Default: 32768.
        multiple_of: every length tried is a multiple of this, tokens. Default: 64.

    Example:
        >>> SeqLenSearch(min_seq_len=64, max_seq_len=1024, multiple_of=32).candidates()[:3]
        (64, 96, 128)
    """

    batch_size: int = 1
    min_seq_len: int = 128
    max_seq_len: int = 32768
    multiple_of: int = 64

    def __post_init__(self) -> None:
        for name in ("batch_size", "min_seq_len", "max_seq_len", "multiple_of"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(message("SeqLenSearch", f"{name} must be an int >= 1",
                                         {"found": repr(value)}, fix=f"pass {name} >= 1"))
        if self.first_k > self.last_k:
            raise ValueError(message(
                "SeqLenSearch", "no multiple of multiple_of lies in [min_seq_len, max_seq_len]",
                {"min_seq_len": self.min_seq_len, "max_seq_len": self.max_seq_len,
                 "multiple_of": self.multiple_of},
                fix="widen the range or pass a smaller multiple_of"))

    @property
    def first_k(self) -> int:
        """The smallest candidate, in units of ``multiple_of``."""
        return max(1, -(-self.min_seq_len // self.multiple_of))

    @property
    def last_k(self) -> int:
        """The largest candidate, in units of ``multiple_of``."""
        return self.max_seq_len // self.multiple_of

    def candidates(self) -> tuple[int, ...]:
        """Every length the search may try, tokens, shortest first."""
        return tuple(k * self.multiple_of for k in range(self.first_k, self.last_k + 1))


@dataclass(frozen=True)
class SeqLenRow:
    """The longest sequence one strategy (or the plan) fits in the budget.

    Args:
        strategy: the strategy as a string (``"full"``), or ``"plan"``.
        seq_len: the longest candidate length that fits, tokens; None when not even
            the shortest does.
        peak_bytes: the measured peak at ``seq_len`` (None with it), bytes.
        next_seq_len: the next candidate, which does not fit, tokens; None when
            ``seq_len`` is the longest candidate.
        next_peak_bytes: its peak (for the plan: the smallest peak the planner reached
            there), bytes; None with ``next_seq_len``.
        tried: how many lengths were measured.
    """

    strategy: str
    seq_len: int | None
    peak_bytes: int | None
    next_seq_len: int | None
    next_peak_bytes: int | None
    tried: int

    def __post_init__(self) -> None:
        if (self.seq_len is None) != (self.peak_bytes is None) or (
                (self.next_seq_len is None) != (self.next_peak_bytes is None)):
            raise ValueError(message(f"SeqLenRow({self.strategy!r})",
                                     "each length needs its peak and each peak its length",
                                     {"seq_len": self.seq_len, "peak_bytes": self.peak_bytes,
                                      "next_seq_len": self.next_seq_len,
                                      "next_peak_bytes": self.next_peak_bytes},
                                     fix="pass both or neither"))
        if self.seq_len is None and self.next_seq_len is None:
            raise ValueError(message(f"SeqLenRow({self.strategy!r})",
                                     "a row needs seq_len or next_seq_len",
                                     fix="pass the length that fits or the one that does not"))

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "seq_len": self.seq_len,
                "peak_bytes": self.peak_bytes, "next_seq_len": self.next_seq_len,
                "next_peak_bytes": self.next_peak_bytes, "tried": self.tried}


@dataclass(frozen=True)
class SeqLenResult:
    """What :func:`remat.plan_seq_len` found: the longest sequence per strategy and the plan.

    Args:
        budget_bytes: the budget every row was checked against, bytes.
        search: the lengths searched and the batch size.
        rows: one per strategy, in the order asked, then ``"plan"`` when planned.
        plan: the plan at the plan row's ``seq_len`` (None when no plan was asked or
            none fits at ``min_seq_len``).

    Example:
        >>> result.longest("full"), result.plan.measured_peak_bytes <= result.budget_bytes
        (1536, True)
    """

    budget_bytes: int
    search: SeqLenSearch
    rows: tuple[SeqLenRow, ...]
    plan: Plan | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        names = [r.strategy for r in self.rows]
        if len(set(names)) != len(names):
            raise ValueError(message("SeqLenResult", "two rows for one strategy",
                                     {"rows": ", ".join(names)}, fix="pass one row each"))

    def row(self, strategy: str) -> SeqLenRow:
        """The row of ``strategy`` (``"plan"`` for the plan); KeyError naming the rows."""
        for r in self.rows:
            if r.strategy == strategy:
                return r
        raise KeyError(message("SeqLenResult.row", f"no row {strategy!r}",
                               {"rows": ", ".join(r.strategy for r in self.rows)},
                               fix="ask for one of the rows"))

    def longest(self, strategy: str) -> int | None:
        """The longest sequence ``strategy`` fits, tokens (None: not even the shortest)."""
        return self.row(strategy).seq_len

    def to_dict(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "batch_size": self.search.batch_size,
                "min_seq_len": self.search.min_seq_len,
                "max_seq_len": self.search.max_seq_len,
                "multiple_of": self.search.multiple_of,
                "rows": [r.to_dict() for r in self.rows],
                "plan": self.plan.to_dict() if self.plan is not None else None}


@dataclass
class _Lengths:
    """One strategy's search: the lengths tried and what each gave."""

    name: str
    peak_at: Callable[[int], tuple[bool, int]]  # seq_len -> (fits, peak bytes)
    multiple_of: int
    progress: Callable[[str], None]
    peaks: dict[int, tuple[bool, int]] = field(default_factory=dict)

    def fits(self, k: int) -> bool:
        seq_len = k * self.multiple_of
        if seq_len not in self.peaks:
            self.progress(f"{self.name}: seq {seq_len}")
            self.peaks[seq_len] = self.peak_at(seq_len)
        return self.peaks[seq_len][0]

    def row(self, search: SeqLenSearch) -> SeqLenRow:
        bracket = largest_fitting(self.fits, first=search.first_k, last=search.last_k)
        fits = bracket.fits * self.multiple_of if bracket.fits else None
        fails = bracket.fails * self.multiple_of if bracket.fails is not None else None
        return SeqLenRow(self.name, fits, self.peaks[fits][1] if fits else None,
                         fails, self.peaks[fails][1] if fails else None, len(self.peaks))


def _check_make_batch(make_batch: Callable[[int, int], Any], search: SeqLenSearch) -> None:
    """Refuse a ``make_batch`` whose batches do not grow with ``seq_len``."""
    short, long = search.first_k * search.multiple_of, (search.first_k + 1) * search.multiple_of
    if long > search.max_seq_len:
        return  # one candidate: nothing to compare
    shapes = [[tuple(t.shape) for t in batch_tensors(make_batch(search.batch_size, s))]
              for s in (short, long)]
    if shapes[0] == shapes[1]:
        raise ValueError(message(
            _API, "make_batch ignores seq_len: its batches have the same shapes at two lengths",
            {f"make_batch({search.batch_size}, {short})": shapes[0],
             f"make_batch({search.batch_size}, {long})": shapes[1]},
            fix="return seq_len tokens per sequence, e.g. make_batch=lambda b, s: "
                "remat.models.make_batch(model, b, seq_len=s)"))


def _nothing_fits(result: SeqLenResult, smallest: tuple[int, dict[Category, int]]) -> None:
    raise BudgetTooSmall(
        message(_API, f"nothing fits {format_bytes(result.budget_bytes)} at the shortest "
                      f"sequence, {result.search.first_k * result.search.multiple_of} tokens",
                {"smallest peak": format_bytes(smallest[0]),
                 "tried": ", ".join(r.strategy for r in result.rows),
                 **{f"  {k.value}": format_bytes(v) for k, v in smallest[1].items()}},
                fix="raise the budget, shorten min_seq_len or lower the batch size"),
        budget_bytes=result.budget_bytes, min_peak_bytes=smallest[0], breakdown=smallest[1])


@names_the_call(_API)
def plan_seq_len(
    model: nn.Module,
    make_batch: Callable[[int, int], Any],
    *,
    budget: BudgetLike | Budget,
    search: SeqLenSearch | None = None,
    strategies: Sequence[str | Strategy] | None = None,
    plan: bool = True,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    blocks: BlocksSpec = None,
    simulate: bool = False,
    device: str | DeviceSpec | None = None,
    cost: str = "auto",
) -> SeqLenResult:
    """The longest sequence each strategy, and a plan, fits in ``budget``.

    For each strategy, sequence lengths are measured (one step each, real or simulated)
    growing then bisecting until the longest that fits is known exactly: the peak fits
    at it and not at the next candidate (NOTE [ Sequence-length search ]). With
    ``plan=True`` the planner runs at each length tried (a plan fits or raises
    BudgetTooSmall), so a plan usually reaches furthest, at the price of a plan per
    length (about two per doubling of the range). The model is left as it was.

    Args:
        model: the model, in train mode, built for the longest length tried (a learned
            position table must hold ``search.max_seq_len``).
        make_batch: ``(batch_size, seq_len) -> batch`` of that many sequences of that many
            tokens.
        budget: the whole step's peak: bytes, ``"12GiB"``, or ``"60%"`` of the
            un-checkpointed peak at ``search.min_seq_len``.
        search: the lengths and batch size (:class:`SeqLenSearch`).
            Default: ``SeqLenSearch()`` (batch 1, 128 to 32768 tokens in steps of 64).
        strategies: the manual strategies to search. Default: the built-ins ``remat
            simulate`` shows (``none``, ``full``, ``every:2``, ``sqrt``, ``attn``, ``mlp``,
            ``ops``).
        plan: also search the planner's plan. Default: ``True``.
        loss_fn, optimizer, blocks, simulate, device, cost: as for :func:`remat.plan`.

    Returns:
        A :class:`SeqLenResult`: a row per strategy (and ``"plan"``) and the plan at the
        longest length it reaches.

    Raises:
        BudgetTooSmall: nothing fits at the shortest length; the smallest peak and what
            fills it are in the message.
        ValueError: ``make_batch`` ignores ``seq_len``, or a bad budget or strategy.
        TypeError: ``make_batch`` is not a function.

    Example:
        >>> from remat.models import build_model, make_batch
        >>> model = build_model("gpt-tiny", max_seq_len=2048)
        >>> result = remat.plan_seq_len(
        ...     model, lambda b, s: make_batch(model, b, seq_len=s), budget="40MiB",
        ...     search=SeqLenSearch(min_seq_len=64, max_seq_len=2048, multiple_of=64))
        >>> result.longest("full") >= result.longest("none")
        True
    """
    if not callable(make_batch) or isinstance(make_batch, (Tensor, dict, tuple, list)):
        raise TypeError(message(_API, "make_batch must be a function (batch_size, seq_len) "
                                      "-> batch", {"found": type(make_batch).__name__},
                                fix="pass e.g. make_batch=lambda b, s: "
                                    "remat.models.make_batch(model, b, seq_len=s)"))
    search = search or SeqLenSearch()
    _check_make_batch(make_batch, search)
    names = [str(s) for s in strategies] if strategies is not None else (
        default_strategies("simulate"))
    options = PlanOptions(budget=budget, simulate=simulate,  # type: ignore[arg-type]
                          device=device, cost=cost)
    step = Step(model, make_batch(search.batch_size, search.min_seq_len), loss_fn=loss_fn,
                optimizer=optimizer, blocks=blocks)
    budget_bytes = search_budget_bytes(
        step, options, lambda: make_batch(search.batch_size, search.min_seq_len))
    card = card_of(step, options) if options.budget.is_device else None
    if card is None:
        options = options.with_budget(budget_bytes)
    total = (len(names) + plan) * (2 * max(1, (search.last_k // search.first_k)).bit_length() + 1)
    done = 0
    smallest: list[tuple[int, dict[Category, int]]] = []

    def progress(what: str) -> None:
        nonlocal done
        report(what, min(done, total - 1), total)
        done += 1

    def strategy_peak(name: str) -> Callable[[int], tuple[bool, int]]:
        def peak_at(seq_len: int) -> tuple[bool, int]:
            with trial(model, name, blocks=blocks, quiet=False):
                prof = profile_step(step.with_batch(make_batch(search.batch_size, seq_len)),
                                    simulate=simulate, timing=False, allocator=False)
            if seq_len == search.first_k * search.multiple_of:
                smallest.append((prof.peak_bytes, dict(prof.peak_breakdown)))
            peak = prof.peak_bytes if card is None else reserved_on_card(card, prof)
            return peak <= budget_bytes, peak
        return peak_at

    plans: dict[int, Plan] = {}

    def plan_peak(seq_len: int) -> tuple[bool, int]:
        try:
            found = plan_step(step.with_batch(make_batch(search.batch_size, seq_len)), options)
        except BudgetTooSmall as exc:
            if seq_len == search.first_k * search.multiple_of:
                smallest.append((exc.min_peak_bytes, exc.breakdown))
            return False, exc.min_peak_bytes
        plans[seq_len] = replace(found, batch_size=search.batch_size)
        if found.reserved_peak_bytes is not None:
            return True, found.reserved_peak_bytes
        return True, found.measured_or_predicted_peak_bytes

    searches = [_Lengths(n, strategy_peak(n), search.multiple_of, progress) for n in names]
    if plan:
        searches.append(_Lengths(PLAN, plan_peak, search.multiple_of, progress))
    rows = tuple(s.row(search) for s in searches)
    report("done", total, total)
    planned = rows[-1].seq_len if plan else None
    result = SeqLenResult(budget_bytes, search, rows,
                          plans[planned] if planned is not None else None)
    if all(r.seq_len is None for r in rows):
        _nothing_fits(result, min(smallest, key=lambda s: s[0]))
    return result
