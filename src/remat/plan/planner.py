"""``remat.plan`` and ``remat.auto``: the cheapest checkpointing whose measured peak fits a budget.

NOTE [ How a plan is made ]
    1. Copy the model, batch and optimizer as fake tensors (nothing is computed or
       allocated, the user's model is untouched; see ``_sim.py``).
    2. Measure every candidate of every kind of block (candidates.py) and one
       whole step without checkpointing, cut into memory windows.
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
    Each size's best plan gets a predicted step time (cost.py, NOTE [ Step-time
    model ]) and samples per second; the plan with the most samples per second
    wins and carries the whole table in ``plan.throughput``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from remat.blocks import BlocksSpec, named_blocks
from remat.errors import BudgetTooSmall
from remat.measure.profile import Profile, profile
from remat.measure.step import LossFn
from remat.plan._sim import fake_setup, quiet, run_windows
from remat.plan.budget import Budget, BudgetLike, parse_budget
from remat.plan.candidates import measure_groups
from remat.plan.cost import cost_device, recompute_ms, step_ms
from remat.plan.peak import PeakModel
from remat.plan.plans import Plan, ThroughputRow, apply_spec, decisions_label
from remat.plan.solver import min_peak_choice, solve
from remat.simulate.devices import DeviceSpec
from remat.strategies import BlockDecision, apply, apply_decisions, remove
from remat.units import format_bytes
from remat.validate.pitfalls import check_model, warn_pitfalls

__all__ = ["PlanContext", "auto", "plan", "prepare"]

_MAX_ROUNDS = 6
_REFINE_STEPS = 4
_REMAT_KEYS = ("forward", "_remat_region", "_remat_prev_forward", "_remat_applied")
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
    """

    peak_model: PeakModel
    device: DeviceSpec
    no_checkpoint_peak_bytes: int
    batch_size: int | None

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


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


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


def prepare(model: nn.Module, batch: Any, *, loss_fn: LossFn | None = None,
            optimizer: torch.optim.Optimizer | None = None, blocks: BlocksSpec = None,
            device: str | DeviceSpec | None = None) -> PlanContext:
    """Measure candidates and calibrate the peak model (steps 1-3 of NOTE [ How a plan is made ]).

    Everything runs on fake copies, so the model, its gradients and the optimizer are
    untouched. :func:`plan` calls this; call it yourself to plan several budgets for one
    model and batch without measuring twice (``plan(..., context=ctx)``).

    Args:
        model, batch, loss_fn, optimizer, blocks: as for :func:`plan`.
        device: the cost device (name or spec). Default: the model's GPU when remat
            knows it, else ``"h100-80gb"``.
    """
    _check_model(model)
    spec = cost_device(_model_device(model), device)
    setup = fake_setup(model, batch, optimizer=optimizer, blocks=blocks)
    groups = measure_groups(setup, spec)
    step = run_windows(setup, loss_fn=loss_fn)
    peak_model = PeakModel.calibrate(groups, [n for n, _ in setup.blocks], step)
    return PlanContext(peak_model, spec, step.peak_bytes, _batch_size(batch))


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

@contextmanager
def preserved_strategy(model: nn.Module) -> Iterator[None]:
    """Put back whatever strategy was applied to ``model`` (the planner applies its own)."""
    installed = [(m, {k: m.__dict__[k] for k in _REMAT_KEYS if k in m.__dict__})
                 for m in model.modules()]
    try:
        yield
    finally:
        remove(model)
        for module, saved in installed:
            module.__dict__.update(saved)


def measure_decisions(model: nn.Module, batch: Any, decisions: Mapping[str, BlockDecision], *,
                      loss_fn: LossFn | None = None,
                      optimizer: torch.optim.Optimizer | None = None,
                      blocks: BlocksSpec = None, simulate: bool = False) -> Profile:
    """Profile one step of ``model`` with ``decisions`` applied, then restore the model.

    Args:
        model, batch, loss_fn, optimizer, blocks, simulate: as for :func:`plan`.
        decisions: per block name, its decision (others: ``"none"``).
    """
    names = [n for n, _ in named_blocks(model, blocks, api="remat.plan")]
    with preserved_strategy(model), quiet():
        apply_decisions(model, decisions, blocks=apply_spec(decisions, names, blocks))
        return profile(model, batch, loss_fn=loss_fn, optimizer=optimizer, simulate=simulate,
                       blocks=blocks, timing=False)


# ---- the closed loop ----------------------------------------------------------------------

def _offload_ms(ctx: PlanContext, choice: Sequence[int]) -> float:
    return sum(table[c].recompute_ms for table, c in zip(ctx.peak_model.tables, choice,
                                                         strict=True)
               if table[c].offloads)


def _build(ctx: PlanContext, choice: Sequence[int], prof: Profile, budget_bytes: int,
           blocks: BlocksSpec) -> Plan:
    extra_ms = _offload_ms(ctx, choice)
    decisions = ctx.decisions(choice)
    return Plan(
        decisions=decisions,
        block_names=ctx.block_names,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=ctx.peak_model.predict(choice),
        measured_peak_bytes=prof.peak_bytes,
        recompute_flops=prof.recompute_flops,
        recompute_ms=recompute_ms(prof.ops, ctx.device) + extra_ms,
        predicted_step_ms=step_ms(prof.ops, ctx.device) + extra_ms,
        no_checkpoint_peak_bytes=ctx.no_checkpoint_peak_bytes,
        cost_device=ctx.device.name,
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

    internal = budget_bytes
    for _ in range(_MAX_ROUNDS):
        choice = solve(ctx.peak_model, internal)
        if choice is None:
            break
        prof = measure(choice)
        if prof.peak_bytes <= budget_bytes:
            return _build(ctx, choice, prof, budget_bytes, blocks)
        # Over budget: the model under-predicted this choice; ask for that much less.
        internal = min(internal, ctx.peak_model.predict(choice)) \
            - (prof.peak_bytes - budget_bytes)
    smallest = min_peak_choice(ctx.peak_model)
    prof = measure(smallest)
    if prof.peak_bytes <= budget_bytes:
        return _build(ctx, smallest, prof, budget_bytes, blocks)
    fitted = [(k, p) for k, p in measured.items() if p.peak_bytes <= budget_bytes]
    if fitted:  # a measured choice fits after all: the cheapest of them
        cheapest = min(fitted, key=lambda kp: recompute_ms(kp[1].ops, ctx.device))
        return _build(ctx, cheapest[0], cheapest[1], budget_bytes, blocks)
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
) -> Plan:
    """The cheapest checkpointing plan whose measured peak fits ``budget``.

    Each block gets one decision: keep everything, checkpoint it, checkpoint only its
    attention or MLP, keep only the outputs of chosen ops (op-level selective
    checkpointing), or offload (GPU only). Candidates are measured per kind of block,
    a peak model predicts the step's peak for any combination, an integer program picks
    the combination with the least recompute cost (roofline time on ``device``) that
    fits, and the choice is measured on the model and tightened until it fits (see
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

    Returns:
        A :class:`~remat.plan.Plan` with ``measured_peak_bytes <= budget_bytes``.

    Raises:
        BudgetTooSmall: no plan fits; the message gives the smallest reachable peak and
            what dominates it.
        ValueError: an unreadable budget, a model in eval mode, or a bad ``maximize``.

    Example:
        >>> from remat.models import build_model, make_batch
        >>> model = build_model("gpt-small")
        >>> plan = remat.plan(model, make_batch(model, 8), budget="60%")
        >>> plan.measured_peak_bytes <= plan.budget_bytes
        True
        >>> remat.apply(model, plan)
    """
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
                           max_batch_size=max_batch_size)
    if callable(batch) and not isinstance(batch, (Tensor, Mapping, tuple, list)):
        raise TypeError("remat.plan: batch is a function; pass maximize='throughput' to search "
                        "batch sizes, or pass a batch")
    spec = parse_budget(budget)
    if not simulate and _model_device(model).type == "meta":
        raise ValueError(
            "remat.plan: the model is on the meta device, so its steps cannot run for real; "
            "pass simulate=True to plan it on fake tensors"
        )
    if context is None:
        context = prepare(model, batch, loss_fn=loss_fn, optimizer=optimizer, blocks=blocks,
                          device=device)
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
                  batch_size=batch_size, max_batch_size=max_batch_size)
    apply(model, result)  # result.blocks finds the decided modules
    return result


# ---- throughput ---------------------------------------------------------------------------

def _throughput(model: nn.Module, make_batch: Callable[[int], Any], *, budget: Budget,
                loss_fn: LossFn | None, optimizer: torch.optim.Optimizer | None,
                blocks: BlocksSpec, simulate: bool, device: str | DeviceSpec | None,
                batch_size: int, max_batch_size: int) -> Plan:
    """NOTE [ Throughput search ]."""
    if batch_size < 1 or max_batch_size < 1:
        raise ValueError(f"remat.plan: batch_size and max_batch_size must be >= 1, got "
                         f"{batch_size} and {max_batch_size}")
    if budget.is_relative:
        reference = prepare(model, make_batch(batch_size), loss_fn=loss_fn,
                            optimizer=optimizer, blocks=blocks, device=device)
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
                     optimizer=optimizer, blocks=blocks, simulate=simulate, device=device)
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
