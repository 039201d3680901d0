"""remat for JAX: ``jax.checkpoint`` policies per block, measured by XLA and planned for a budget.

The JAX backend of remat (install with ``pip install 'remat[jax]'``). It works on
Flax NNX models with a repeated stack of blocks; the step it measures is
``jax.jit`` of ``nnx.value_and_grad(loss_fn)(model, batch)``, and every byte and
FLOP it reports is what XLA's compiled analysis says::

    import remat.jax as rj

    model = rj.build_model("gpt-small")
    batch = rj.make_batch(model, 8)
    print(rj.profile(model, batch).peak_bytes)        # XLA's peak of one step
    plan = rj.auto(model, batch, budget="50%")         # plan, apply, check with XLA
    assert rj.validate(model, batch, plan).passed      # gradients unchanged

``import remat`` never imports this package (nor jax); it loads when used.
"""

try:
    import flax.nnx  # noqa: F401
    import jax  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    from remat.errors import message

    raise ImportError(message("remat.jax", "needs jax and flax, which are not installed",
                              {"error": str(exc)},
                              fix="pip install 'remat[jax]'")) from exc

from remat.jax.analysis import StepAnalysis, analyze_step, compiler_options
from remat.jax.blocks import find_blocks
from remat.jax.compare import DEFAULT_STRATEGIES, compare
from remat.jax.measure import JaxprStats, jaxpr_stats, profile
from remat.jax.models import PRESETS, GPTConfig, build_model, make_batch
from remat.jax.planner import auto, plan, plan_preset
from remat.jax.plans import Plan
from remat.jax.policies import POLICIES, STRATEGIES, Policy
from remat.jax.strategies import apply, checkpoint_layer, decisions_of, remove
from remat.jax.validate import validate

__all__ = [
    "DEFAULT_STRATEGIES",
    "GPTConfig",
    "JaxprStats",
    "POLICIES",
    "PRESETS",
    "Plan",
    "Policy",
    "STRATEGIES",
    "StepAnalysis",
    "analyze_step",
    "apply",
    "auto",
    "build_model",
    "checkpoint_layer",
    "compare",
    "compiler_options",
    "decisions_of",
    "find_blocks",
    "jaxpr_stats",
    "make_batch",
    "plan",
    "plan_preset",
    "profile",
    "remove",
    "validate",
]
