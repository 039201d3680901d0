"""What a profile returns: the step's bytes, FLOPs and times, in total and per block.

Both backends return these records: ``remat.profile`` (PyTorch, tracked storages and
aten ops) and ``remat.jax.profile`` (XLA's compiled-memory analysis). They hold numbers
only, so they live in the framework-neutral core.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from remat.core.allocator_replay import (
    AllocationLog,
    SettingsLike,
    StepReserved,
    predict_step_reserved,
)
from remat.core.cost import Category, CostViews, StepCost
from remat.core.op_record import PHASES, OpRecord
from remat.core.timeline import MemoryTimeline
from remat.errors import message, one_line


@dataclass(frozen=True)
class PhasePeak:
    """The highest live bytes seen while one phase ran, and what they were.

    Args:
        peak_bytes: the phase's high-water mark of live bytes (everything alive, not
            only what the phase created).
        breakdown: bytes per :class:`~remat.core.cost.Category` at that moment (non-zero
            categories only).
        order: when it was first reached, comparable across the phases of one step
            (smaller is earlier): the step's peak is the largest phase peak, the
            earliest on ties.
    """

    peak_bytes: int
    breakdown: Mapping[Category, int] = field(hash=False)
    order: int

    def __post_init__(self) -> None:
        if self.peak_bytes < 0:
            raise ValueError(message("PhasePeak", "peak_bytes must be >= 0",
                                     {"found": self.peak_bytes}, fix="pass peak_bytes >= 0"))


@dataclass(frozen=True)
class BlockProfile:
    """What one block costs in a training step.

    Args:
        name: qualified module name, e.g. ``"blocks.3"``.
        saved_bytes: bytes of the storages the block created in forward that were
            still alive when backward started (its share of ``activation_bytes``).
        forward_flops: FLOPs of the forward ops run inside it (innermost block only,
            if blocks nest).
        forward_ms: median forward time, ms; ``None`` when not timed.
        backward_flops: FLOPs of backward ops attributed to it (recompute excluded).
        recompute_flops: FLOPs recomputed for it during backward.
    """

    name: str
    saved_bytes: int
    forward_flops: int
    forward_ms: float | None = None
    backward_flops: int = 0
    recompute_flops: int = 0

    def __post_init__(self) -> None:
        for key in ("saved_bytes", "forward_flops", "backward_flops", "recompute_flops"):
            if getattr(self, key) < 0:
                raise ValueError(message(f"BlockProfile({self.name!r})", f"{key} must be >= 0",
                                         {"found": getattr(self, key)},
                                         fix=f"pass {key} >= 0"))
        if self.forward_ms is not None and self.forward_ms < 0:
            raise ValueError(message(f"BlockProfile({self.name!r})", "forward_ms must be >= 0",
                                     {"found": self.forward_ms},
                                     fix="pass forward_ms >= 0 or None"))


@dataclass(frozen=True)
class SavedStorage:
    """One storage a step's forward created and left alive for backward: one term of
    ``activation_bytes``, named by the op that created it.

    Args:
        op: the op that created it, e.g. ``"aten.mm"`` (``"torch.get_rng_state"`` for the
            RNG state a checkpoint keeps; NOTE [ RNG states saved by checkpoint ]).
        shape: shape of the tensor it was created for (elements per dimension).
        dtype: that tensor's dtype name, e.g. ``"bfloat16"``.
        nbytes: the storage's bytes (counted once, however many tensors view it).
        unit: the innermost block or module that ran the op, or ``None``.

    Example:
        >>> SavedStorage("aten.mm", (64, 192), "bfloat16", 24576, "h.0.attn.c_attn").nbytes
        24576
    """

    op: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    unit: str | None = None

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            raise ValueError(message(f"SavedStorage({self.op})", "nbytes must be >= 0",
                                     {"found": self.nbytes}, fix="pass nbytes >= 0"))


@dataclass(frozen=True)
class Profile(CostViews):
    """One training step, measured: exact bytes and FLOPs, and (real runs) times.

    Bytes are exact sums of tensor storage sizes on the model's device (see
    NOTE [ What the tracker cannot see ] in remat/measure/tracker.py); FLOPs follow
    ``torch.utils.flop_counter``.

    Args:
        cost: the step's :class:`~remat.core.cost.StepCost`: ``peak_bytes`` (the step's
            high-water mark of live tensor bytes, parameters, buffers, gradients,
            optimizer state and the batch included), ``breakdown`` (bytes by
            :class:`~remat.core.cost.Category` at the peak), ``activation_bytes`` (bytes
            created during forward, model and loss, still alive when backward started:
            what autograd saved, plus the loss), ``param_bytes`` (tied weights once),
            ``buffer_bytes``, ``grad_bytes`` (when backward ended), ``optimizer_bytes``
            (after the warm-up step created it), ``batch_bytes``; ``forward_flops``
            (forward and loss), ``backward_flops`` (recomputation *excluded*),
            ``recompute_flops`` (ops run while ``remat.recompute.is_recomputing()``) and
            ``flops`` (their sum, optimizer excluded), all known; ``forward_ms`` (median
            forward+loss time), ``backward_ms`` (median backward time, recomputation
            included) and ``step_ms`` (median whole-step time, optimizer included), ms,
            ``None`` when simulated or not timed. The flat names below
            (``prof.peak_bytes``, ...) are read-only views of it.
        blocks: per-block figures, in forward order.
        ops: every op of the tracked step, in order.
        simulated: the step ran under FakeTensorMode.
        device: the device the step ran on (fake device when simulated), e.g. ``"cpu"``.
        allocator_peak_bytes: the allocator's view of ``peak_bytes``: its high-water mark
            during an untracked step (CUDA: ``max_memory_allocated``; CPU: the
            allocator's events under the profiler), minus what was allocated before it,
            plus the bytes the tracker counts at the step's start (parameters, buffers,
            optimizer state, batch). It reads higher by what the tracker cannot see:
            CUDA's 512-byte rounding and workspaces, kernel scratch on either device.
            Read on CUDA and for compiled steps; on CPU when asked (the planner's
            closed loop asks); else ``None``.
        peak_phase: the phase in which the peak was reached.
        phase_peaks: each phase's own peak (``"forward"``, ``"backward"``,
            ``"recompute"``, ``"optimizer"``) with its breakdown: the largest is the
            step's peak; the others are the other moments that could become it when
            something changes (e.g. under sharding). Tracked steps only.
        timeline: live bytes by category over the step, sample by sample (NOTE [ Memory
            timeline ] in remat/core/timeline.py), for :func:`remat.report.plot_timeline`.
            Tracked steps only, else None.
        allocations: every storage the step allocated and freed, in order, and what it
            started with (NOTE [ Allocation log ] in measure/ledger.py): what
            :meth:`reserved` replays. Tracked steps only, else None.
    """

    cost: StepCost
    blocks: tuple[BlockProfile, ...]
    ops: tuple[OpRecord, ...] = field(repr=False)  # thousands of them
    simulated: bool
    device: str
    allocator_peak_bytes: int | None = None
    peak_phase: str | None = None
    phase_peaks: Mapping[str, PhasePeak] = field(default_factory=dict, hash=False)
    timeline: MemoryTimeline | None = field(default=None, repr=False, compare=False, hash=False)
    allocations: AllocationLog | None = field(default=None, repr=False, compare=False,
                                              hash=False)

    def reserved(self, settings: SettingsLike = None, *,
                 capacity_bytes: int | None = None) -> StepReserved:
        """What this step reserves under PyTorch's CUDA caching allocator on a job's first
        step and on a steady one: its allocations replayed through the allocator's model
        (NOTE [ Reserved bytes of a step ] in core/allocator_replay.py; NOTE [ Fits on the
        card ] in card_fit.py).

        Args:
            settings: the allocator's options or a ``PYTORCH_CUDA_ALLOC_CONF`` string
                (``"expandable_segments:True"``). Default: torch's defaults.
            capacity_bytes: what the allocator may reserve; None for no limit.

        Raises:
            ValueError: a profile without an allocation log (not a tracked step).

        Example:
            >>> prof = remat.profile(model, batch, simulate=True)
            >>> prof.reserved().reserved_bytes >= prof.peak_bytes
            True
        """
        if self.allocations is None:
            raise ValueError(message(
                "Profile.reserved", "this profile has no allocation log",
                {"why": "only a tracked step records one (not a compiled step's)"},
                fix="profile the step eagerly, or with simulate=True"))
        return predict_step_reserved(self.allocations, settings, capacity_bytes)

    def __post_init__(self) -> None:
        cost = self.cost
        if not isinstance(cost, StepCost):
            raise ValueError(message("Profile", "cost must be a remat.StepCost",
                                     {"found": repr(cost)},
                                     fix="build one with StepCost(peak_bytes=..., ...)"))
        if cost.forward_flops is None or cost.backward_flops is None:
            raise ValueError(message("Profile", "cost must know forward_flops and backward_flops",
                                     {"forward_flops": cost.forward_flops,
                                      "backward_flops": cost.backward_flops},
                                     fix="a profile counts every op of the step: pass both"))
        for key in ("forward_ms", "backward_ms", "step_ms"):
            value = getattr(cost, key)
            if value is not None and self.simulated:
                raise ValueError(message("Profile", f"{key} must be None when simulated",
                                         {"found": value, "simulated": self.simulated},
                                         fix=f"pass {key}=None for a simulated profile"))

    # ---- views of cost (read-only; the figures live in ``cost``) -------------------------

    @property
    def forward_flops(self) -> int:
        """``cost.forward_flops``: forward and loss FLOPs."""
        return self.cost.forward_flops or 0

    @property
    def backward_flops(self) -> int:
        """``cost.backward_flops``: backward FLOPs, recomputation excluded."""
        return self.cost.backward_flops or 0

    @property
    def forward_ms(self) -> float | None:
        """``cost.forward_ms``: median forward+loss time, ms (None when not timed)."""
        return self.cost.forward_ms

    @property
    def backward_ms(self) -> float | None:
        """``cost.backward_ms``: median backward time, ms (None when not timed)."""
        return self.cost.backward_ms

    @property
    def step_ms(self) -> float | None:
        """``cost.step_ms``: median whole-step time, ms (None when not timed)."""
        return self.cost.step_ms

    @property
    def peak_breakdown(self) -> Mapping[Category, int]:
        """``cost.breakdown``: bytes by :class:`~remat.core.cost.Category` at the peak."""
        return self.cost.breakdown

    @property
    def static_bytes(self) -> int:
        """``cost.static_bytes``: the step's bytes no checkpointing can remove (NOTE
        [ Static bytes ] in remat/core/cost.py)."""
        return self.cost.static_bytes

    @property
    def recompute_overhead(self) -> float:
        """Recomputed FLOPs as a fraction of the step's other FLOPs (0.0 = none)."""
        base = self.forward_flops + self.backward_flops
        return self.recompute_flops / base if base else 0.0

    @property
    def backward_forward_ratio(self) -> float | None:
        """``backward_ms / forward_ms`` (about 2 without checkpointing); None if untimed."""
        if self.forward_ms is None or self.backward_ms is None or self.forward_ms <= 0:
            return None
        return self.backward_ms / self.forward_ms

    def block(self, name: str) -> BlockProfile:
        """The block called ``name``; KeyError listing the known names otherwise."""
        for b in self.blocks:
            if b.name == name:
                return b
        raise KeyError(one_line(message(
            "Profile.block", f"no block {name!r}",
            {"blocks": ", ".join(b.name for b in self.blocks) or "(none)"},
            fix="ask for one of the profiled blocks")))

    def ops_in(self, phase: str) -> tuple[OpRecord, ...]:
        """The ops of one phase: ``"forward"``, ``"backward"``, ``"recompute"``, ``"optimizer"``."""
        if phase not in PHASES:
            raise ValueError(message("Profile.ops_in", "unknown phase", {"found": repr(phase)},
                                     fix=f"pass one of {PHASES}"))
        return tuple(op for op in self.ops if op.phase == phase)
