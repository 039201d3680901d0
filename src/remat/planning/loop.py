"""The closed loop: solve, measure the choice on the model, tighten until it fits.

Step 4 of NOTE [ How a plan is made ] (planner.py).

NOTE [ Closed loop on the fake copy ]
    On CPU a fake step's bytes are a real step's bytes, exactly (tests/measure), and
    with ``simulate=True`` the closed loop is fake anyway. There each choice is measured
    on the context's fake copy, which the windows step left warm (optimizer state
    created): one tracked fake step, where :func:`remat.profile` would copy the model
    again and run a warm-up step, and a real CPU step would compute every FLOP twice.
    Anything the fake copy
    cannot run (a data-dependent shape, say) falls back to the measured step.

NOTE [ Fits on the allocator ]
    The tracker counts every storage the step's ops create, but kernels also allocate
    scratch the dispatcher never sees (the CPU flash-attention backward's per-thread
    buffers, growing with sequence length; CUDA workspaces and 512-byte rounding). A
    plan whose tracked peak sits within those bytes of the budget is over it on the
    allocator. So when a real (not simulated) step's tracked peak fits, the loop runs
    the step once more for real with the choice applied and reads the allocator
    (:func:`~remat.measure.profile.allocator_step_peak`); the choice's peak is the
    higher of the two. Over by ``d`` there, the next round asks the solver for ``d``
    bytes less, like any other miss (NOTE [ Closed loop ]). That costs the first steps
    and one steady step per fitting choice (typically one or two choices per plan; where
    the choice is measured on the real model, the new job's first step is the tracked
    step's warm-up: NOTE [ Closed loop on the real model ]), and
    makes "fits" mean what the device's allocator says, from the first step on:
    ``Plan.allocator_peak_bytes <= Plan.budget_bytes``.

NOTE [ Closed loop on the real model ]
    On CPU a choice can be measured by a tracked step of the real model after an untracked
    warm-up, as :func:`remat.profile` measures it (the same bytes as the fake copy's, NOTE [
    Closed loop on the fake copy ]), when that is cheaper than a tracked step of the fake
    copy (:func:`measure_on_cpu`). The warm-up is the first step of a new job, read by the
    allocator (NOTE [ The first step ] in measure/profile.py: the choice freshly applied,
    the optimizer as the user passed it), so it costs the profiler's overhead rather than a
    step. Where the tracked peak fits, the rest of the allocator's check runs on the same
    model: with an optimizer, the first step of a resumed job (the state restored to what
    the first step left, the choice applied anew), then a steady step; a choice over the
    budget costs no more steps. The steps see the parameters, optimizer state and RNG that
    separate checks would (each snapshot restored), so the bytes read are the same. Which
    copy is cheaper is decided from
    the work of the step, never from the clock (the same plan on an idle and on a loaded
    machine): the windows step's op count (``FakeSetup.step_ops``) prices a fake tracked
    step, and a real one costs ``_TRACKED_COST`` untracked steps of that many ops and three
    times the blocks' forward FLOPs (forward, and backward at twice the forward), priced by
    NOTE [ Pricing a fake and a real copy ] in copy_cost.py; they only decide speed, since
    both measure the same bytes. For a small model (a 32-layer, d=128 decoder) a real step
    costs a fifth of a fake one and the closed loop's measuring halves; for a large one the
    fake copy stays the cheaper.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from remat.card_fit import CardBudget
from remat.core.allocator_settings import AllocatorSettings
from remat.core.budget import Budget
from remat.core.checks import decisions_label
from remat.core.cost import Category, StepCost
from remat.core.loop import close_loop as close_loop_core
from remat.core.results import Profile
from remat.core.solver import min_peak_choice
from remat.errors import BudgetTooSmall, message
from remat.measure.profile import (
    allocator_step_peak,
    first_step_peak,
    profile_from_tracked,
    profile_step,
)
from remat.measure.state import preserved_state
from remat.measure.step import Step, clear_grads, model_device
from remat.measure.timing import time_step
from remat.measure.tracked_step import tracked_step
from remat.measure.windows import FakeSetup
from remat.planning.candidates import Candidate
from remat.planning.card import reserved_on_card
from remat.planning.context import PlanContext
from remat.planning.copy_cost import fake_seconds, in_process_group, real_seconds
from remat.planning.manual import manual_options
from remat.planning.plans import Plan
from remat.planning.recompute_cost import recompute_ms, step_ms
from remat.progress import report
from remat.strategies import BlockStrategy, apply_decisions, trial
from remat.strategies.builtin import Full
from remat.units import format_bytes

_MAX_ROUNDS = 6
#: A tracked real step's cost in untracked ones (NOTE [ Closed loop on the real model ]).
_TRACKED_COST = 1.5
_KIND_NAMES: dict[str, str] = {
    Category.PARAMETERS: "parameters", Category.GRADIENTS: "gradients",
    Category.OPTIMIZER_STATE: "optimizer state", Category.BATCH: "batch",
    Category.BUFFERS: "buffers", Category.ACTIVATIONS: "activations",
    Category.RECOMPUTED: "recomputed activations",
    Category.BACKWARD_TEMPORARIES: "backward temporaries",
    Category.OPTIMIZER_TEMPORARIES: "optimizer temporaries", Category.OTHER: "other tensors",
}


def measure_decisions(step: Step, decisions: Mapping[str, BlockStrategy], *,
                      simulate: bool = False, timing: bool = False) -> Profile:
    """Profile one step with ``decisions`` applied, then restore the model.

    Args:
        step: the step (model, batch, loss, optimizer, blocks).
        decisions: per block name, its decision (others: ``"none"``).
        simulate: on fake tensors. Default: False.
        timing: also time the step (real runs only). Default: False.
    """
    with trial(step.model, decisions, blocks=step.blocks):
        return profile_step(step, simulate=simulate, timing=timing and not simulate, repeats=3)


def allocator_peak_of(step: Step, decisions: Mapping[str, BlockStrategy], prof: Profile,
                      first_bytes: int | None = None) -> int:
    """The allocator's peak of a real step with ``decisions`` applied (NOTE [ Fits on
    the allocator ]), with the bytes ``prof`` counts at the step's start added: the higher
    of the first step after apply and a steady step (NOTE [ The first step ] in
    measure/profile.py); the model is restored. 0 where no allocator is read (a device
    other than CPU or CUDA). ``first_bytes``: the caller applied ``decisions``, measured
    the first step (that peak) and restores the model; only the steady step runs.
    """
    if step.device.type not in ("cpu", "cuda"):
        return 0
    start = prof.param_bytes + prof.buffer_bytes + prof.optimizer_bytes + prof.batch_bytes
    if first_bytes is not None:
        return max(first_bytes, allocator_step_peak(step, start))
    return fresh_allocator_peak(step, decisions, start)


def fresh_allocator_peak(step: Step, decisions: Mapping[str, BlockStrategy],
                         start_bytes: int) -> int:
    """The allocator's peak with ``decisions`` freshly applied, ``start_bytes`` alive
    before the step: the higher of the first steps after apply (:func:`first_steps_peak`)
    and a steady step. The model, its optimizer and its strategy are restored."""
    model = step.model
    with trial(model, within=preserved_state(model, step.optimizer, step.device)):
        first = first_steps_peak(step, decisions)
        return max(first, allocator_step_peak(step, start_bytes))


def first_steps_peak(step: Step, decisions: Mapping[str, BlockStrategy]) -> int:
    """The allocator's peak of the first step after ``decisions`` are applied, as a job
    starts (the optimizer as passed) and, with an optimizer, as a resumed job starts (its
    state loaded, the regions new): NOTE [ The first step ] in measure/profile.py. The
    caller restores the model; the regions are left warm (one step run on them).
    """
    apply_decisions(step.model, decisions, blocks=step.blocks)
    first = first_step_peak(step)
    if step.optimizer is not None:  # resumed: the state exists now, the regions anew
        apply_decisions(step.model, decisions, blocks=step.blocks)
        first = max(first, first_step_peak(step))
    return first


def _tracked_real(step: Step) -> Profile:
    """A tracked step of the (warm) real model as it is, as :func:`remat.profile` runs
    it after its warm-up; the model is restored by the caller."""
    named = step.blocks_found(api="remat.plan", required=False)
    clear_grads(step.model)
    tracked = tracked_step(step, named)
    clear_grads(step.model)
    return profile_from_tracked(tracked, named, simulated=False, device=step.device)


def real_first(step: Step, ctx: PlanContext, decisions: Mapping[str, BlockStrategy], *,
               simulate: bool) -> bool:
    """Whether :func:`measure_on_cpu` measures ``decisions`` (NOTE [ Closed loop on the real
    model ]): a real CPU model with a fake copy, the choice not measured on it yet, and a
    tracked real step cheaper than a tracked fake one."""
    setup = ctx.setup
    if simulate or setup is None or setup.real and not setup.stand_in \
            or model_device(step.model).type != "cpu" \
            or _key(decisions) in ctx.copy_profiles:
        return False
    return _real_is_cheaper(ctx)


def _real_is_cheaper(ctx: PlanContext) -> bool:
    # A model in a process group (TP, FSDP) runs collectives in its real steps, which
    # every rank must run alike: its ranks measure on the fake copy.
    setup = ctx.setup
    if setup is None or in_process_group():
        return False
    forward_flops = sum(max((c.recompute_flops for c in table), default=0)
                        for table in ctx.peak_model.tables)
    real_s = real_seconds(setup.step_ops, 3 * forward_flops)
    return real_s * _TRACKED_COST < fake_seconds(setup.step_ops)


def measure_on_cpu(step: Step, ctx: PlanContext, decisions: Mapping[str, BlockStrategy],
                   budget_bytes: int) -> tuple[Profile, int | None]:
    """The profile of a step with ``decisions`` applied, from a tracked real step after an
    untracked warm-up, and, when its tracked peak fits ``budget_bytes``, the allocator's
    peak (else None): the first steps after a fresh apply, then a steady step (NOTE
    [ Closed loop on the real model ]); the model is restored."""
    setup = ctx.setup
    assert setup is not None
    model = step.model
    with trial(model, decisions, blocks=step.blocks,
               within=preserved_state(model, step.optimizer, step.device)):
        # The first step of a new job (the optimizer as the user passed it) is the tracked
        # step's warm-up: optimizer state and lazy caches exist before its window.
        first = first_step_peak(step)
        with preserved_state(model, step.optimizer, step.device):  # as after one step
            prof = _tracked_real(step)
        ctx.copy_profiles[_key(decisions)] = prof
        allocated = None
        if prof.peak_bytes <= budget_bytes:
            report("closed loop, allocator step", 0, 1)
            if step.optimizer is not None:  # resumed: the state exists, the regions anew
                apply_decisions(model, decisions, blocks=step.blocks)
                first = max(first, first_step_peak(step))
            allocated = allocator_peak_of(step, decisions, prof, first)
    return prof, allocated


Key = tuple[tuple[str, BlockStrategy], ...]
"""A set of decisions as a hashable key: ``(module name, decision)`` pairs, sorted."""


def _key(decisions: Mapping[str, BlockStrategy]) -> Key:
    return tuple(sorted(decisions.items(), key=lambda item: item[0]))


def measure_on_copy(step: Step, ctx: PlanContext, decisions: Mapping[str, BlockStrategy]
                  ) -> Profile | None:
    """One tracked step of the context's fake copy with ``decisions`` applied, or
    ``None`` where NOTE [ Closed loop on the fake copy ] does not apply. A real copy
    (NOTE [ Planning on a real copy ] in context.py) measures on any device. Each set of
    decisions is measured once per copy (``PlanContext.copy_profiles``)."""
    setup = ctx.setup
    if setup is None or not setup.real and model_device(step.model).type not in ("cpu", "meta"):
        return None
    key = _key(decisions)
    if key not in ctx.copy_profiles:
        ctx.copy_profiles[key] = _measure_on_copy(step, setup, decisions)
    return ctx.copy_profiles[key]


def _measure_on_copy(step: Step, setup: FakeSetup, decisions: Mapping[str, BlockStrategy]
                     ) -> Profile | None:
    fstep = step.with_model(setup.model, setup.optimizer, setup.batch)
    try:
        with trial(setup.model, decisions, blocks=step.blocks, within=setup.mode):
            clear_grads(setup.model)
            named = fstep.blocks_found(api="remat.plan", required=False)
            try:
                tracked = tracked_step(fstep, named)
            finally:
                clear_grads(setup.model)
    except Exception:  # noqa: BLE001 - the measured step below is the reference
        return None
    return profile_from_tracked(tracked, named, simulated=not setup.real or setup.stand_in,
                                device=fstep.device)


def timed_step_ms(step: Step, decisions: Mapping[str, BlockStrategy], *,
                  repeats: int = 3) -> float:
    """Median time of a real training step with ``decisions`` applied, ms; model restored."""
    model = step.model
    with trial(model, decisions, blocks=step.blocks,
               within=preserved_state(model, step.optimizer, step.device)):
        return time_step(model, step.batch, loss_fn=step.loss_fn, optimizer=step.optimizer,
                         repeats=repeats).step_ms


def _offload_ms(ctx: PlanContext, choice: Sequence[int]) -> float:
    """Exposed host-link time of the chosen candidates (their recompute is in the ops)."""
    return sum(table[c].transfer_ms for table, c in zip(ctx.peak_model.tables, choice,
                                                        strict=True))


def _build(ctx: PlanContext, choice: Sequence[int] | None,
           decisions: Mapping[str, BlockStrategy], prof: Profile, budget_bytes: int,
           blocks: Any, step_ms_measured: float | None = None) -> Plan:
    """The plan of ``decisions`` measured as ``prof``; ``choice``: the same decisions as
    candidate indices, None where they are not all candidates (a built-in strategy's: its
    measured peak stands for the prediction)."""
    if ctx.cost_source == "measured":
        assert choice is not None  # built-in strategies are weighed on roofline costs only
        cost_ms, step_time = ctx.recompute_ms(choice), step_ms_measured
    else:
        extra_ms = _offload_ms(ctx, choice) if choice is not None else 0.0
        cost_ms = recompute_ms(prof.ops, ctx.device) + extra_ms
        step_time = step_ms(prof.ops, ctx.device) + extra_ms
    return Plan(
        decisions=decisions,
        block_names=ctx.block_names,
        budget_bytes=budget_bytes,
        cost=StepCost(peak_bytes=ctx.peak_model.predict(choice) if choice is not None
                      else prof.peak_bytes,
                      recompute_flops=prof.recompute_flops, recompute_ms=cost_ms,
                      step_ms=step_time),
        measured_peak_bytes=prof.peak_bytes,
        no_checkpoint_peak_bytes=ctx.no_checkpoint_peak_bytes,
        cost_device=ctx.device.name,
        cost_source=ctx.cost_source,
        timed_on=ctx.timed_on,
        blocks=blocks,
        batch_size=ctx.batch_size,
    )


def _dominant(breakdown: Mapping[Category, int], peak: int) -> str:
    parts = sorted(((v, _KIND_NAMES.get(k, k)) for k, v in breakdown.items() if v > 0),
                   reverse=True)
    chosen: list[str] = []
    total = 0
    for value, name in parts:
        chosen.append(name)
        total += value
        if total * 2 >= peak:
            break
    share = 100.0 * total / peak if peak else 0.0
    return f"{' + '.join(chosen)} ({share:.0f}% of it)"


def _too_small(ctx: PlanContext, budget_bytes: int, choice: Sequence[int],
               prof: Profile, budget: Budget | None, peak: int) -> BudgetTooSmall:
    parts = ", ".join(f"{_KIND_NAMES.get(k, k)} {format_bytes(v)}"
                      for k, v in sorted(prof.peak_breakdown.items(), key=lambda kv: -kv[1])
                      if v > 0)
    label = decisions_label(ctx.peak_model.tables[i][c].label() for i, c in enumerate(choice))
    return BudgetTooSmall(
        message(
            "remat.plan", f"no checkpointing plan fits a budget of {format_bytes(budget_bytes)}",
            {"budget": f"{format_bytes(budget_bytes)} ({budget_bytes} B)",
             "smallest reachable peak": f"{format_bytes(peak)} ({peak} B, with {label})",
             "dominated by": _dominant(prof.peak_breakdown, peak),
             "at that peak": parts,
             **_forms(ctx, budget_bytes, budget)},
            fix=f"raise the budget to at least {format_bytes(peak)}, use a smaller batch or "
                "sequence, or shrink what dominates (lower-precision parameters, sharded "
                "optimizer state and gradients with FSDP)"),
        budget_bytes=budget_bytes, min_peak_bytes=peak, breakdown=prof.peak_breakdown,
        cost=prof.cost,
    )


def _forms(ctx: PlanContext, budget_bytes: int, budget: Budget | None) -> dict[str, str]:
    """The budget as given and in the other form (NOTE [ Budget forms ])."""
    given = budget if budget is not None else Budget(bytes_=max(budget_bytes, 1))
    return {"budget given as": str(given),
            "the same budget": given.other_form(budget_bytes, ctx.no_checkpoint_peak_bytes,
                                                ctx.static_bytes)}


def _lowest_choices(ctx: PlanContext) -> list[list[int]]:
    """Choices that keep the least: the smallest predicted peak, every block fully
    checkpointed, and every block's candidate that keeps the fewest bytes."""
    full = Full()
    choices = [min_peak_choice(ctx.peak_model)]
    tables = ctx.peak_model.tables
    all_full = [next((i for i, c in enumerate(t) if c.parts == (("", full),)), None)
                for t in tables]
    if all(i is not None for i in all_full):
        choices.append([i for i in all_full if i is not None])

    def fewest_bytes(table: Sequence[Candidate]) -> int:
        return min(range(len(table)),
                   key=lambda i: (table[i].saved_bytes, table[i].recompute_ms))

    choices.append([fewest_bytes(t) for t in tables])
    unique: list[list[int]] = []
    for choice in choices:
        if choice not in unique:
            unique.append(choice)
    return unique


def close_loop(step: Step, ctx: PlanContext, budget_bytes: int, *, simulate: bool,
               fake_loop: bool = True, budget: Budget | None = None,
               card: CardBudget | None = None) -> Plan:
    """Step 4 of NOTE [ How a plan is made ]: NOTE [ Closed loop ] (remat.core.loop) with a
    tracked step as the measurement; ``fake_loop=False`` measures every choice with
    :func:`measure_decisions` (NOTE [ Closed loop on the fake copy ]). With ``card`` (a
    ``budget="device"`` plan) a choice's peak is its predicted reserved peak on that card,
    workspaces included (NOTE [ Fits on the card ] in card_fit.py). The plan returned is
    the cheaper of the loop's choice and the built-in strategies that fit (NOTE [ Never
    worse than manual ] in manual.py)."""
    measured: dict[Key, Profile] = {}
    allocated: dict[Key, int] = {}
    reserved: dict[Key, int] = {}
    chosen: dict[Key, tuple[int, ...]] = {}  # the solver's choices measured, by decisions
    settings = AllocatorSettings.from_env() if card is not None else None

    def of(choice: Sequence[int]) -> dict[str, BlockStrategy]:
        decisions = ctx.decisions(choice)
        chosen.setdefault(_key(decisions), tuple(choice))
        return decisions

    def measure(decisions: Mapping[str, BlockStrategy]) -> Profile:
        key = _key(decisions)
        if key not in measured:
            prof: Profile | None = None
            if fake_loop and real_first(step, ctx, decisions, simulate=simulate):
                prof, allocator_bytes = measure_on_cpu(step, ctx, decisions, budget_bytes)
                if allocator_bytes is not None:
                    allocated[key] = allocator_bytes
            elif fake_loop:
                prof = measure_on_copy(step, ctx, decisions)
            measured[key] = prof if prof is not None else \
                measure_decisions(step, decisions, simulate=simulate)
        return measured[key]

    def truth(decisions: Mapping[str, BlockStrategy]) -> int:
        """The higher of the tracker's and the allocator's peak (real steps only)."""
        prof = measure(decisions)
        if simulate:
            return prof.peak_bytes
        key = _key(decisions)
        if key not in allocated:
            report("closed loop, allocator step", len(allocated), len(allocated) + 1)
            allocated[key] = allocator_peak_of(step, decisions, prof)
        return max(prof.peak_bytes, allocated[key])

    def peak(decisions: Mapping[str, BlockStrategy]) -> int:
        """NOTE [ Fits on the allocator ]: the tracker's peak, and the allocator's too
        when the tracker's fits; on a card, the reserved peak."""
        prof = measure(decisions)
        if card is not None:
            return reserved_peak(decisions)
        return prof.peak_bytes if prof.peak_bytes > budget_bytes else truth(decisions)

    def reserved_peak(decisions: Mapping[str, BlockStrategy]) -> int:
        """NOTE [ Fits on the card ]: the step's allocations replayed through the caching
        allocator's model, first and steady step, workspaces added."""
        assert card is not None
        key = _key(decisions)
        if key not in reserved:
            prof = measure(decisions)
            tensors = prof.peak_bytes if prof.peak_bytes + card.workspace_bytes > budget_bytes \
                else truth(decisions)
            reserved[key] = reserved_on_card(card, prof, settings, tensors)
        return reserved[key]

    def build(decisions: Mapping[str, BlockStrategy], source: str = "planner",
              note: str | None = None) -> Plan:
        key = _key(decisions)
        prof = measure(decisions)
        step_time = timed_step_ms(step, decisions) if ctx.cost_source == "measured" else None
        plan = _build(ctx, chosen.get(key), decisions, prof, budget_bytes, step.blocks,
                      step_time)
        return replace(plan, allocator_peak_bytes=allocated.get(key),
                       reserved_peak_bytes=reserved_peak(decisions) if card is not None
                       else None, source=source, source_note=note)

    def cost(decisions: Mapping[str, BlockStrategy]) -> float:
        key = _key(decisions)
        if ctx.cost_source == "measured":
            return ctx.recompute_ms(chosen[key])
        return recompute_ms(measure(decisions).ops, ctx.device)

    def never_worse(plan: Plan) -> Plan:
        """NOTE [ Never worse than manual ] (manual.py)."""
        if ctx.cost_source != "roofline":
            return plan
        over = max((ctx.peak_model.predict(c) - measure(ctx.decisions(c)).peak_bytes
                    for c in chosen.values()), default=0)
        best, best_ms = plan, plan.recompute_ms
        options = manual_options(ctx, step.blocks_found(api="remat.plan"))
        for option in sorted(options, key=lambda o: (
                -1.0 if o.predicted_ms is None else o.predicted_ms)):
            key = _key(option.decisions)
            if key == _key(best.decisions):
                continue
            if option.predicted_ms is not None and option.predicted_peak_bytes is not None \
                    and (option.predicted_ms >= best_ms
                         or option.predicted_peak_bytes - max(over, 0) > budget_bytes):
                continue
            if option.choice is not None:
                chosen.setdefault(key, option.choice)
            report(f"closed loop, {option.name}", 0, 1)
            option_ms = recompute_ms(measure(option.decisions).ops, ctx.device)
            if option_ms < best_ms and peak(option.decisions) <= budget_bytes:
                best = build(option.decisions, option.name,
                             f"{option.name} recomputes {option_ms * 1e3:.2f} us where the "
                             f"solver's choice recomputes {plan.recompute_ms * 1e3:.2f} us "
                             "(measured on the applied step); both fit")
                best_ms = best.recompute_ms
        return best

    found = close_loop_core(
        ctx.peak_model, budget_bytes, lambda c: peak(of(c)), max_rounds=_MAX_ROUNDS,
        on_round=lambda done, total: report(f"closed loop, round {done + 1}", done, total))
    if found is not None:
        return never_worse(build(of(found)))
    # Nothing predicted to fit fits: measure the lowest choices themselves, since the
    # peak model may over-predict them (it is calibrated to be safe, not tight).
    for lowest_choice in _lowest_choices(ctx):
        if peak(of(lowest_choice)) <= budget_bytes:
            break
    fitted = [key for key in chosen if peak(dict(key)) <= budget_bytes]
    if fitted:  # a measured choice fits after all: the cheapest of them
        return never_worse(build(dict(min(fitted, key=lambda k: cost(dict(k))))))
    # The smallest peak on the allocator among the lowest choices (each measured above)
    # and the tracker's lowest: what BudgetTooSmall offers as reachable.
    lowest_keys = {min(chosen, key=lambda k: measured[k].peak_bytes),
                   *(_key(ctx.decisions(c)) for c in _lowest_choices(ctx))}
    reached = reserved_peak if card is not None else truth
    lowest = min(sorted(lowest_keys, key=lambda k: chosen[k]), key=lambda k: reached(dict(k)))
    raise _too_small(ctx, budget_bytes, chosen[lowest], measured[lowest], budget,
                     reached(dict(lowest)))
