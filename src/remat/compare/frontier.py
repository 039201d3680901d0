"""The memory / recompute frontier: every manual strategy and a plan, measured the same way.

Each point is one training step measured with :func:`remat.measure.profile`:
its peak bytes, and its recompute cost as the roofline time of the recomputed
ops on the cost device (the planner's objective). Recompute overhead is that
cost as a percentage of the roofline time of the un-checkpointed step. With
measured costs (``cost="measured"``, a plan made with them, on a GPU), every
point's cost is instead its timed step minus the un-checkpointed timed step
(medians, side by side in one run), and overhead is relative to the latter.
:func:`add_plan_row` puts a plan next to the strategies of ``remat compare``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from remat.blocks import BlocksSpec
from remat.core.results import Profile
from remat.devices import DeviceSpec
from remat.errors import BlocksNotFound, RematWarning, StrategyError, message, one_line
from remat.measure.profile import profile, profile_step
from remat.measure.roofline import roofline_ms
from remat.measure.step import LossFn, Step
from remat.planning.context import resolve_cost
from remat.planning.loop import measure_decisions
from remat.planning.plans import Plan
from remat.planning.recompute_cost import cost_device, recompute_ms
from remat.progress import report
from remat.strategies import apply, default_strategies, trial

if TYPE_CHECKING:
    from remat.core.rows import ComparisonResult


@dataclass(frozen=True)
class FrontierPoint:
    """One strategy (or the plan) on the memory / recompute plane.

    Args:
        name: the strategy, e.g. ``"every:2"``, or ``"plan"``.
        peak_bytes: the step's measured peak.
        recompute_flops: FLOPs recomputed per step.
        recompute_ms: roofline time of the recomputed ops on the cost device, ms.
        overhead_pct: ``recompute_ms`` as a percentage of the un-checkpointed step's
            roofline time.
        fits: ``peak_bytes <= budget``.
    """

    name: str
    peak_bytes: int
    recompute_flops: int
    recompute_ms: float
    overhead_pct: float
    fits: bool

    def __post_init__(self) -> None:
        if self.peak_bytes < 0 or self.recompute_flops < 0:
            raise ValueError(message(f"FrontierPoint({self.name!r})",
                                     "byte and FLOP counts must be >= 0",
                                     {"peak_bytes": self.peak_bytes,
                                      "recompute_flops": self.recompute_flops},
                                     fix="pass counts >= 0"))
        for key in ("recompute_ms", "overhead_pct"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(message(f"FrontierPoint({self.name!r})",
                                         f"{key} must be a finite number >= 0",
                                         {"found": repr(value)}, fix=f"pass {key} >= 0"))


@dataclass(frozen=True)
class Frontier:
    """Manual strategies and a plan as points (peak memory, recompute overhead).

    Args:
        points: the strategies in the order measured, then ``"plan"`` (if given).
        budget_bytes: the budget the points are judged against.
        step_ms: time of the un-checkpointed step, ms: roofline on ``cost_device``, or
            timed (``cost_source="measured"``).
        cost_device: the device the costs use (roofline), or were timed on (measured).
        label: what was measured, e.g. ``"gpt-small, batch 8"``.
        cost_source: ``"roofline"`` or ``"measured"``. Default: ``"roofline"``.
    """

    points: tuple[FrontierPoint, ...]
    budget_bytes: int
    step_ms: float
    cost_device: str
    label: str = ""
    cost_source: str = "roofline"
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def point(self, name: str) -> FrontierPoint:
        """The point called ``name``; KeyError listing the names otherwise."""
        for p in self.points:
            if p.name == name:
                return p
        raise KeyError(one_line(message("Frontier.point", f"no point {name!r}",
                                        {"have": [p.name for p in self.points]},
                                        fix="ask for a measured strategy or 'plan'")))

    def best_manual(self) -> FrontierPoint | None:
        """The manual strategy with the least recompute among those that fit (None if none)."""
        fitting = [p for p in self.points if p.name != "plan" and p.fits]
        return min(fitting, key=lambda p: (p.recompute_ms, p.peak_bytes)) if fitting else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        best = self.best_manual()
        return {
            "label": self.label,
            "budget_bytes": self.budget_bytes,
            "step_ms": self.step_ms,
            "cost_device": self.cost_device,
            "cost_source": self.cost_source,
            "best_manual": best.name if best is not None else None,
            "points": [asdict(p) for p in self.points],
            "meta": dict(self.meta),
        }


def manual_strategies(num_blocks: int) -> list[str]:
    """The registry's frontier points for ``num_blocks`` blocks: ``none, full, every:2 ..
    every:L, sqrt, attn, mlp, ops`` and any registered strategy that asks to be there."""
    return default_strategies("frontier", num_blocks=num_blocks)


def _point(name: str, prof: Profile, budget_bytes: int, step: float,
           device: DeviceSpec, extra_ms: float = 0.0) -> FrontierPoint:
    ms = recompute_ms(prof.ops, device) + extra_ms
    return FrontierPoint(name, prof.peak_bytes, prof.recompute_flops, ms,
                         100.0 * ms / step if step > 0 else 0.0, prof.peak_bytes <= budget_bytes)


def frontier(
    model: nn.Module,
    batch: Any,
    plan: Plan | None = None,
    *,
    budget_bytes: int | None = None,
    strategies: Sequence[str] | None = None,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    blocks: BlocksSpec = None,
    simulate: bool = False,
    device: str | DeviceSpec | None = None,
    label: str = "",
    cost: str | None = None,
) -> Frontier:
    """Measure every manual strategy (and ``plan``) on ``model`` and ``batch``.

    Args:
        model: the model, in train mode; left as it was.
        batch: the batch.
        plan: a plan to add as the point ``"plan"`` (its own measurement is used when it
            has one and its costs are roofline costs). Default: None.
        budget_bytes: the budget the points are judged against. Default: the plan's.
        strategies: the manual strategies. Default: :func:`manual_strategies`.
        loss_fn, optimizer, blocks, simulate: as for :func:`remat.plan`.
        device: the cost device. Default: the plan's, else as for :func:`remat.plan`.
        label: stored on the result.
        cost: ``"roofline"``, ``"measured"`` (timed steps; see the module docstring) or
            ``"auto"`` (measured on CUDA). Default: the plan's cost source, else ``"auto"``.

    Raises:
        ValueError: neither ``plan`` nor ``budget_bytes`` given, or a bad ``cost``.

    Example:
        >>> f = frontier(model, batch, plan)
        >>> f.point("plan").recompute_ms <= f.best_manual().recompute_ms
        True
    """
    if budget_bytes is None:
        if plan is None:
            raise ValueError(message("remat.compare.frontier", "no plan and no budget_bytes",
                                     fix="pass a plan or budget_bytes"))
        budget_bytes = plan.budget_bytes
    if device is None and plan is not None:
        device = plan.cost_device
    if cost is None:
        cost = plan.cost_source if plan is not None else "auto"
    timed = resolve_cost(cost, model, simulate=simulate) == "measured"
    step = Step(model, batch, loss_fn=loss_fn, optimizer=optimizer, blocks=blocks)
    names = list(strategies) if strategies is not None else \
        manual_strategies(len(step.blocks_found(api="remat.compare.frontier")))
    if "none" not in names:
        names.insert(0, "none")
    profiles = _manual_profiles(step, names, simulate=simulate, timed=timed)
    if plan is not None and (timed or plan.measured_peak_bytes is None
                             or plan.cost_source != "roofline"):
        plan_step = step if blocks is not None or plan.blocks is None else \
            Step(model, batch, loss_fn=loss_fn, optimizer=optimizer, blocks=plan.blocks)
        profiles["plan"] = measure_decisions(plan_step, plan.decisions, simulate=simulate,
                                             timing=timed)
    if timed:
        base_ms = profiles["none"].step_ms or 0.0
        points = [_timed_point(name, prof, budget_bytes, base_ms)
                  for name, prof in profiles.items()]
        return Frontier(tuple(points), budget_bytes, base_ms, str(step.device), label,
                        "measured")
    spec = cost_device(step.device, device)
    base_ms = roofline_ms(profiles["none"].ops, spec)
    points = [_point(name, prof, budget_bytes, base_ms, spec) for name, prof in profiles.items()]
    if plan is not None and "plan" not in profiles:
        points.append(FrontierPoint(
            "plan", plan.measured_or_predicted_peak_bytes, plan.recompute_flops,
            plan.recompute_ms, 100.0 * plan.recompute_ms / base_ms if base_ms > 0 else 0.0,
            plan.measured_or_predicted_peak_bytes <= budget_bytes,
        ))
    return Frontier(tuple(points), budget_bytes, base_ms, spec.name, label)


def _manual_profiles(step: Step, names: Sequence[str], *, simulate: bool,
                     timed: bool) -> dict[str, Profile]:
    """Each manual strategy's profile (strategies that do not apply to the model are left
    out, e.g. no attention sub-layer to checkpoint)."""
    profiles: dict[str, Profile] = {}
    for done, name in enumerate(names):
        report(name, done, len(names))
        with trial(step.model, blocks=step.blocks):
            try:  # applied here: a strategy the model does not take is left out
                apply(step.model, name, blocks=step.blocks)
            except (BlocksNotFound, StrategyError):
                continue
            try:
                profiles[name] = profile_step(step, simulate=simulate, timing=timed, repeats=3)
            except (RuntimeError, ValueError) as exc:
                if name == "none":
                    raise
                warnings.warn(message("remat.compare.frontier",
                                      f"could not measure strategy {name!r}",
                                      {"error": f"{type(exc).__name__}: {exc}",
                                       "so": "it is left out of the frontier"},
                                      fix="pass strategies= without it to silence this"),
                              RematWarning, stacklevel=3)
    return profiles


def _timed_point(name: str, prof: Profile, budget_bytes: int, base_ms: float) -> FrontierPoint:
    ms = max((prof.step_ms or 0.0) - base_ms, 0.0)
    return FrontierPoint(name, prof.peak_bytes, prof.recompute_flops, ms,
                         100.0 * ms / base_ms if base_ms > 0 else 0.0,
                         prof.peak_bytes <= budget_bytes)


# ---- remat compare's "plan" row ----------------------------------------------------------

def add_plan_row(
    result: ComparisonResult,
    *,
    budget: int | str = "60%",
    model_factory: Callable[[], nn.Module] | None = None,
    batch: Any = None,
    blocks: BlocksSpec = None,
    loss_fn: LossFn | None = None,
    check_grads: bool = True,
    simulate: bool = False,
) -> ComparisonResult:
    """``result`` with one more row, ``"plan"``: :func:`remat.auto` for ``budget``.

    The plan is made and measured on a fresh model built the way the other rows were
    (same seed), so its peak, activation bytes and recompute FLOPs compare directly;
    its step time is not measured (``step_ms`` is None).

    Args:
        result: a :func:`remat.compare.compare` result containing the ``"none"`` baseline.
        budget: the plan's budget. Default: ``"60%"`` of the un-checkpointed peak.
        model_factory: builds the model. Default: the built-in preset named in
            ``result.meta["model"]`` on ``result.device`` (what ``compare_preset`` records).
        batch: the batch. Default: rebuilt from ``result.meta`` (batch size, sequence
            length, seed).
        blocks, loss_fn: as for :func:`remat.compare.compare`.
        check_grads: check the plan's gradients against the un-checkpointed model.
            Default: True.
        simulate: measure the plan's closed loop under FakeTensorMode. Default: False.

    Raises:
        ValueError: no factory/batch given and ``result.meta`` does not name a preset.

    Example:
        >>> result = add_plan_row(compare_preset("gpt-tiny", 2), budget="70%")
        >>> result.row("plan").peak_bytes <= 0.7 * result.row("none").peak_bytes
        True
    """
    from remat.core.rows import ComparisonResult, StrategyRow
    from remat.planning.planner import auto

    meta = dict(result.meta)
    seed = int(meta.get("seed", 0))
    if model_factory is None or batch is None:
        preset = meta.get("model")
        if not isinstance(preset, str):
            raise ValueError(message(
                "remat.compare.frontier.add_plan_row", "no model to measure the plan on",
                {"result meta model": repr(preset)},
                fix="pass model_factory= and batch=, or a result from compare_preset (whose "
                    "meta names the model preset)"))
        from remat.models import build_model, make_batch

        target = torch.device(result.device)
        if batch is None:
            batch = make_batch(preset, int(meta.get("batch_size", 8)), meta.get("seq_len"),
                               seed=seed, device=target)
        if model_factory is None:
            def model_factory() -> nn.Module:
                with target:
                    return build_model(preset)

    def fresh() -> nn.Module:
        torch.manual_seed(seed)
        model = model_factory()
        model.train()
        return model

    model = fresh()
    plan = auto(model, batch, budget=budget, loss_fn=loss_fn, blocks=blocks, simulate=simulate)
    prof = profile(model, batch, loss_fn=loss_fn, blocks=blocks, timing=False)
    base = result.row(result.baseline)
    report = None
    if check_grads:
        from remat.validation import validate

        report = validate(fresh(), batch, plan, blocks=blocks, loss_fn=loss_fn)

    row = StrategyRow.from_profile("plan", prof, base, report=report)
    meta["plan"] = {"budget": str(budget), "budget_bytes": plan.budget_bytes,
                    "decisions": plan.label()}
    rows = tuple(r for r in result.rows if r.strategy != "plan") + (row,)
    return ComparisonResult(rows=rows, device=result.device, repeats=result.repeats,
                            label=result.label, baseline=result.baseline, meta=meta)

