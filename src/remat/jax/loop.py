"""The JAX planner's peak model and closed loop: solve, compile, check against XLA.

NOTE [ JAX peak model ]
    A linear model in the per-block saved bytes, calibrated on the compiled
    un-checkpointed step (peak ``P``, blocks saving ``s_j(none)``): the step's
    memory at the end of its forward, every block's saved bytes alive::

        peak(d) = C + sum_j s_j(d_j),        C = P - sum_j s_j(none)

    (the ``head`` window of the PyTorch peak model, remat/core/peak.py). It reproduces
    ``P`` exactly for ``none``, and it is a *lower bound* of XLA's peak up to the
    tables' error (the chain measures a block's saved bytes within a few KB of
    the whole step): a checkpointed block's backward holds its saved bytes plus
    what it recomputes, so the backward windows can only add to it. On the
    gpt-small plans of docs/jax.md XLA's peak is within 74 KB of it (of
    ~200 MB). The PyTorch model's backward windows, with a block's
    un-checkpointed residuals as its backward working set, overestimated
    checkpointing the last blocks (206.6 MB predicted for a step XLA compiled
    at 178.3 MB), so the solver avoided it. The closed loop absorbs the small
    underestimates (step 2), and the lower bound, with a margin for the
    tables' error, lets it skip manual entries that cannot fit (step 3).

NOTE [ JAX closed loop ]
    1. Solve the peak model for the target, first the budget (``solve`` of the
       shared planner core: least recompute FLOPs, the cost unit being 1 FLOP).
    2. Compile the step with the choice and, side by side (one compile per
       core), the manual menu entries it might lose to (step 3). If XLA's peak
       of the choice exceeds the budget, lower the target by the excess and go
       to 1 (at most ``max_rounds``): steps 1-2 are the shared
       :func:`remat.core.loop.close_loop` (NOTE [ Closed loop ]), the target lowered
       from itself, not from the prediction.
    3. The manual menu is each candidate policy on every block, ``every:2`` and
       ``sqrt``. An entry is compiled when the tables estimate it cheaper than
       the choice (within :meth:`Search.tolerance`) and the peak model's lower
       bound does not exceed the budget by more than
       :data:`_PEAK_MARGIN_PERMILLE`; entries the tables cannot estimate are
       compiled (whichever ``measure=`` made the tables). A manual
       policy that fits has its lower bound under the budget, so every fitting
       entry cheaper than the plan is compiled.
    4. Of all compiled steps whose XLA peak fits, the one with the fewest XLA
       FLOPs wins, so a plan never costs more than a fitting manual policy (up
       to the tables' FLOP error, covered by the tolerance).
    5. Nothing fits: compile the solver's smallest-peak choice and the whole
       menu; still nothing: :class:`BudgetTooSmall` with the lowest peak
       compiled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from flax import nnx

from remat.core.checks import decisions_label
from remat.core.cost import StepCost
from remat.core.loop import close_loop
from remat.core.peak import PeakModel, Window
from remat.core.solver import min_peak_choice
from remat.errors import BudgetTooSmall, current_call, message
from remat.jax.analysis import LossFn, StepAnalysis, analyze_steps
from remat.jax.candidates import JaxCandidate
from remat.jax.measure import state_bytes, tree_bytes
from remat.jax.policies import Policy, strategy_policies
from remat.jax.strategies import apply
from remat.units import format_bytes

_MANUAL = ("every:2", "sqrt")
#: Menu entries estimated up to this many percent of the two steps' estimated recompute
#: above a plan are compiled with it (see :meth:`Search.tolerance`).
_RECOMPUTE_TOLERANCE_PERCENT = 5
#: Menu entries whose lower-bound peak exceeds the budget by more than this many per
#: mille of it are not compiled (NOTE [ JAX closed loop ], step 3).
_PEAK_MARGIN_PERMILLE = 10


def peak_model(tables: Sequence[Sequence[JaxCandidate]], names: Sequence[str],
               base_peak: int) -> PeakModel[JaxCandidate]:
    """The linear peak model of NOTE [ JAX peak model ]: the ``head`` window alone."""
    constant = base_peak - sum(t[0].saved_bytes for t in tables)
    return PeakModel((Window("head", constant, len(tables)),), tuple(tuple(t) for t in tables),
                     tuple(names), int(base_peak))


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

    def run(self, max_rounds: int) -> Trial:
        """Steps 1-4 of NOTE [ JAX closed loop ]: the cheapest fitting trial."""
        if self.base.peak_bytes <= self.budget_bytes:
            return self.base_trial()

        def measure(choice: list[int]) -> int:
            policies = self.policies_of(choice)
            planned = (policies, int(self.pm.predict(choice)))
            # the plan and the manual entries it might lose to, compiled side by side
            self.compile([planned, *self.menu(below=self.estimate(policies))])
            return self.result_of(policies).analysis.peak_bytes

        close_loop(self.pm, self.budget_bytes, measure, max_rounds=max_rounds,
                   tighten_by_prediction=False)
        if not self.fitting():
            self.compile(self.menu(below=None, lowest=True))
        fitting = self.fitting()
        if not fitting:
            raise self.too_small()
        return min(fitting, key=lambda t: (t.analysis.flops, t.analysis.peak_bytes))

    def result_of(self, policies: Sequence[Policy]) -> Trial:
        """The compiled trial of ``policies`` (compiled already)."""
        return next(t for t in self.trials if t.policies == tuple(policies))

    def tolerance(self, *estimates: int) -> int:
        """FLOPs the tables may be off by when comparing steps estimated at ``estimates``.

        :data:`_RECOMPUTE_TOLERANCE_PERCENT` of their estimated recompute: the block
        chain counts up to 2.1% more recompute than the whole step on the test model
        (20 kFLOP per checkpointed block of 0.9 MFLOP), 0.6% on gpt-small.
        """
        recompute = sum(max(0, e - self.base.flops) for e in estimates)
        return recompute * _RECOMPUTE_TOLERANCE_PERCENT // 100

    def base_trial(self) -> Trial:
        return self.trials[0]

    def menu(self, *, below: int | None, lowest: bool = False
             ) -> list[tuple[list[Policy], int | None]]:
        """Manual choices not compiled yet (step 3 of NOTE [ JAX closed loop ]).

        Args:
            below: only entries the tables estimate under these step FLOPs (plus
                :meth:`tolerance`), and those they cannot estimate. None: every entry.
            lowest: add the solver's smallest-peak choice. Default: False.
        """
        out: list[tuple[list[Policy], int | None]] = []
        if lowest:
            choice = min_peak_choice(self.pm)
            out.append((self.policies_of(choice), int(self.pm.predict(choice))))
        n = len(self.paths)
        menu = [[c.policy] * n for c in self.tables[0] if not c.policy.is_none] \
            if all(t == self.tables[0] for t in self.tables) else []
        menu += [strategy_policies(s, n) for s in _MANUAL]
        limit = self.budget_bytes + self.budget_bytes * _PEAK_MARGIN_PERMILLE // 1000
        for policies in menu:
            estimate, predicted = self.estimate(policies), self.predict(policies)
            if below is not None and (
                    estimate is not None and estimate >= below + self.tolerance(below, estimate)
                    or predicted is not None and predicted > limit):
                continue
            out.append((policies, predicted))
        seen = {t.policies for t in self.trials}
        unique = []
        for policies, predicted in out:
            if tuple(policies) not in seen:
                seen.add(tuple(policies))
                unique.append((policies, predicted))
        return unique

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
        param_bytes, buffer_bytes = state_bytes(self.model)
        batch_bytes = tree_bytes(self.batch)
        cost = StepCost(peak_bytes=a.peak_bytes,
                        breakdown=a.breakdown(param_bytes=param_bytes,
                                              buffer_bytes=buffer_bytes, batch_bytes=batch_bytes),
                        param_bytes=param_bytes, buffer_bytes=buffer_bytes,
                        grad_bytes=param_bytes, batch_bytes=batch_bytes, flops=a.flops,
                        recompute_flops=min(a.flops, max(0, a.flops - self.base.flops)))
        return BudgetTooSmall(message(
            current_call("remat.jax.plan"),
            f"no compiled plan fits a budget of {format_bytes(self.budget_bytes)}",
            {"lowest peak": f"{format_bytes(a.peak_bytes)} ({label(low.policies)})",
             "at that peak": f"arguments {format_bytes(a.argument_bytes)}, outputs "
                             f"{format_bytes(a.output_bytes)}, temporaries "
                             f"{format_bytes(a.temp_bytes)}",
             "no checkpointing": format_bytes(self.base.peak_bytes)},
            fix=f"raise the budget to at least {format_bytes(a.peak_bytes)}, or shrink the "
                "batch"),
            budget_bytes=self.budget_bytes, min_peak_bytes=a.peak_bytes, cost=cost,
        )


def label(policies: Sequence[Policy]) -> str:
    """Policy counts in first-use order, e.g. ``"4 none, 2 dots_saveable"``."""
    return decisions_label(p.label() for p in policies)
