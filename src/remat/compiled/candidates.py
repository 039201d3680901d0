"""What each block can do under ``torch.compile``, measured: the candidates of a compiled plan.

NOTE [ Compiled candidates ]
    A compiled candidate is a remat decision for a block (``none``, ``full``, an
    op-level save set) plus the activation memory budget the block is compiled
    with (see ``remat/compiled/install.py``): the compiler's own trade-offs
    (``none`` at budgets 1.0 / 0.75 / 0.5 / 0.25 / 0.0) and remat's (checkpoints and SAC
    save sets, whose tags the partitioner obeys) side by side. Compiled code cannot
    be run on fake tensors honestly, so every candidate is measured for real:
    one whole compiled step with every block at that candidate, under the
    allocator (:func:`~remat.compiled.measure.measure_compiled`). That gives, per
    block, the bytes its compiled forward saves and the FLOPs its backward
    recomputes (from the partitioned graphs), and for the step the peak and the
    bytes alive at its start. The step's peak minus those static bytes and minus
    every block's saved bytes is the candidate's transient: what the backward of
    one block adds on top of everything saved (see NOTE [ Predicting a compiled
    mixture ] in plan.py).

    Identical blocks at the same candidate share one backend (NOTE [ One backend
    per kind of block ]), and the context keeps the backends, so planning another
    budget, or measuring a mixture of candidates, reuses dynamo's compiled graphs.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from remat.blocks import find_sublayer
from remat.compiled.install import WHOLE_MODEL, BackendCache, compile_plan, uncompile
from remat.compiled.measure import CompiledMeasurement, measure_compiled
from remat.core.cost import static_bytes
from remat.errors import BlocksNotFound, RematError, RematWarning, StrategyError, message
from remat.measure.step import Step
from remat.strategies import BlockStrategy, parse_strategy
from remat.strategies.apply import trial
from remat.strategies.builtin import Full, NoCheckpoint, SelectiveOps

_API = "remat.plan_compiled"


@dataclass(frozen=True)
class CompiledCandidate:
    """One way to run a block compiled: a remat decision and the compiler's budget.

    Args:
        decision: what remat installs on the block before compiling it.
        compiler_budget: the block's ``activation_memory_budget`` in [0, 1].
    """

    decision: BlockStrategy
    compiler_budget: float

    def label(self) -> str:
        """e.g. ``"none@0.5"``, ``"full@1.0"``."""
        return f"{self.decision.label()}@{self.compiler_budget:g}"


#: The compiler alone at five budgets, then remat's full checkpoint and default SAC set.
#: (SAC at a budget below 1.0 is not offered: inductor 2.13 fails an assertion on it.)
DEFAULT_COMPILED_CANDIDATES: tuple[CompiledCandidate, ...] = (
    CompiledCandidate(NoCheckpoint(), 1.0),
    CompiledCandidate(NoCheckpoint(), 0.75),
    CompiledCandidate(NoCheckpoint(), 0.5),
    CompiledCandidate(NoCheckpoint(), 0.25),
    CompiledCandidate(NoCheckpoint(), 0.0),
    CompiledCandidate(Full(), 1.0),
    CompiledCandidate(SelectiveOps(), 1.0),
)


@dataclass
class CompiledContext:
    """The candidates of one step, measured uniformly (see NOTE [ Compiled candidates ]).

    Args:
        names: the blocks, in order.
        candidates: the candidates; index 0 is the reference (no remat, budget 1.0).
        uniform: per candidate, the step measured with every block at it.
        static_bytes: the reference step's static bytes (NOTE [ Static bytes ] in
            remat/core/cost.py): parameters, buffers, optimizer state and batch alive at
            its start (its gradients are in its ``step_temporaries``).
        saved: ``saved[c][i]``: bytes block ``i`` saves at candidate ``c``.
        recompute_flops: ``recompute_flops[c][i]``, from the partitioned graphs.
        transient: per candidate, its step peak above static and saved bytes.
        backends: compiled backends reused across measurements.
        measured: peaks of assignments measured so far (tuple of candidate indices).
        whole_budgets: compiler budgets at which compiling the whole model is also a
            plan, tried in this order (NOTE [ Whole-model options ] in plan.py).
        whole: those whole-model steps measured so far, by budget.
    """

    names: tuple[str, ...]
    candidates: tuple[CompiledCandidate, ...]
    uniform: tuple[CompiledMeasurement, ...]
    static_bytes: int
    saved: tuple[tuple[int, ...], ...]
    recompute_flops: tuple[tuple[int, ...], ...]
    transient: tuple[int, ...]
    backends: BackendCache = field(default_factory=dict)
    measured: dict[tuple[int, ...], int] = field(default_factory=dict)
    whole_budgets: tuple[float, ...] = ()
    whole: dict[float, CompiledMeasurement] = field(default_factory=dict)

    @property
    def no_checkpoint_peak_bytes(self) -> int:
        """The reference compiled step's peak (no remat, compiler budget 1.0)."""
        return self.uniform[0].peak_bytes


@contextmanager
def _recompile_room(extra: int) -> Iterator[None]:
    """Let dynamo keep one cache entry per candidate (``Module._call_impl`` is one code
    object for every module compiled in place)."""
    import torch._dynamo.config as dynamo_config

    limit = max(int(dynamo_config.recompile_limit), 8 + extra)
    with dynamo_config.patch(recompile_limit=limit,
                             accumulated_recompile_limit=max(
                                 int(dynamo_config.accumulated_recompile_limit), 256 + extra)):
        yield


def measure_assignment(step: Step, names: Sequence[str],
                       candidates: Sequence[CompiledCandidate], assignment: Sequence[int],
                       backends: BackendCache) -> CompiledMeasurement:
    """One compiled step with block ``names[i]`` at ``candidates[assignment[i]]``.

    The model is left as it was (strategy and compile undone, state restored).

    Raises:
        RematError: dynamo ran a block eagerly (its recompile limit), so the peak
            would not be the compiled one.
    """
    decisions = {n: candidates[a].decision for n, a in zip(names, assignment, strict=True)}
    budgets = {n: candidates[a].compiler_budget
               for n, a in zip(names, assignment, strict=True)}
    return _measure(step, decisions, budgets, backends, len(candidates))


def measure_whole(step: Step, names: Sequence[str], budget: float) -> CompiledMeasurement:
    """One compiled step of the whole model compiled at ``budget``, no remat on any block
    (the compiler's own setting, a plan of its own: NOTE [ Whole-model options ] in
    plan.py). The model is left as it was."""
    decisions = {n: DEFAULT_COMPILED_CANDIDATES[0].decision for n in names}
    # Room for every candidate's and whole-model compile's entry of Module._call_impl.
    return _measure(step, decisions, {WHOLE_MODEL: budget}, {}, 64)


def _measure(step: Step, decisions: dict[str, BlockStrategy], budgets: dict[str, float],
             backends: BackendCache, entries: int) -> CompiledMeasurement:
    model = step.model
    before = {m: m._compiled_call_impl for m in model.modules()
              if getattr(m, "_compiled_call_impl", None) is not None}
    with trial(model, decisions, blocks=step.blocks, quiet=False,
               within=_recompile_room(entries)):
        compile_plan(model, budgets, blocks=step.blocks, backends=backends)
        try:
            result = measure_compiled(model, step.batch, loss_fn=step.loss_fn,
                                      optimizer=step.optimizer, timing=False)
        finally:
            uncompile(model)
            for module, impl in before.items():  # the user's own compiles stay
                module._compiled_call_impl = impl
    if result.eager_regions:
        raise RematError(message(
            _API, "dynamo ran regions eagerly while remat measured candidates",
            {"regions": list(result.eager_regions)[:3],
             "why": "its recompile limit was reached, so no compiled peak could be measured"},
            fix="raise torch._dynamo.config.recompile_limit or call torch._dynamo.reset() "
                "before planning"))
    return result


def default_candidates(step: Step) -> tuple[CompiledCandidate, ...]:
    """:data:`DEFAULT_COMPILED_CANDIDATES`, plus checkpointing only the attention or only
    the MLP sub-layer (compiled at 1.0) when every block has one."""
    found = step.blocks_found(api=_API)
    extra = []
    for kind in ("attn", "mlp"):
        try:
            for _, block in found:
                find_sublayer(block, kind)  # type: ignore[arg-type]
        except (BlocksNotFound, StrategyError, ValueError):
            continue
        strategy = parse_strategy(kind, api="remat.plan")
        if isinstance(strategy, BlockStrategy):
            extra.append(CompiledCandidate(strategy, 1.0))
    return DEFAULT_COMPILED_CANDIDATES + tuple(extra)


#: The whole model compiled at these budgets is a plan too, tried in this order.
WHOLE_MODEL_BUDGETS: tuple[float, ...] = (1.0, 0.75, 0.5, 0.25)


def prepare_compiled(step: Step, candidates: Sequence[CompiledCandidate] | None = None, *,
                     whole_budgets: Sequence[float] = WHOLE_MODEL_BUDGETS) -> CompiledContext:
    """Measure every candidate on every block (one compiled step per candidate).

    Args:
        step: the step, with a real (not meta, not fake) model in train mode.
        candidates: the candidates; the first must be the reference ``none@1.0``.
            Default: :func:`default_candidates`.
        whole_budgets: compiler budgets at which the whole model compiled is also a
            plan (measured lazily, when a plan is asked for). Default:
            :data:`WHOLE_MODEL_BUDGETS`; ``()`` plans per block only.
    """
    cands = tuple(candidates or default_candidates(step))
    if cands[0] != DEFAULT_COMPILED_CANDIDATES[0]:
        raise ValueError(message(_API, "the first candidate must be none@1.0 (the reference)",
                                 {"found": cands[0].label()},
                                 fix="put none@1.0 first in candidates"))
    names = tuple(step.block_names(api=_API))
    backends: BackendCache = {}
    uniform = []
    kept: list[CompiledCandidate] = []
    for index, cand in enumerate(cands):
        try:
            uniform.append(measure_assignment(step, names, cands, [index] * len(names),
                                              backends))
        except RematError:
            raise
        except Exception as error:  # the compiler failed on this candidate: plan without it
            if index == 0:
                raise
            warnings.warn(message(_API, f"the compiler failed on candidate {cand.label()}",
                                  {"error": f"{type(error).__name__}: "
                                            f"{str(error).splitlines()[0][:200]}",
                                   "so": "planning without it"},
                                  fix="nothing to do; the plan uses the other candidates"),
                          RematWarning, stacklevel=2)
            continue
        kept.append(cand)
    cands = tuple(kept)
    ref = uniform[0]
    static = static_bytes(ref.profile.peak_breakdown)
    saved, rec, transient = [], [], []
    for m in uniform:
        per_block = {b.name: b for b in m.profile.blocks}
        saved.append(tuple(per_block[n].saved_bytes for n in names))
        rec.append(tuple(per_block[n].recompute_flops for n in names))
        transient.append(max(0, m.peak_bytes - static - sum(saved[-1])))
    measured = {tuple([i] * len(names)): m.peak_bytes for i, m in enumerate(uniform)}
    return CompiledContext(names=names, candidates=cands, uniform=tuple(uniform),
                           static_bytes=static, saved=tuple(saved),
                           recompute_flops=tuple(rec), transient=tuple(transient),
                           backends=backends, measured=measured,
                           whole_budgets=tuple(whole_budgets))


def dtype_bytes(step: Step) -> int:
    """Bytes per element of the model's first floating parameter (4 when none)."""
    for p in step.model.parameters():
        if p.is_floating_point():
            return p.element_size()
    return torch.float32.itemsize
