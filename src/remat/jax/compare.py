"""Every strategy on the same NNX model and batch, as the PyTorch ``remat compare`` table.

Returns the shared :class:`remat.core.rows.ComparisonResult` (rows of
:class:`~remat.core.rows.StrategyRow`), so the same table and plot render it, with
an optional ``"plan"`` row (:func:`add_plan_row`, ``remat compare --plan-budget``). Bytes
and FLOPs are XLA's (see analysis.py); ``activation_bytes`` is the residual bytes
JAX saves for backward; ``step_ms`` is the median wall time of the compiled step
when ``repeats > 0``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import nnx

from remat.core.budget import BudgetLike
from remat.core.rows import ComparisonResult, StrategyRow
from remat.errors import message
from remat.jax.analysis import LossFn, compile_fn, default_loss, step_fn
from remat.jax.blocks import BlocksSpec
from remat.jax.measure import profile
from remat.jax.models import build_model, make_batch
from remat.jax.planner import plan
from remat.jax.policies import strategy_policies
from remat.jax.strategies import apply, remove
from remat.jax.validate import validate

_API = "remat.jax.compare"

#: What ``remat compare --framework jax`` runs by default, baseline first.
DEFAULT_STRATEGIES: tuple[str, ...] = (
    "none", "full", "every:2", "sqrt", "dots_saveable", "dots_with_no_batch_dims_saveable",
    "save_only_these_names:qkv,mlp_up",
)

ProgressFn = Callable[[str, int, int], None]


def _step_ms(model: nnx.Module, batch: Any, loss_fn: LossFn, repeats: int) -> float:
    graphdef, state = nnx.split(model)
    compiled = compile_fn(step_fn(graphdef, loss_fn), state, batch, analysis_only=False)
    jax.block_until_ready(compiled(state, batch))  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(state, batch))
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def compare(preset_or_model: str | nnx.Module = "gpt-small", batch: Any = None,
            strategies: Sequence[str] = DEFAULT_STRATEGIES, *, batch_size: int = 8,
            seq_len: int | None = None, loss_fn: LossFn | None = None,
            blocks: BlocksSpec = None, repeats: int = 0, check_grads: bool = True,
            label: str = "", meta: Mapping[str, Any] | None = None,
            progress: ProgressFn | None = None,
            plan_budget: BudgetLike | None = None) -> ComparisonResult:
    """XLA's peak, residual bytes, FLOPs (and optionally time) per strategy, with gradient checks.

    Checkpointing trades compute for memory; this shows both sides for one model and
    batch as XLA compiles the step. Strategies are applied in turn to the same model
    (it is left as it was: remat policies removed).

    Args:
        preset_or_model: a preset name of :data:`remat.jax.PRESETS` or an NNX model.
            Default: ``"gpt-small"``.
        batch: the batch. Default: :func:`remat.jax.make_batch` of the preset.
        strategies: strategy strings; ``"none"`` is added first when missing.
            Default: :data:`DEFAULT_STRATEGIES`.
        batch_size, seq_len: for the default batch. Default: 8, the preset's length.
        loss_fn: ``loss_fn(model, batch) -> scalar``. Default: the model returns its loss.
        blocks: which modules are blocks. Default: automatic.
        repeats: timed steps per strategy; 0 skips timing. Default: 0.
        check_grads: validate each strategy's gradients (rtol 1e-5). Default: True.
        label, meta: stored on the result.
        progress: ``progress(description, completed, total)``.
        plan_budget: add a ``"plan"`` row, :func:`add_plan_row` for this budget (as
            ``remat compare --plan-budget``). Default: None (no plan row).

    Returns:
        A :class:`remat.core.rows.ComparisonResult`, baseline first.

    Raises:
        StrategyError: an unknown strategy.
        ValueError: duplicate strategies or ``repeats < 0``.
        BudgetTooSmall: no plan fits ``plan_budget``.

    Example:
        >>> result = compare("gpt-tiny", strategies=["none", "full"], batch_size=2)
        >>> result.row("full").peak_bytes < result.row("none").peak_bytes
        True
    """
    if repeats < 0:
        raise ValueError(message(_API, "repeats must be >= 0", {"repeats": repeats},
                                 fix="pass repeats=0 (no timing) or more"))
    names = [s.strip() for s in strategies]
    if len(set(names)) != len(names):
        raise ValueError(message(_API, "duplicate strategies", {"strategies": names},
                                 fix="name each strategy once"))
    if "none" not in names:
        names.insert(0, "none")
    else:
        names.remove("none")
        names.insert(0, "none")
    for name in names:
        strategy_policies(name, 1)  # StrategyError for unknown names, before any compile
    model = build_model(preset_or_model) if isinstance(preset_or_model, str) else preset_or_model
    if batch is None:
        if not isinstance(preset_or_model, str):
            raise ValueError(message(_API, "a model needs a batch",
                                     {"model": type(preset_or_model).__name__,
                                      "why": "only a preset name has a default batch"},
                                     fix="pass batch="))
        batch = make_batch(preset_or_model, batch_size, seq_len)
    fn = default_loss if loss_fn is None else loss_fn
    total = len(names)
    rows = []
    profiles: dict[str, Any] = {}
    times: dict[str, float | None] = {}
    reports: dict[str, Any] = {}
    try:
        for done, name in enumerate(names):
            if progress is not None:
                progress(f"compile {name}", done, total)
            apply(model, name, blocks=blocks)
            profiles[name] = profile(model, batch, loss_fn=fn, blocks=blocks)
            times[name] = _step_ms(model, batch, fn, repeats) if repeats else None
            if check_grads:
                reports[name] = validate(model, batch, None, loss_fn=fn, blocks=blocks)
        if progress is not None:
            progress("done", total, total)
    finally:
        apply(model, "none", blocks=blocks)
    base = profiles["none"]
    for name in names:
        rows.append(StrategyRow.from_profile(name, profiles[name], base, step_ms=times[name],
                                             base_ms=times["none"], report=reports.get(name)))
    preset = preset_or_model if isinstance(preset_or_model, str) else type(model).__name__
    result = ComparisonResult(rows=tuple(rows), device=f"jax:{jax.default_backend()}",
                              repeats=repeats, label=label or f"{preset} (JAX, XLA analysis)",
                              meta={"framework": "jax", "model": preset, **dict(meta or {})})
    if plan_budget is None:
        return result
    return add_plan_row(result, model, batch, budget=plan_budget, loss_fn=loss_fn,
                        blocks=blocks, check_grads=check_grads)


def add_plan_row(result: ComparisonResult, model: nnx.Module, batch: Any, *,
                 budget: BudgetLike = "50%", loss_fn: LossFn | None = None,
                 blocks: BlocksSpec = None, check_grads: bool = True) -> ComparisonResult:
    """``result`` with one more row, ``"plan"``: :func:`remat.jax.plan` for ``budget``.

    The JAX twin of :func:`remat.compare.frontier.add_plan_row`: the plan is made on
    ``model`` and ``batch`` (those of the other rows), applied, and measured like them
    (XLA's peak and FLOPs of the step, gradients checked); ``step_ms`` is not
    measured. ``meta["plan"]`` records the budget, its bytes and the decisions. The
    model is left without remat.

    Args:
        result: a :func:`compare` result containing the ``"none"`` baseline.
        model, batch: the model and batch the rows were measured on.
        budget: the plan's budget (bytes, ``"12GiB"``, or a % of none's XLA peak).
            Default: ``"50%"`` (as ``remat compare --plan-budget``).
        loss_fn, blocks: as for :func:`compare`.
        check_grads: validate the plan's gradients (rtol 1e-5). Default: True.

    Raises:
        BudgetTooSmall: no plan fits ``budget``.

    Example:
        >>> result = add_plan_row(compare(model, batch, ["full"]), model, batch, budget="80%")
        >>> result.row("plan").peak_bytes <= result.meta["plan"]["budget_bytes"]
        True
    """
    fn = default_loss if loss_fn is None else loss_fn
    planned = plan(model, batch, budget=budget, loss_fn=fn, blocks=blocks)
    try:
        apply(model, planned)
        prof = profile(model, batch, loss_fn=fn, blocks=blocks)
        report = validate(model, batch, None, loss_fn=fn, blocks=blocks) if check_grads \
            else None
    finally:
        remove(model)
    row = StrategyRow.from_profile("plan", prof, result.row(result.baseline), report=report)
    meta = dict(result.meta)
    meta["plan"] = {"budget": str(budget), "budget_bytes": planned.budget_bytes,
                    "decisions": planned.label()}
    rows = tuple(r for r in result.rows if r.strategy != "plan") + (row,)
    return ComparisonResult(rows=rows, device=result.device, repeats=result.repeats,
                            label=result.label, baseline=result.baseline, meta=meta)
