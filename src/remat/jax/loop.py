"""The JAX planner's peak model and closed loop: solve, compile, check against XLA.

NOTE [ JAX peak model ]
    A linear model in the per-block saved bytes, calibrated on the compiled
    un-checkpointed step (peak ``P``, blocks saving ``s_j(none)``), with the
    windows of the PyTorch peak model (peak.py)::

        head:   C + sum_j s_j(d_j)                       (end of forward)
        bwd:i:  C + sum_{j<i} s_j(d_j) + s_i(none)       (block i recomputed in backward)

    where ``C = P - sum_j s_j(none)``; the model reproduces ``P`` exactly for
    ``none``. XLA schedules and may rematerialize on its own, so this is only a
    guide for the solver: the closed loop below measures the compiled step.

NOTE [ JAX closed loop ]
    1. Solve the peak model for the budget (``solve`` of the shared planner core:
       least recompute FLOPs, the cost unit being 1 FLOP).
    2. Compile the step with the choice; if XLA's peak exceeds the budget, lower
       the solver's target by the excess and go to 1 (at most ``max_rounds``).
    3. The manual menu (every candidate policy on every block, ``every:2``,
       ``sqrt``): the entries the tables estimate cheaper than the best fitting
       compiled step. With ``exact``, all of them and the solver's smallest-peak
       choice are compiled at once. Otherwise cheapest estimate first, in batches
       of the machine's cores, stopping after a batch in which a step fits (the
       rest is estimated costlier), and the smallest-peak choice only when nothing
       fits yet. The peak model is not used to skip entries: on few blocks it
       overestimates checkpointing every block by up to 35% (the 2-block test
       model), so an entry it predicts over the budget may fit. Of all compiled
       steps whose XLA peak fits, the one with the fewest XLA FLOPs wins, so a
       plan never costs more than a fitting manual policy (up to the tables' FLOP
       error, see :meth:`Search.cheapest_fitting`).
    4. Nothing fits: :class:`BudgetTooSmall` with the lowest peak compiled.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from flax import nnx

from remat.jax._core import (
    BudgetTooSmall,
    PeakModel,
    Window,
    format_bytes,
    make_peak_model,
    min_peak_choice,
    solve,
)
from remat.jax.analysis import LossFn, StepAnalysis, analyze_steps
from remat.jax.candidates import JaxCandidate
from remat.jax.policies import Policy, strategy_policies
from remat.jax.strategies import apply

__all__ = ["Search", "Trial", "label", "peak_model"]

_MANUAL = ("every:2", "sqrt")
#: Menu entries estimated up to this many per mille of the step's FLOPs above the best
#: fitting step are compiled too (see :meth:`Search.cheapest_fitting`).
_FLOPS_TOLERANCE_PERMILLE = 5


def peak_model(tables: Sequence[Sequence[JaxCandidate]], names: Sequence[str],
               base_peak: int) -> PeakModel:
    """The linear peak model of NOTE [ JAX peak model ]."""
    constant = base_peak - sum(t[0].saved_bytes for t in tables)
    windows = [Window("head", constant, len(tables))]
    windows += [Window(f"bwd:{i}", constant, i, i, "backward") for i in range(len(tables))]
    return make_peak_model(windows, tables, names, base_peak)


@dataclass(frozen=True)
class Trial:
    """One compiled choice: the policy per block, XLA's analysis, the model's prediction."""

    policies: tuple[Policy, ...]
    analysis: StepAnalysis
    predicted_peak_bytes: int | None


@dataclass
class Search:
    """The closed loop of NOTE [ JAX closed loop ] over one model, batch and budget."""

    model: nnx.Module
    batch: Any
    loss_fn: LossFn
    paths: list[str]
    tables: list[tuple[JaxCandidate, ...]]
    base: StepAnalysis
    budget_bytes: int

    def __post_init__(self) -> None:
        self.pm = peak_model(self.tables, self.paths, self.base.peak_bytes)
        self.trials = [Trial(tuple(Policy("none") for _ in self.paths), self.base,
                             self.base.peak_bytes)]

    def compile(self, choices: Sequence[tuple[Sequence[Policy], int | None]]) -> None:
        """Compile each ``(policies, predicted)`` (in parallel) and record the trials."""
        def configure(choice: Sequence[Policy]) -> Callable[[], Any]:
            return lambda: apply(self.model, dict(zip(self.paths, choice, strict=True)))

        steps = analyze_steps(self.model, self.batch, [configure(c) for c, _ in choices],
                              loss_fn=self.loss_fn)
        self.trials += [Trial(tuple(c), a, p) for (c, p), a in zip(choices, steps, strict=True)]

    def fitting(self) -> list[Trial]:
        """The compiled trials whose XLA peak fits the budget."""
        return [t for t in self.trials if t.analysis.peak_bytes <= self.budget_bytes]

    def policies_of(self, choice: Sequence[int]) -> list[Policy]:
        return [self.tables[i][c].policy for i, c in enumerate(choice)]

    def run(self, max_rounds: int, *, exact: bool) -> Trial:
        """Steps 1-4 of NOTE [ JAX closed loop ]: the cheapest fitting trial."""
        if self.base.peak_bytes <= self.budget_bytes:
            return self.base_trial()
        target = self.budget_bytes
        for _ in range(max_rounds):
            choice = solve(self.pm, target)
            if choice is None:
                break
            self.compile([(self.policies_of(choice), int(self.pm.predict(choice)))])
            peak = self.trials[-1].analysis.peak_bytes
            if peak <= self.budget_bytes:
                break
            target -= peak - self.budget_bytes
        self.compile_menu(exact=exact)
        fitting = self.fitting()
        if not fitting:
            raise self.too_small()
        return min(fitting, key=lambda t: (t.analysis.flops, t.analysis.peak_bytes))

    def compile_menu(self, *, exact: bool) -> None:
        """Compile the manual menu, cheapest estimate first (step 3 of NOTE [ JAX closed loop ]).

        Entries go in batches of the machine's cores; after a batch in which a step
        fits, the later entries (estimated costlier than it) cannot win, so the rest
        of the menu is not compiled. With ``exact`` every entry is compiled.
        """
        menu = self.menu(exact=exact)
        if not exact:
            menu.sort(key=lambda entry: self.estimate(entry[0]) or 0)
        size = len(menu) if exact else max(1, min(len(menu), os.cpu_count() or 1))
        for start in range(0, len(menu), size):
            self.compile(menu[start:start + size])
            if not exact and self.fitting():
                bar = self.cheapest_fitting()
                menu[start + size:] = [e for e in menu[start + size:]
                                       if bar is None or (self.estimate(e[0]) or 0) < bar]
        if not self.fitting() and not exact:
            self.compile(self.menu(exact=True))

    def cheapest_fitting(self) -> int | None:
        """The fewest FLOPs of a fitting compiled step, plus a tolerance (see below).

        A menu entry estimated below it is worth compiling; the tolerance covers the
        tables' FLOP error (the block chain counts ~40 kFLOP more per checkpointed
        block than the whole step does on the test model): :data:`_FLOPS_TOLERANCE_PERMILLE`
        of the step's FLOPs.
        """
        flops = [t.analysis.flops for t in self.fitting()]
        if not flops:
            return None
        return min(flops) + self.base.flops * _FLOPS_TOLERANCE_PERMILLE // 1000

    def base_trial(self) -> Trial:
        return self.trials[0]

    def menu(self, *, exact: bool) -> list[tuple[list[Policy], int | None]]:
        """The manual choices worth compiling (step 3 of NOTE [ JAX closed loop ])."""
        compiled = {t.policies for t in self.trials}
        out: list[tuple[list[Policy], int | None]] = []
        if exact or not self.fitting():
            lowest = min_peak_choice(self.pm)
            out.append((self.policies_of(lowest), int(self.pm.predict(lowest))))
        n = len(self.paths)
        menu = [[c.policy] * n for c in self.tables[0] if not c.policy.is_none] \
            if all(t == self.tables[0] for t in self.tables) else []
        menu += [strategy_policies(s, n) for s in _MANUAL]
        cheapest = self.cheapest_fitting()
        for policies in menu:
            estimate = self.estimate(policies)
            if cheapest is not None and estimate is not None and estimate >= cheapest:
                continue
            out.append((policies, None))
        return [(c, p) for c, p in out if tuple(c) not in compiled]

    def indices(self, policies: Sequence[Policy]) -> list[int] | None:
        """Each block's table index of its policy (None: a policy not in a table)."""
        choice = []
        for table, policy in zip(self.tables, policies, strict=True):
            index = next((i for i, c in enumerate(table) if c.policy == policy), None)
            if index is None:
                return None
            choice.append(index)
        return choice

    def predict(self, policies: Sequence[Policy]) -> int | None:
        """The peak model's prediction for ``policies`` (None: not in the tables)."""
        choice = self.indices(policies)
        return None if choice is None else int(self.pm.predict(choice))

    def estimate(self, policies: Sequence[Policy]) -> int | None:
        """Step FLOPs the tables predict for ``policies`` (None: not in the tables)."""
        choice = self.indices(policies)
        if choice is None:
            return None
        return self.base.flops + sum(self.tables[i][c].recompute_flops
                                     for i, c in enumerate(choice))

    def predicted(self, trial: Trial) -> int:
        """A trial's predicted peak (its measured one for policies not in the tables)."""
        if trial.predicted_peak_bytes is not None:
            return trial.predicted_peak_bytes
        predicted = self.predict(trial.policies)
        return trial.analysis.peak_bytes if predicted is None else predicted

    def too_small(self) -> BudgetTooSmall:
        """The error when no compiled step fits (step 4 of NOTE [ JAX closed loop ])."""
        low = min(self.trials, key=lambda t: t.analysis.peak_bytes)
        a = low.analysis
        return BudgetTooSmall(
            f"remat.jax.plan: budget {format_bytes(self.budget_bytes)} is below the lowest "
            f"peak any compiled plan reaches, {format_bytes(a.peak_bytes)} "
            f"({label(low.policies)}; arguments {format_bytes(a.argument_bytes)}, "
            f"outputs {format_bytes(a.output_bytes)}, temporaries "
            f"{format_bytes(a.temp_bytes)}; no checkpointing: "
            f"{format_bytes(self.base.peak_bytes)}). Raise the budget to at least "
            f"{format_bytes(a.peak_bytes)}, or shrink the batch.",
            budget_bytes=self.budget_bytes, min_peak_bytes=a.peak_bytes,
            breakdown={"arguments": a.argument_bytes, "outputs": a.output_bytes,
                       "temporaries": a.temp_bytes},
        )


def label(policies: Sequence[Policy]) -> str:
    """Policy counts in first-use order, e.g. ``"4 none, 2 dots_saveable"``."""
    counts: dict[str, int] = {}
    for p in policies:
        counts[p.label()] = counts.get(p.label(), 0) + 1
    return ", ".join(f"{n} {k}" for k, n in counts.items())
