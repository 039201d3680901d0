"""Measure each kind of block's candidate policies with XLA (see NOTE [ JAX candidates ]).

NOTE [ JAX candidates ]
    For each kind of block (same class, parameter shapes and input shapes; one
    representative is measured, the blocks being identical) the candidate
    policies are ``none``, ``nothing_saveable``, ``dots_saveable``,
    ``dots_with_no_batch_dims_saveable``, ``save_only_these_names`` with each
    name tagged in the block (``checkpoint_name``) alone and with all of them,
    plus any ``policies=`` given. Policies dominated before any compile are
    skipped (NOTE [ Pruning before compiling ]). Each remaining policy is
    measured by XLA, on one of two programs (``measure=``):

    * ``"block"`` (default, NOTE [ Block chain ]): a chain of
      :data:`CHAIN_BLOCKS` copies of the block alone, forward and backward,
      the first copy under the policy and the others ``none``;
    * ``"step"`` (the exact path): the whole training step with the
      representative block under the policy and every other block ``none``.

    Either way the candidate's recompute is the program's extra FLOPs
    (``cost_analysis``) over the same program without remat, and its saved
    bytes the block's un-checkpointed residuals minus what XLA's peak dropped
    by. Candidates with no fewer saved bytes and no fewer FLOPs than another are
    dropped. ``tests/jax/test_candidates.py`` compares the two paths.

NOTE [ Block chain ]
    Compiling the whole step per candidate costs a whole-step compile each. The
    blocks of a stack are
    identical, so a candidate's effect is measured on the block alone:
    ``x -> B_p(x) -> B(.) -> B(.)``, forward and backward (``jax.vjp``, the
    output cotangent an argument), where ``B_p`` runs under the candidate
    policy. Its residuals stay alive while the later copies run their backward,
    which is where the chain's peak is, so XLA's peak drops by what the policy
    saves, as in the whole step where the later blocks and the head hold the
    peak. One copy alone would not do: its backward recomputes what the policy
    dropped, so its peak would not move. The chain needs a block whose output
    has the shape of its first array argument (a residual stack); other kinds
    are measured on the whole step.

NOTE [ Pruning before compiling ]
    A compile costs ~1 s whatever the program's size (XLA:CPU's per-kernel
    code generation), so candidates that cannot be chosen are not compiled.
    Before compiling, each policy gets two estimates that need no compile: its
    residual bytes (JAX's residual inspection of the block alone) and its
    chain's FLOPs (``cost_analysis()`` of the chain's lowering, i.e. the
    unoptimized program, which already holds the recomputation). A policy with
    no fewer estimated bytes and no fewer estimated FLOPs than an earlier one
    is not compiled. The estimates are not XLA's figures (XLA does not
    materialize every residual, and optimizes the program), but on the preset
    they order the policies as XLA's do: ``save_only_these_names`` of
    ``attn_probs`` or ``mlp_act`` alone recompute what ``nothing_saveable``
    does and save more, and are skipped; every compiled candidate is
    XLA-measured. Blocks that do not chain have no FLOP estimate; policies
    with the same residual bytes as an earlier one are skipped there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jax
from flax import nnx

from remat.errors import current_call, message
from remat.jax.analysis import (
    LossFn,
    analyze_step,
    analyze_steps,
    cached,
    default_loss,
    submit_lowered,
    wait,
)
from remat.jax.block_measure import (
    BlockInputs,
    block_inputs,
    block_saved_bytes,
    memo,
    tagged_names,
)
from remat.jax.blocks import BlocksSpec, named_blocks
from remat.jax.chains import chains, lower_chains, with_policy
from remat.jax.policies import NONE, Policy, parse_policy
from remat.jax.strategies import apply, current_policies, remove

Measure = Literal["block", "step"]
#: What ``measure=`` accepts (NOTE [ JAX candidates ]).
MEASURES: tuple[str, ...] = ("block", "step")


@dataclass(frozen=True)
class JaxCandidate:
    """One policy for one kind of block, measured (see NOTE [ JAX candidates ]).

    It is a :class:`remat.core.peak.CandidateLike`: the shared peak model and solver read
    its ``saved_bytes``, working sets and ``recompute_ms``.

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
                raise ValueError(message(f"JaxCandidate({self.label()})",
                                         f"{key} must be >= 0",
                                         {key: getattr(self, key)},
                                         fix="pass bytes and FLOPs as non-negative ints"))

    @property
    def recompute_ms(self) -> float:
        """The solver's cost: ``recompute_flops * 1e-9``, so its integer cost is the FLOPs."""
        return self.recompute_flops * 1e-9

    def label(self) -> str:
        """The policy's label."""
        return self.policy.label()


def _kind_key(block: nnx.Module, inputs: Any) -> Any:
    base = getattr(type(block), "_remat_original", None) or type(block)
    shapes = jax.tree.map(lambda a: (a.shape, str(a.dtype)), nnx.state(block))
    return base, repr(shapes), repr(inputs)


def candidate_tables(model: nnx.Module, batch: Any, *, loss_fn: LossFn | None = None,
                     blocks: BlocksSpec = None, policies: Sequence[str | Policy] = (),
                     prune: bool = True, measure: Measure = "block",
                     default_policies: bool = True) -> dict[str, tuple[JaxCandidate, ...]]:
    """Each block's measured candidates, ``none`` first (NOTE [ JAX candidates ]).

    The model's own policies are ignored (and left as they were).

    Args:
        policies: candidates besides the default ones. Default: none.
        prune: drop dominated candidates and policies with the same residuals as an
            earlier one. Default: True.
        measure: ``"block"`` (a chain of the block alone, NOTE [ Block chain ]) or
            ``"step"`` (the whole step per candidate: exact, slow). Default: ``"block"``.
        default_policies: measure the default candidates of NOTE [ JAX candidates ];
            False measures ``none`` and ``policies`` only. Default: True.

    Example:
        >>> tables = candidate_tables(model, batch)
        >>> [c.label() for c in tables["blocks.0"]][:2]
        ['none', 'nothing_saveable']
    """
    if measure not in MEASURES:
        raise ValueError(message(current_call("remat.jax.plan"), f"unknown measure {measure!r}",
                                 {"measures": ", ".join(MEASURES)},
                                 fix="pass one of the measures"))
    fn = default_loss if loss_fn is None else loss_fn
    named = named_blocks(model, blocks)
    paths = [p for p, _ in named]
    before = current_policies(model, paths)
    try:
        remove(model)
        inputs = block_inputs(model, batch, paths, fn)
        by_kind: dict[Any, tuple[JaxCandidate, ...]] = {}
        out: dict[str, tuple[JaxCandidate, ...]] = {}
        for path, block in named:
            key = _kind_key(block, inputs[path])
            if key not in by_kind:
                wanted = _wanted(block, inputs[path], policies) if default_policies \
                    else list(dict.fromkeys(parse_policy(p) for p in policies))
                by_kind[key] = _measure_kind(model, batch, fn, path, block, inputs[path],
                                             wanted, prune, measure)
            out[path] = by_kind[key]
        return out
    finally:
        apply(model, dict(zip(paths, before, strict=True)))


def _wanted(block: nnx.Module, inputs: BlockInputs, policies: Sequence[str | Policy]
            ) -> list[Policy]:
    names = tagged_names(block, inputs)
    wanted = [Policy("nothing_saveable"), Policy("dots_saveable"),
              Policy("dots_with_no_batch_dims_saveable")]
    wanted += [Policy("save_only_these_names", (n,)) for n in names]
    if len(names) > 1:
        wanted.append(Policy("save_only_these_names", names))
    wanted += [parse_policy(p) for p in policies]
    return list(dict.fromkeys(wanted))


def _measure_kind(model: nnx.Module, batch: Any, fn: LossFn, path: str, block: nnx.Module,
                  inputs: BlockInputs, wanted: Sequence[Policy], prune: bool,
                  measure: Measure) -> tuple[JaxCandidate, ...]:
    none_saved = block_saved_bytes(block, inputs)
    policies = [NONE, *wanted]
    chained = chains(block, inputs)
    on_chain = measure == "block" and chained
    lowerings = lower_chains(block, inputs, policies) if chained else None
    saved: list[int] = []
    flops: list[int] = []
    measured: list[Policy] = []
    keys: list[Any] = []
    for i, policy in enumerate(policies):  # lower, estimate, compile: pipelined
        saved.append(none_saved if i == 0 else
                     block_saved_bytes(with_policy(block, policy), inputs))
        key, lower = next(lowerings) if lowerings is not None else (None, None)
        lowered = None
        if lower is not None:
            estimate, lowered = _estimated_flops(key, lower)
            flops.append(estimate)
        if i > 0 and prune and _dominated(i, saved, flops if chained else None):
            continue  # NOTE [ Pruning before compiling ]
        if i > 0:
            measured.append(policy)
        if on_chain and lower is not None:
            submit_lowered(key, lowered if lowered is not None else lower()[1])
            keys.append(key)
    if on_chain:
        base, *steps = wait(keys)
    else:
        base = analyze_step(model, batch, loss_fn=fn)

        def configure(policy: Policy) -> Callable[[], Any]:
            return lambda: apply(model, {path: policy})

        steps = analyze_steps(model, batch, [configure(p) for p in measured], loss_fn=fn)
        remove(model)
    table = [JaxCandidate(NONE, none_saved, none_saved, 0)]
    for policy, step in zip(measured, steps, strict=True):
        # XLA's own saving for this block: what the peak dropped by (NOTE [ JAX peak model ]).
        measured_saved = max(0, none_saved - (base.peak_bytes - step.peak_bytes))
        table.append(JaxCandidate(policy, measured_saved, none_saved,
                                  max(0, step.flops - base.flops)))
    return tuple(_prune(table) if prune else table)


def _estimated_flops(key: Any, lower: Callable[[], tuple[Any, Any]]) -> tuple[int, Any]:
    """XLA's FLOPs of a chain (the compiled count when cached, else the lowering's, cached),
    and the lowering when it was made."""
    done = cached(key)
    if done is not None:
        return done.flops, None
    made: list[Any] = []

    def from_lowering() -> int:
        made.append(lower()[1])
        cost = made[0].cost_analysis()
        if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
            cost = cost[0] if cost else {}
        return int(round(float((cost or {}).get("flops", 0.0))))

    return int(memo(("estimate", key), from_lowering)), (made[0] if made else None)


def _dominated(i: int, saved: Sequence[int], flops: Sequence[int] | None) -> bool:
    """Whether an earlier candidate's estimates are no worse than candidate ``i``'s.

    See NOTE [ Pruning before compiling ]: ``saved`` and ``flops`` (None: no FLOP
    estimate, compare residual bytes only) are the estimates of candidates ``0..i``.
    """
    if flops is None:
        return saved[i] in saved[:i]
    return any(saved[j] <= saved[i] and flops[j] <= flops[i] for j in range(i))


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
