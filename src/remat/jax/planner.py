"""Plan ``jax.checkpoint`` policies per block for a byte budget, checked against XLA.

Candidates: candidates.py (NOTE [ JAX candidates ], NOTE [ Block chain ]); the peak
model and the closed loop: loop.py (NOTE [ JAX peak model ], NOTE [ JAX closed loop ]).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from remat.core.budget import BudgetLike, parse_budget
from remat.core.cost import static_bytes
from remat.errors import names_the_call
from remat.jax.analysis import LossFn, analyze_step, default_loss, prefetch_step
from remat.jax.blocks import BlocksSpec, named_blocks
from remat.jax.candidates import Measure, candidate_tables
from remat.jax.loop import Search
from remat.jax.measure import state_bytes, tree_bytes
from remat.jax.models import build_model, make_batch
from remat.jax.plans import Plan
from remat.jax.policies import Policy
from remat.jax.strategies import apply, current_policies, remove


@names_the_call("remat.jax.plan")
def plan(model: nnx.Module, batch: Any, *, budget: BudgetLike, loss_fn: LossFn | None = None,
         blocks: BlocksSpec = None, policies: Sequence[str | Policy] = (),
         max_rounds: int = 6, measure: Measure = "block") -> Plan:
    """The per-block policies with the fewest recompute FLOPs whose XLA peak fits ``budget``.

    Trades compute for memory like :func:`remat.plan`: candidates are measured per
    kind of block, a linear peak model is solved exactly (the shared MILP solver),
    and a closed loop compiles the chosen plan until XLA's peak fits
    (NOTE [ JAX closed loop ]). Nothing is run: the model and batch may be abstract
    (``nnx.eval_shape``, ``jax.ShapeDtypeStruct``). The model is left as it was.

    Args:
        model: a Flax NNX module with repeated blocks.
        batch: its batch.
        budget: bytes (int), ``"12GiB"``, or ``"60%"`` of the un-checkpointed XLA peak.
        loss_fn: ``loss_fn(model, batch) -> scalar``. Default: the model returns its loss.
        blocks: which modules are blocks. Default: automatic.
        policies: extra candidate policies, e.g. ``["offload:qkv"]``. Default: none.
        max_rounds: solver/compile rounds before falling back to the manual menu.
            Default: 6.
        measure: how candidates are measured: ``"block"`` (a chain of the block alone,
            fast) or ``"step"`` (the whole step per candidate: exact, slow). See
            NOTE [ JAX candidates ] in candidates.py. Default: ``"block"``.

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
    paths = [p for p, _ in named_blocks(model, blocks)]
    before = current_policies(model, paths)
    try:
        remove(model)
        prefetch_step(model, batch, loss_fn=fn)  # compiles while the candidates are traced
        by_path = candidate_tables(model, batch, loss_fn=fn, blocks=paths, policies=policies,
                                   measure=measure)
        base = analyze_step(model, batch, loss_fn=fn)
        param_bytes, buffer_bytes = state_bytes(model)
        static = static_bytes(base.breakdown(param_bytes=param_bytes, buffer_bytes=buffer_bytes,
                                             batch_bytes=tree_bytes(batch)))
        budget_bytes = parsed.resolve(base.peak_bytes, static_bytes=static)
        search = Search(model, batch, fn, paths, [by_path[p] for p in paths], base,
                        budget_bytes)
        best = search.run(max_rounds)
        return Plan(
            decisions=dict(zip(paths, best.policies, strict=True)),
            block_names=tuple(paths),
            budget_bytes=budget_bytes,
            predicted_peak_bytes=search.predicted(best),
            measured_peak_bytes=best.analysis.peak_bytes,
            recompute_flops=max(0, best.analysis.flops - base.flops),
            no_checkpoint_peak_bytes=base.peak_bytes,
            batch_size=_batch_size(batch),
            backend=jax.default_backend(),
        )
    finally:
        apply(model, dict(zip(paths, before, strict=True)))


def _batch_size(batch: Any) -> int | None:
    leaves = [x for x in jax.tree.leaves(batch) if getattr(x, "ndim", 0) >= 1]
    return int(leaves[0].shape[0]) if leaves else None


def auto(model: nnx.Module, batch: Any, *, budget: BudgetLike, loss_fn: LossFn | None = None,
         blocks: BlocksSpec = None, policies: Sequence[str | Policy] = (),
         measure: Measure = "block") -> Plan:
    """:func:`plan`, then :func:`~remat.jax.apply` the plan to ``model``; returns the plan.

    Example:
        >>> p = auto(model, batch, budget="50%")
        >>> decisions_of(model) == {n: d.label() for n, d in p.decisions.items()}
        True
    """
    result = plan(model, batch, budget=budget, loss_fn=loss_fn, blocks=blocks,
                  policies=policies, measure=measure)
    apply(model, result)
    return result


def plan_preset(preset: str = "gpt-small", *, budget: BudgetLike, batch_size: int = 8,
                seq_len: int | None = None, seed: int = 0, measure: Measure = "block") -> Plan:
    """:func:`plan` for a built-in NNX preset and its random batch (``remat plan --framework jax``).

    Planning compiles and never runs the step, so the model and the batch are
    built abstractly (``nnx.eval_shape`` / ``jax.eval_shape``: arrays are
    ``jax.ShapeDtypeStruct``, nothing is initialized or run); XLA compiles the
    same programs as for the real model and batch, so the plan is the same.

    Example:
        >>> plan_preset("gpt-tiny", budget="60%", batch_size=2).framework
        'jax'
    """
    model = nnx.eval_shape(lambda: build_model(preset, seed=seed))
    batch = jax.eval_shape(lambda: make_batch(preset, batch_size, seq_len, seed=seed))
    return plan(model, batch, budget=budget, measure=measure)
