"""Plan ``jax.checkpoint`` policies per block for a byte budget, checked against XLA.

NOTE [ JAX candidates ]
    For each kind of block (same class, parameter shapes and input shapes; one
    representative is measured, the blocks being identical) the candidate
    policies are ``none``, ``nothing_saveable``, ``dots_saveable``,
    ``dots_with_no_batch_dims_saveable``, ``save_only_these_names`` with each
    name tagged in the block (``checkpoint_name``) alone and with all of them,
    plus any ``policies=`` given. Policies whose residuals (JAX's residual
    inspection of the block alone) have the same size as an earlier one are
    skipped. Each remaining policy is measured by XLA: the whole step is compiled
    with the representative block under it and every other block ``none``
    (compilations in parallel); its recompute is the step's extra FLOPs
    (``cost_analysis``), its saved bytes the block's un-checkpointed residuals
    minus what XLA's peak dropped by. Candidates with no fewer saved bytes and no
    fewer FLOPs than another are dropped.

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
    3. Compile the manual menu too (every candidate policy on every block,
       ``every:2``, ``sqrt``) and the solver's smallest-peak choice; of all
       compiled steps whose XLA peak fits, return the one with the fewest XLA
       FLOPs. So the plan never costs more than the best fitting manual policy.
    4. Nothing fits: :class:`BudgetTooSmall` with the lowest peak compiled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from flax import nnx

from remat.jax._core import (
    BudgetLike,
    BudgetTooSmall,
    Window,
    format_bytes,
    make_peak_model,
    min_peak_choice,
    parse_budget,
    solve,
)
from remat.jax.blocks import BlocksSpec, named_blocks
from remat.jax.measure import (
    LossFn,
    StepAnalysis,
    analyze_step,
    analyze_steps,
    block_inputs,
    block_saved_bytes,
    default_loss,
    tagged_names,
)
from remat.jax.plans import Plan
from remat.jax.strategies import (
    Policy,
    _set,
    apply,
    current_policies,
    parse_policy,
    remove,
    strategy_policies,
)

__all__ = ["JaxCandidate", "auto", "candidate_tables", "plan", "plan_preset"]

_API = "remat.jax.plan"
_MANUAL = ("every:2", "sqrt")


@dataclass(frozen=True)
class JaxCandidate:
    """One policy for one kind of block, measured (see NOTE [ JAX candidates ]).

    Args:
        policy: the policy.
        saved_bytes: residual bytes the block keeps for backward under it.
        backward_peak_bytes: the block's working set when its backward runs
            (its un-checkpointed residuals, recomputed or kept).
        recompute_flops: extra XLA FLOPs of the block's forward+backward.
        forward_peak_bytes: unused by the JAX peak model. Default: 0.
    """

    policy: Policy
    saved_bytes: int
    backward_peak_bytes: int
    recompute_flops: int
    forward_peak_bytes: int = 0

    def __post_init__(self) -> None:
        for key in ("saved_bytes", "backward_peak_bytes", "recompute_flops",
                    "forward_peak_bytes"):
            if getattr(self, key) < 0:
                raise ValueError(f"JaxCandidate({self.label()}): {key} must be >= 0, "
                                 f"got {getattr(self, key)}")

    @property
    def recompute_ms(self) -> float:
        """The solver's cost: ``recompute_flops * 1e-9``, so its integer cost is the FLOPs."""
        return self.recompute_flops * 1e-9

    def label(self) -> str:
        """The policy's label."""
        return self.policy.label()


def _with_policy(block: nnx.Module, policy: Policy) -> nnx.Module:
    copy = nnx.merge(*nnx.split(block))
    remove(copy)
    _set(copy, policy)
    return copy


def _kind_key(block: nnx.Module, inputs: Any) -> Any:
    base = getattr(type(block), "_remat_original", None) or type(block)
    shapes = jax.tree.map(lambda a: (a.shape, str(a.dtype)), nnx.state(block))
    return base, repr(shapes), repr(inputs)


def candidate_tables(model: nnx.Module, batch: Any, *, loss_fn: LossFn | None = None,
                     blocks: BlocksSpec = None, policies: Sequence[str | Policy] = (),
                     prune: bool = True) -> dict[str, tuple[JaxCandidate, ...]]:
    """Each block's measured candidates, ``none`` first (NOTE [ JAX candidates ]).

    The model's own policies are ignored (and left as they were).

    Example:
        >>> tables = candidate_tables(model, batch)
        >>> [c.label() for c in tables["blocks.0"]][:2]
        ['none', 'nothing_saveable']
    """
    fn = default_loss if loss_fn is None else loss_fn
    named = named_blocks(model, blocks)
    paths = [p for p, _ in named]
    before = current_policies(model, paths)
    try:
        remove(model)
        base = analyze_step(model, batch, loss_fn=fn)
        inputs = block_inputs(model, batch, paths, fn)
        by_kind: dict[Any, tuple[JaxCandidate, ...]] = {}
        out: dict[str, tuple[JaxCandidate, ...]] = {}
        for path, block in named:
            key = _kind_key(block, inputs[path])
            if key not in by_kind:
                by_kind[key] = _measure_kind(model, batch, fn, path, block, inputs[path],
                                             base, policies, prune)
            out[path] = by_kind[key]
        return out
    finally:
        apply(model, dict(zip(paths, before, strict=True)))


def _measure_kind(model: nnx.Module, batch: Any, fn: LossFn, path: str, block: nnx.Module,
                  inputs: Any, base: StepAnalysis, policies: Sequence[str | Policy],
                  prune: bool) -> tuple[JaxCandidate, ...]:
    names = tagged_names(block, inputs)
    wanted = [Policy("nothing_saveable"), Policy("dots_saveable"),
              Policy("dots_with_no_batch_dims_saveable")]
    wanted += [Policy("save_only_these_names", (n,)) for n in names]
    if len(names) > 1:
        wanted.append(Policy("save_only_these_names", names))
    wanted += [parse_policy(p) for p in policies]
    none_saved = block_saved_bytes(block, inputs)
    table = [JaxCandidate(Policy("none"), none_saved, none_saved, 0)]
    seen_saved = {none_saved}
    measured: list[Policy] = []
    for policy in dict.fromkeys(wanted):
        saved = block_saved_bytes(_with_policy(block, policy), inputs)
        if prune and saved in seen_saved:  # the same residuals: the same step
            continue
        seen_saved.add(saved)
        measured.append(policy)

    def configure(policy: Policy) -> Callable[[], Any]:
        return lambda: apply(model, {path: policy})

    steps = analyze_steps(model, batch, [configure(p) for p in measured], loss_fn=fn)
    remove(model)
    for policy, step in zip(measured, steps, strict=True):
        # XLA's own saving for this block: what the peak dropped by (NOTE [ JAX peak model ]).
        measured_saved = max(0, none_saved - (base.peak_bytes - step.peak_bytes))
        table.append(JaxCandidate(policy, measured_saved, none_saved,
                                  max(0, step.flops - base.flops)))
    return tuple(_prune(table) if prune else table)


def _prune(table: Sequence[JaxCandidate]) -> list[JaxCandidate]:
    kept: list[JaxCandidate] = []
    for i, c in enumerate(table):
        dominated = any(
            o.saved_bytes <= c.saved_bytes and o.recompute_flops <= c.recompute_flops
            and (o.saved_bytes, o.recompute_flops, j) < (c.saved_bytes, c.recompute_flops, i)
            for j, o in enumerate(table) if j != i
        )
        if i == 0 or not dominated:
            kept.append(c)
    return kept


def _peak_model(tables: Sequence[Sequence[JaxCandidate]], names: Sequence[str],
                base_peak: int) -> Any:
    constant = base_peak - sum(t[0].saved_bytes for t in tables)
    windows = [Window("head", constant, len(tables))]
    windows += [Window(f"bwd:{i}", constant, i, i, "backward") for i in range(len(tables))]
    return make_peak_model(windows, tables, names, base_peak)


@dataclass(frozen=True)
class _Trial:
    policies: tuple[Policy, ...]
    analysis: StepAnalysis
    predicted_peak_bytes: int | None


def plan(model: nnx.Module, batch: Any, *, budget: BudgetLike, loss_fn: LossFn | None = None,
         blocks: BlocksSpec = None, policies: Sequence[str | Policy] = (),
         max_rounds: int = 6) -> Plan:
    """The per-block policies with the fewest recompute FLOPs whose XLA peak fits ``budget``.

    Trades compute for memory like :func:`remat.plan`: candidates are measured per
    kind of block, a linear peak model is solved exactly (the shared MILP solver),
    and a closed loop compiles the chosen plan until XLA's peak fits
    (NOTE [ JAX closed loop ]). The model is left as it was.

    Args:
        model: a Flax NNX module with repeated blocks.
        batch: its batch.
        budget: bytes (int), ``"12GiB"``, or ``"60%"`` of the un-checkpointed XLA peak.
        loss_fn: ``loss_fn(model, batch) -> scalar``. Default: the model returns its loss.
        blocks: which modules are blocks. Default: automatic.
        policies: extra candidate policies, e.g. ``["offload:qkv"]``. Default: none.
        max_rounds: solver/compile rounds before falling back to the manual menu.
            Default: 6.

    Returns:
        A :class:`~remat.jax.Plan` with ``measured_peak_bytes <= budget_bytes``.

    Raises:
        BudgetTooSmall: no compiled plan fits; carries the lowest peak reached.
        ValueError: the budget cannot be read.

    Example:
        >>> p = plan(model, batch, budget="50%")
        >>> p.measured_peak_bytes <= p.budget_bytes
        True
    """
    fn = default_loss if loss_fn is None else loss_fn
    parsed = parse_budget(budget)
    named = named_blocks(model, blocks)
    paths = [p for p, _ in named]
    before = current_policies(model, paths)
    try:
        remove(model)
        base = analyze_step(model, batch, loss_fn=fn)
        budget_bytes = parsed.resolve(base.peak_bytes)
        by_path = candidate_tables(model, batch, loss_fn=fn, blocks=paths, policies=policies)
        tables = [by_path[p] for p in paths]
        pm = _peak_model(tables, paths, base.peak_bytes)

        def trial(choice: Sequence[Policy], predicted: int | None) -> _Trial:
            apply(model, dict(zip(paths, choice, strict=True)))
            return _Trial(tuple(choice), analyze_step(model, batch, loss_fn=fn), predicted)

        trials: list[_Trial] = [_Trial(tuple(Policy("none") for _ in paths), base,
                                       base.peak_bytes)]
        target = budget_bytes
        for _ in range(max_rounds):
            if base.peak_bytes <= budget_bytes:
                break
            choice = solve(pm, target)
            if choice is None:
                break
            t = trial([tables[i][c].policy for i, c in enumerate(choice)], pm.predict(choice))
            trials.append(t)
            if t.analysis.peak_bytes <= budget_bytes:
                break
            target -= t.analysis.peak_bytes - budget_bytes
        if base.peak_bytes > budget_bytes:
            lowest = min_peak_choice(pm)
            extra: list[tuple[list[Policy], int | None]] = [
                ([tables[i][c].policy for i, c in enumerate(lowest)], pm.predict(lowest))]
            menu = [[c.policy] * len(paths) for c in tables[0] if not c.policy.is_none] \
                if all(t == tables[0] for t in tables) else []
            menu += [strategy_policies(s, len(paths)) for s in _MANUAL]
            fits = [t.analysis.flops for t in trials if t.analysis.peak_bytes <= budget_bytes]
            cheapest = min(fits, default=None)
            for choice_policies in menu:
                estimate = _estimate_flops(tables, choice_policies, base.flops)
                if cheapest is None or estimate is None or estimate < cheapest:
                    extra.append((choice_policies, None))

            def configure(choice: Sequence[Policy]) -> Callable[[], Any]:
                return lambda: apply(model, dict(zip(paths, choice, strict=True)))

            steps = analyze_steps(model, batch, [configure(c) for c, _ in extra], loss_fn=fn)
            trials += [_Trial(tuple(c), a, predicted)
                       for (c, predicted), a in zip(extra, steps, strict=True)]
        fitting = [t for t in trials if t.analysis.peak_bytes <= budget_bytes]
        if not fitting:
            low = min(trials, key=lambda t: t.analysis.peak_bytes)
            a = low.analysis
            raise BudgetTooSmall(
                f"{_API}: budget {format_bytes(budget_bytes)} ({parsed}) is below the lowest "
                f"peak any compiled plan reaches, {format_bytes(a.peak_bytes)} "
                f"({_label(low.policies)}; arguments {format_bytes(a.argument_bytes)}, "
                f"outputs {format_bytes(a.output_bytes)}, temporaries "
                f"{format_bytes(a.temp_bytes)}; no checkpointing: "
                f"{format_bytes(base.peak_bytes)}). Raise the budget to at least "
                f"{format_bytes(a.peak_bytes)}, or shrink the batch.",
                budget_bytes=budget_bytes, min_peak_bytes=a.peak_bytes,
                breakdown={"arguments": a.argument_bytes, "outputs": a.output_bytes,
                           "temporaries": a.temp_bytes},
            )
        best = min(fitting, key=lambda t: (t.analysis.flops, t.analysis.peak_bytes))
        return Plan(
            decisions=dict(zip(paths, best.policies, strict=True)),
            block_names=tuple(paths),
            budget_bytes=budget_bytes,
            predicted_peak_bytes=_predicted(pm, tables, best),
            measured_peak_bytes=best.analysis.peak_bytes,
            recompute_flops=max(0, best.analysis.flops - base.flops),
            no_checkpoint_peak_bytes=base.peak_bytes,
            batch_size=_batch_size(batch),
            backend=jax.default_backend(),
        )
    finally:
        apply(model, dict(zip(paths, before, strict=True)))


def _label(policies: Sequence[Policy]) -> str:
    counts: dict[str, int] = {}
    for p in policies:
        counts[p.label()] = counts.get(p.label(), 0) + 1
    return ", ".join(f"{n} {k}" for k, n in counts.items())


def _predicted(pm: Any, tables: Sequence[Sequence[JaxCandidate]], trial: _Trial) -> int:
    if trial.predicted_peak_bytes is not None:
        return trial.predicted_peak_bytes
    choice = []
    for table, policy in zip(tables, trial.policies, strict=True):
        index = next((i for i, c in enumerate(table) if c.policy == policy), None)
        if index is None:  # a policy pruned from the table: report the measured peak
            return trial.analysis.peak_bytes
        choice.append(index)
    return int(pm.predict(choice))


def _estimate_flops(tables: Sequence[Sequence[JaxCandidate]], policies: Sequence[Policy],
                    base_flops: int) -> int | None:
    """Step FLOPs the tables predict for ``policies`` (None: a policy not in a table)."""
    total = base_flops
    for table, policy in zip(tables, policies, strict=True):
        match = next((c for c in table if c.policy == policy), None)
        if match is None:
            return None
        total += match.recompute_flops
    return total


def _batch_size(batch: Any) -> int | None:
    leaves = [x for x in jax.tree.leaves(batch) if getattr(x, "ndim", 0) >= 1]
    return int(leaves[0].shape[0]) if leaves else None


def auto(model: nnx.Module, batch: Any, *, budget: BudgetLike, loss_fn: LossFn | None = None,
         blocks: BlocksSpec = None, policies: Sequence[str | Policy] = ()) -> Plan:
    """:func:`plan`, then :func:`~remat.jax.apply` the plan to ``model``; returns the plan.

    Example:
        >>> p = auto(model, batch, budget="50%")
        >>> decisions_of(model) == {n: d.label() for n, d in p.decisions.items()}
        True
    """
    result = plan(model, batch, budget=budget, loss_fn=loss_fn, blocks=blocks,
                  policies=policies)
    apply(model, result)
    return result




def plan_preset(preset: str = "gpt-small", *, budget: BudgetLike, batch_size: int = 8,
                seq_len: int | None = None) -> Plan:
    """:func:`plan` for a built-in NNX preset and its random batch (``remat plan --framework jax``).

    Example:
        >>> plan_preset("gpt-tiny", budget="60%", batch_size=2).framework
        'jax'
    """
    from remat.jax.models import build_model, make_batch

    return plan(build_model(preset), make_batch(preset, batch_size, seq_len), budget=budget)
