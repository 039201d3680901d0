"""``remat.plan`` and ``remat.auto``: the cheapest checkpointing whose measured peak fits a budget.

NOTE [ How a plan is made ]
    1. Copy the model, batch and optimizer as fake tensors (nothing is computed or
       allocated, the user's model is untouched; see ``_sim.py``).
    2. Measure every candidate of every kind of block (candidates.py) and one
       whole step without checkpointing, cut into memory windows. With measured
       costs, time every candidate on the real model (timed.py).
    3. Calibrate the peak model (peak.py) and solve for the cheapest choice whose
       predicted peak fits (solver.py).
    4. Closed loop: apply the choice to the model, measure the step with
       :func:`remat.measure.profile` (real, or simulated with ``simulate=True``),
       and if the measured peak is over budget, tighten the solver's budget by the
       overshoot and solve again. The returned plan's measured peak never exceeds
       the budget; when no plan fits, :class:`~remat.errors.BudgetTooSmall` says
       what the smallest reachable peak is and what fills it.

NOTE [ Throughput search ]
    With ``maximize="throughput"`` the batch is a function ``n -> batch``. Batch
    sizes 1, 2, 4, ... are planned until none fits the budget (or
    ``max_batch_size``), then the largest fitting size is refined by bisection.
    Each size's best plan gets a step time, predicted (cost.py, NOTE [ Step-time
    model ]) or, with measured costs, timed on the device, and samples per second;
    the plan with the most samples per second wins and carries the whole table in
    ``plan.throughput``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from remat.blocks import BlocksSpec, named_blocks
from remat.errors import BudgetTooSmall
from remat.measure.profile import Profile, preserved_state, profile
from remat.measure.step import LossFn, model_device
from remat.measure.timing import time_step
from remat.plan._sim import fake_setup, quiet, run_windows
from remat.plan.budget import Budget, BudgetLike, parse_budget
from remat.plan.candidates import Candidate, measure_groups
from remat.plan.cost import cost_device, recompute_ms, step_ms
from remat.plan.peak import PeakModel
from remat.plan.plans import COST_SOURCES, Plan, ThroughputRow, apply_spec, decisions_label
from remat.plan.solver import min_peak_choice, solve
from remat.plan.timed import time_groups
from remat.simulate.devices import DeviceSpec
from remat.strategies import BlockDecision, apply, apply_decisions, preserved_strategy
from remat.units import format_bytes
from remat.validate.pitfalls import check_model, warn_pitfalls

__all__ = ["COSTS", "PlanContext", "auto", "plan", "prepare", "resolve_cost", "timed_step_ms"]

_MAX_ROUNDS = 6
#: ``cost=`` values: measured time on CUDA and roofline elsewhere, or either one forced.
COSTS: tuple[str, ...] = ("auto", "roofline", "measured")
_REFINE_STEPS = 4
_KIND_NAMES = {
    "params": "parameters", "grads": "gradients", "optimizer_state": "optimizer state",
    "batch": "batch", "buffers": "buffers", "forward": "activations",
    "recompute": "recomputed activations", "backward": "backward temporaries",
    "optimizer": "optimizer temporaries", "other": "other tensors",
}


# ---- preparing: measure candidates and calibrate the peak model ---------------------------

@dataclass(frozen=True)
class PlanContext:
    """Everything measured to plan one model and batch (reusable across budgets).

    Args:
        peak_model: the calibrated peak model with every block's candidates.
        device: the cost device.
        no_checkpoint_peak_bytes: peak of the step without checkpointing (simulated;
            on CPU equal to a real run's).
        batch_size: the batch's leading dimension, when there is one.
        cost_source: ``"roofline"`` or ``"measured"`` (candidates' costs timed on the
            model's device; see NOTE [ Measured cost ] in timed.py).
        timed_on: with ``"measured"``, the device the times come from.
    """

    peak_model: PeakModel
    device: DeviceSpec
    no_checkpoint_peak_bytes: int
    batch_size: int | None
    cost_source: str = "roofline"
    timed_on: str | None = None

    def __post_init__(self) -> None:
        if self.cost_source not in COST_SOURCES:
            raise ValueError(f"PlanContext: cost_source must be one of {COST_SOURCES}, got "
                             f"{self.cost_source!r}")

    def recompute_ms(self, choice: Sequence[int]) -> float:
        """The solver's cost of a choice: its candidates' recompute costs summed, ms."""
        return sum(table[c].recompute_ms
                   for table, c in zip(self.peak_model.tables, choice, strict=True))

    @property
    def block_names(self) -> tuple[str, ...]:
        """The blocks' qualified names, in forward order."""
        return self.peak_model.block_names

    def decisions(self, choice: Sequence[int]) -> dict[str, BlockDecision]:
        """Decisions of a choice (candidate index per block), ``"none"`` left out."""
        out: dict[str, BlockDecision] = {}
        for name, table, c in zip(self.block_names, self.peak_model.tables, choice, strict=True):
            out.update(table[c].decisions_for(name))
        return out


def _batch_size(batch: Any) -> int | None:
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    values: Any = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, (list, tuple)) or isinstance(batch, Mapping):
        for v in values:
            size = _batch_size(v)
            if size is not None:
                return size
    return None


def resolve_cost(cost: str, model: nn.Module, *, simulate: bool = False) -> str:
    """``"roofline"`` or ``"measured"`` for ``cost="auto"|"roofline"|"measured"``.

    ``"auto"`` measures on CUDA (real runs) and uses the roofline elsewhere, where wall
    time is too noisy to plan with or nothing runs for real.

    Raises:
        ValueError: an unknown ``cost``, or ``"measured"`` where nothing runs for real.
    """
    if cost not in COSTS:
        raise ValueError(f"remat.plan: cost must be one of {COSTS}, got {cost!r}")
    device = model_device(model)
    if cost == "auto":
        return "measured" if device.type == "cuda" and not simulate else "roofline"
    if cost == "measured" and (simulate or device.type == "meta"):
        why = "simulate=True runs on fake tensors" if simulate else \
            "the model is on the meta device"
        raise ValueError(
            f"remat.plan: cost='measured' times real forward and backward runs of the "
            f"model's blocks, but {why}. Use cost='roofline' (or 'auto')."
        )
    return cost


def _device_label(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return str(device)


def prepare(model: nn.Module, batch: Any, *, loss_fn: LossFn | None = None,
            optimizer: torch.optim.Optimizer | None = None, blocks: BlocksSpec = None,
            device: str | DeviceSpec | None = None, cost: str = "auto") -> PlanContext:
    """Measure candidates and calibrate the peak model (steps 1-3 of NOTE [ How a plan is made ]).

    Bytes are measured on fake copies, so the model, its gradients and the optimizer are
    untouched; with ``cost="measured"`` each candidate is also timed on the real model
    (its state is restored). :func:`plan` calls this; call it yourself to plan several
    budgets for one model and batch without measuring twice (``plan(..., context=ctx)``).

    Args:
        model, batch, loss_fn, optimizer, blocks, cost: as for :func:`plan` (``"auto"``
            here measures on CUDA).
        device: the cost device (name or spec). Default: the model's GPU when remat
            knows it, else ``"h100-80gb"``.
    """
    _check_model(model)
    source = resolve_cost(cost, model)
    spec = cost_device(model_device(model), device)
    setup = fake_setup(model, batch, optimizer=optimizer, blocks=blocks)
    groups = measure_groups(setup, spec, prune=source == "roofline")
    timed_on = None
    if source == "measured":
        groups = time_groups(model, batch, groups, blocks=blocks)
        timed_on = _device_label(model_device(model))
    step = run_windows(setup, loss_fn=loss_fn)
    peak_model = PeakModel.calibrate(groups, [n for n, _ in setup.blocks], step)
    return PlanContext(peak_model, spec, step.peak_bytes, _batch_size(batch), source, timed_on)


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"remat.plan: model must be an nn.Module, got {type(model).__name__}")
    if not model.training:
        raise ValueError(
            f"remat.plan: {type(model).__name__} is in eval mode, so a training step keeps no "
            "activations to plan for. Call model.train() first."
        )
    # A KV cache (HF use_cache=True) would be filled while measuring blocks: turn it off
    # with the same warning remat.apply gives.
    found = [p for p in check_model(model) if p.kind in ("use_cache", "hf_gradient_checkpointing")]
    warn_pitfalls(found, api="remat.plan", model_name=type(model).__name__)


# ---- measuring a choice on the real model -------------------------------------------------

def measure_decisions(model: nn.Module, batch: Any, decisions: Mapping[str, BlockDecision], *,
                      loss_fn: LossFn | None = None,
                      optimizer: torch.optim.Optimizer | None = None,
                      blocks: BlocksSpec = None, simulate: bool = False,
                      timing: bool = False) -> Profile:
    """Profile one step of ``model`` with ``decisions`` applied, then restore the model.

    Args:
        model, batch, loss_fn, optimizer, blocks, simulate: as for :func:`plan`.
        decisions: per block name, its decision (others: ``"none"``).
        timing: also time the step (real runs only). Default: False.
    """
    names = [n for n, _ in named_blocks(model, blocks, api="remat.plan")]
    with preserved_strategy(model), quiet():
        apply_decisions(model, decisions, blocks=apply_spec(decisions, names, blocks))
        return profile(model, batch, loss_fn=loss_fn, optimizer=optimizer, simulate=simulate,
                       blocks=blocks, timing=timing and not simulate, repeats=3)


def timed_step_ms(model: nn.Module, batch: Any, decisions: Mapping[str, BlockDecision], *,
                  loss_fn: LossFn | None = None, optimizer: torch.optim.Optimizer | None = None,
                  blocks: BlocksSpec = None, repeats: int = 3) -> float:
    """Median time of a real training step with ``decisions`` applied, ms; model restored."""
    names = [n for n, _ in named_blocks(model, blocks, api="remat.plan")]
    device = model_device(model)
    with preserved_strategy(model), quiet(), preserved_state(model, optimizer, device):
        apply_decisions(model, decisions, blocks=apply_spec(decisions, names, blocks))
        return time_step(model, batch, loss_fn=loss_fn, optimizer=optimizer,
                         repeats=repeats).step_ms


# ---- the closed loop ----------------------------------------------------------------------

def _offload_ms(ctx: PlanContext, choice: Sequence[int]) -> float:
    return sum(table[c].recompute_ms for table, c in zip(ctx.peak_model.tables, choice,
                                                         strict=True)
               if table[c].offloads)


def _build(ctx: PlanContext, choice: Sequence[int], prof: Profile, budget_bytes: int,
           blocks: BlocksSpec, step_ms_measured: float | None = None) -> Plan:
    decisions = ctx.decisions(choice)
    if ctx.cost_source == "measured":
        cost_ms, step = ctx.recompute_ms(choice), step_ms_measured
    else:
        extra_ms = _offload_ms(ctx, choice)
        cost_ms = recompute_ms(prof.ops, ctx.device) + extra_ms
        step = step_ms(prof.ops, ctx.device) + extra_ms
    return Plan(
        decisions=decisions,
        block_names=ctx.block_names,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=ctx.peak_model.predict(choice),
        measured_peak_bytes=prof.peak_bytes,
        recompute_flops=prof.recompute_flops,
        recompute_ms=cost_ms,
        predicted_step_ms=step,
        no_checkpoint_peak_bytes=ctx.no_checkpoint_peak_bytes,
        cost_device=ctx.device.name,
        cost_source=ctx.cost_source,
        timed_on=ctx.timed_on,
        blocks=apply_spec(decisions, ctx.block_names, blocks),
        batch_size=ctx.batch_size,
    )


def _dominant(breakdown: Mapping[str, int], peak: int) -> str:
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
               prof: Profile) -> BudgetTooSmall:
    peak = prof.peak_bytes
    breakdown = {_KIND_NAMES.get(k, k).replace(" ", "_"): v
                 for k, v in prof.peak_breakdown.items() if v > 0}
    parts = ", ".join(f"{_KIND_NAMES.get(k, k)} {format_bytes(v)}"
                      for k, v in sorted(prof.peak_breakdown.items(), key=lambda kv: -kv[1])
                      if v > 0)
    label = decisions_label(ctx.peak_model.tables[i][c].label() for i, c in enumerate(choice))
    return BudgetTooSmall(
        f"remat.plan: no checkpointing plan fits a budget of {format_bytes(budget_bytes)} "
        f"({budget_bytes} B). The smallest peak any plan reaches is {format_bytes(peak)} "
        f"({peak} B, with {label}); it is dominated by {_dominant(prof.peak_breakdown, peak)}. "
        f"At that peak: {parts}. Raise the budget to at least {format_bytes(peak)}, use a "
        "smaller batch or sequence, or shrink what dominates (lower-precision parameters, "
        "sharded optimizer state and gradients with FSDP).",
        budget_bytes=budget_bytes, min_peak_bytes=peak, breakdown=breakdown,
    )


def _lowest_choices(ctx: PlanContext) -> list[list[int]]:
    """Choices that keep the least: the smallest predicted peak, every block fully
    checkpointed, and every block's candidate that keeps the fewest bytes."""
    full = BlockDecision("full")
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


def _close_loop(model: nn.Module, batch: Any, ctx: PlanContext, budget_bytes: int, *,
                loss_fn: LossFn | None, optimizer: torch.optim.Optimizer | None,
                blocks: BlocksSpec, simulate: bool) -> Plan:
    """Step 4 of NOTE [ How a plan is made ]."""
    measured: dict[tuple[int, ...], Profile] = {}

    def measure(choice: Sequence[int]) -> Profile:
        key = tuple(choice)
        if key not in measured:
            measured[key] = measure_decisions(model, batch, ctx.decisions(choice),
                                              loss_fn=loss_fn, optimizer=optimizer,
                                              blocks=blocks, simulate=simulate)
        return measured[key]

    def build(choice: Sequence[int], prof: Profile) -> Plan:
        step = None
        if ctx.cost_source == "measured":
            step = timed_step_ms(model, batch, ctx.decisions(choice), loss_fn=loss_fn,
                                 optimizer=optimizer, blocks=blocks)
        return _build(ctx, choice, prof, budget_bytes, blocks, step)

    def cost(choice: Sequence[int], prof: Profile) -> float:
        if ctx.cost_source == "measured":
            return ctx.recompute_ms(choice)
        return recompute_ms(prof.ops, ctx.device)

    internal = budget_bytes
    for _ in range(_MAX_ROUNDS):
        choice = solve(ctx.peak_model, internal)
        if choice is None:
            break
        prof = measure(choice)
        if prof.peak_bytes <= budget_bytes:
            return build(choice, prof)
        # Over budget: the model under-predicted this choice; ask for that much less.
        internal = min(internal, ctx.peak_model.predict(choice)) \
            - (prof.peak_bytes - budget_bytes)
    # Nothing predicted to fit fits: measure the lowest choices themselves, since the
    # peak model may over-predict them (it is calibrated to be safe, not tight).
    for lowest_choice in _lowest_choices(ctx):
        prof = measure(lowest_choice)
        if prof.peak_bytes <= budget_bytes:
            break
    fitted = [(k, p) for k, p in measured.items() if p.peak_bytes <= budget_bytes]
    if fitted:  # a measured choice fits after all: the cheapest of them
        cheapest = min(fitted, key=lambda kp: cost(kp[0], kp[1]))
        return build(cheapest[0], cheapest[1])
    lowest = min(measured.items(), key=lambda kp: kp[1].peak_bytes)
    raise _too_small(ctx, budget_bytes, lowest[0], lowest[1])


# ---- public API ---------------------------------------------------------------------------

def plan(
    model: nn.Module,
    batch: Any,
    *,
    budget: BudgetLike | Budget,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    blocks: BlocksSpec = None,
    simulate: bool = False,
    maximize: str | None = None,
    device: str | DeviceSpec | None = None,
    context: PlanContext | None = None,
    batch_size: int = 8,
    max_batch_size: int = 1024,
    cost: str = "auto",
) -> Plan:
    """The cheapest checkpointing plan whose measured peak fits ``budget``.

    Each block gets one decision: keep everything, checkpoint it, checkpoint only its
    attention or MLP, keep only the outputs of chosen ops (op-level selective
    checkpointing), or offload (GPU only). Candidates are measured per kind of block,
    a peak model predicts the step's peak for any combination, an integer program picks
    the combination with the least recompute cost that fits (measured time on a GPU,
    roofline time on ``device`` elsewhere; see ``cost``), and the choice is measured on
    the model and tightened until it fits (see
    NOTE [ How a plan is made ]). The model is left as it was; apply the plan with
    ``remat.apply(model, plan)``, or use :func:`auto`.

    Warning:
        With ``simulate=False`` the closed loop runs real training steps (parameters,
        gradients, optimizer state and RNG are restored afterwards).

    Args:
        model: the model, in train mode.
        batch: a batch as :func:`remat.profile` takes it; with ``maximize="throughput"``
            a function ``n -> batch`` of n samples.
        budget: the whole step's peak: bytes (int), ``"12GiB"`` / ``"800MB"``, or
            ``"60%"`` of the un-checkpointed step's peak (with ``maximize``: of the peak
            at ``batch_size``). A budget above the un-checkpointed peak gives the empty plan.
        loss_fn: ``loss_fn(output, batch) -> scalar``. Default: ``output.loss``, else a mean.
        optimizer: stepped in the measured step; its state counts toward the peak.
            Default: ``None``.
        blocks: which modules are blocks (class, classes or predicate). Default: found.
        simulate: measure the closed loop under FakeTensorMode instead of for real.
            Default: ``False``.
        maximize: ``"throughput"``: search the batch size with the most samples per
            second under the budget (NOTE [ Throughput search ]). Default: ``None``.
        device: the device costs are computed for. Default: the model's GPU when remat
            knows it, else ``"h100-80gb"``.
        context: a :func:`prepare` result for this model and batch, to plan several
            budgets without measuring again. Default: measured now.
        batch_size: with ``maximize``, the batch size percentages refer to. Default: 8.
        max_batch_size: with ``maximize``, the largest batch size tried. Default: 1024.
        cost: what the solver minimizes. ``"measured"``: each candidate's extra
            forward+backward time, timed on the model's device (NOTE [ Measured cost ]
            in timed.py; costs a few block runs per candidate); ``"roofline"``: the
            roofline time of the recomputed ops on ``device`` (exact, instant, ignores
            kernel efficiency); ``"auto"``: measured on CUDA unless ``simulate``,
            roofline elsewhere (CPU wall time is too noisy to plan with).
            Default: ``"auto"``.

    Returns:
        A :class:`~remat.plan.Plan` with ``measured_peak_bytes <= budget_bytes``.

    Raises:
        BudgetTooSmall: no plan fits; the message gives the smallest reachable peak and
            what dominates it.
        ValueError: an unreadable budget, a model in eval mode, a bad ``maximize`` or
            ``cost``, or ``cost="measured"`` with ``simulate=True``.

    Example:
        >>> from remat.models import build_model, make_batch
        >>> model = build_model("gpt-small")
        >>> plan = remat.plan(model, make_batch(model, 8), budget="60%")
        >>> plan.measured_peak_bytes <= plan.budget_bytes
        True
        >>> remat.apply(model, plan)
    """
    source = resolve_cost(cost, model, simulate=simulate)
    if maximize is not None:
        if maximize != "throughput":
            raise ValueError(f"remat.plan: maximize must be 'throughput' or None, "
                             f"got {maximize!r}")
        if not callable(batch):
            raise TypeError(
                "remat.plan: maximize='throughput' needs batch to be a function n -> batch "
                "of n samples, e.g. batch=lambda n: make_batch(model, n)"
            )
        return _throughput(model, batch, budget=parse_budget(budget), loss_fn=loss_fn,
                           optimizer=optimizer, blocks=blocks, simulate=simulate,
                           device=device, batch_size=batch_size,
                           max_batch_size=max_batch_size, cost=source)
    if callable(batch) and not isinstance(batch, (Tensor, Mapping, tuple, list)):
        raise TypeError("remat.plan: batch is a function; pass maximize='throughput' to search "
                        "batch sizes, or pass a batch")
    spec = parse_budget(budget)
    if not simulate and model_device(model).type == "meta":
        raise ValueError(
            "remat.plan: the model is on the meta device, so its steps cannot run for real; "
            "pass simulate=True to plan it on fake tensors"
        )
    if context is None:
        context = prepare(model, batch, loss_fn=loss_fn, optimizer=optimizer, blocks=blocks,
                          device=device, cost=source)
    else:
        _check_model(model)
    budget_bytes = spec.resolve(context.no_checkpoint_peak_bytes)
    return _close_loop(model, batch, context, budget_bytes, loss_fn=loss_fn,
                       optimizer=optimizer, blocks=blocks, simulate=simulate)


def auto(
    model: nn.Module,
    batch: Any,
    *,
    budget: BudgetLike | Budget,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    blocks: BlocksSpec = None,
    simulate: bool = False,
    maximize: str | None = None,
    device: str | DeviceSpec | None = None,
    batch_size: int = 8,
    max_batch_size: int = 1024,
    cost: str = "auto",
) -> Plan:
    """Plan (see :func:`plan`), apply the plan to ``model``, and return it, measured.

    The returned plan's ``measured_peak_bytes`` is the peak of a step of ``model`` with
    the plan applied (real, or simulated with ``simulate=True``), and never exceeds the
    budget. With ``maximize="throughput"``, train with ``plan.batch_size`` samples.

    Example:
        >>> plan = remat.auto(model, batch, budget="8GiB")
        >>> plan.measured_peak_bytes <= plan.budget_bytes
        True
    """
    result = plan(model, batch, budget=budget, loss_fn=loss_fn, optimizer=optimizer,
                  blocks=blocks, simulate=simulate, maximize=maximize, device=device,
                  batch_size=batch_size, max_batch_size=max_batch_size, cost=cost)
    apply(model, result)  # result.blocks finds the decided modules
    return result


# ---- throughput ---------------------------------------------------------------------------

def _throughput(model: nn.Module, make_batch: Callable[[int], Any], *, budget: Budget,
                loss_fn: LossFn | None, optimizer: torch.optim.Optimizer | None,
                blocks: BlocksSpec, simulate: bool, device: str | DeviceSpec | None,
                batch_size: int, max_batch_size: int, cost: str) -> Plan:
    """NOTE [ Throughput search ]."""
    if batch_size < 1 or max_batch_size < 1:
        raise ValueError(f"remat.plan: batch_size and max_batch_size must be >= 1, got "
                         f"{batch_size} and {max_batch_size}")
    if budget.is_relative:
        reference = prepare(model, make_batch(batch_size), loss_fn=loss_fn,
                            optimizer=optimizer, blocks=blocks, device=device, cost="roofline")
        budget_bytes = budget.resolve(reference.no_checkpoint_peak_bytes)
    else:
        budget_bytes = budget.resolve(0)
    plans: dict[int, Plan] = {}
    rows: dict[int, ThroughputRow] = {}
    first_error: BudgetTooSmall | None = None

    def evaluate(n: int) -> bool:
        nonlocal first_error
        if n in rows:
            return rows[n].fits
        try:
            p = plan(model, make_batch(n), budget=budget_bytes, loss_fn=loss_fn,
                     optimizer=optimizer, blocks=blocks, simulate=simulate, device=device,
                     cost=cost)
        except BudgetTooSmall as exc:
            first_error = first_error or exc
            rows[n] = ThroughputRow(n, False, "", exc.min_peak_bytes, 0.0, 0.0, 0.0)
            return False
        p = replace(p, batch_size=n)
        step = p.predicted_step_ms or 0.0
        plans[n] = p
        rows[n] = ThroughputRow(n, True, p.label(), p.peak_bytes, p.recompute_ms, step,
                                n / step * 1e3 if step > 0 else 0.0)
        return True

    n, low, high = 1, 0, None
    while n <= max_batch_size:
        if not evaluate(n):
            high = n
            break
        low, n = n, n * 2
    if low == 0 and first_error is not None:
        raise first_error
    if high is None and low < max_batch_size:
        high = max_batch_size + 1
    steps = 0
    while high is not None and high - low > 1 and steps < _REFINE_STEPS:
        steps += 1  # bisect toward the largest size that fits
        mid = (low + high) // 2
        if evaluate(mid):
            low = mid
        else:
            high = mid
    best = max(plans, key=lambda k: (rows[k].samples_per_s, -k))
    table = tuple(rows[k] for k in sorted(rows))
    return replace(plans[best], throughput=table)
