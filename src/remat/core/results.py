"""What a profile returns: the step's bytes, FLOPs and times, in total and per block.

Both backends return these records: ``remat.profile`` (PyTorch, tracked storages and
aten ops) and ``remat.jax.profile`` (XLA's compiled-memory analysis). They hold numbers
only, so they live in the framework-neutral core.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from remat.core.ops import PHASES, OpRecord
from remat.errors import message, one_line

__all__ = ["BlockProfile", "PhasePeak", "Profile"]


@dataclass(frozen=True)
class PhasePeak:
    """The highest live bytes seen while one phase ran, and what they were.

    Args:
        peak_bytes: the phase's high-water mark of live bytes (everything alive, not
            only what the phase created).
        breakdown: bytes per kind at that moment (non-zero kinds only).
        order: when it was first reached, comparable across the phases of one step
            (smaller is earlier): the step's peak is the largest phase peak, the
            earliest on ties.
    """

    peak_bytes: int
    breakdown: Mapping[str, int] = field(hash=False)
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
class Profile:
    """One training step, measured: exact bytes and FLOPs, and (real runs) times.

    Bytes are exact sums of tensor storage sizes on the model's device (see
    NOTE [ What the tracker cannot see ] in remat/measure/tracker.py); FLOPs follow
    ``torch.utils.flop_counter``.

    Args:
        peak_bytes: the step's high-water mark of live tensor bytes, including
            parameters, buffers, gradients, optimizer state and the batch.
        activation_bytes: bytes created during forward (model and loss) that were
            still alive when backward started: what autograd saved, plus the loss.
        param_bytes: parameters (tied weights once).
        buffer_bytes: buffers.
        grad_bytes: gradients when backward ended.
        optimizer_bytes: optimizer state (after the warm-up step created it).
        batch_bytes: the batch's tensors.
        flops: ``forward_flops + backward_flops + recompute_flops`` (optimizer excluded).
        forward_flops: forward and loss.
        backward_flops: backward, recomputation *excluded*.
        recompute_flops: ops run while ``remat.recompute.is_recomputing()``.
        forward_ms: median forward+loss time, ms (None when simulated or not timed).
        backward_ms: median backward time, recomputation included, ms.
        step_ms: median whole-step time, optimizer included, ms.
        blocks: per-block figures, in forward order.
        ops: every op of the tracked step, in order.
        simulated: the step ran under FakeTensorMode.
        device: the device the step ran on (fake device when simulated), e.g. ``"cpu"``.
        cuda_peak_bytes: on CUDA, ``max_memory_allocated`` during an untracked step,
            minus what was allocated before it, plus the bytes the tracker counts at the
            step's start (parameters, buffers, optimizer state, batch): the allocator's
            view of ``peak_bytes``. It reads higher by allocator rounding (512-byte
            blocks) and kernel workspaces. None elsewhere.
        peak_phase: the phase in which the peak was reached.
        peak_breakdown: bytes per kind at the peak (``"params"``, ``"grads"``,
            ``"optimizer_state"``, ``"batch"``, ``"forward"`` (activations),
            ``"backward"``, ``"recompute"``, ``"optimizer"``, ...).
        phase_peaks: each phase's own peak (``"forward"``, ``"backward"``,
            ``"recompute"``, ``"optimizer"``) with its breakdown: the largest is the
            step's peak; the others are the other moments that could become it when
            something changes (e.g. under sharding). Tracked steps only.
    """

    peak_bytes: int
    activation_bytes: int
    param_bytes: int
    buffer_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    batch_bytes: int
    flops: int
    forward_flops: int
    backward_flops: int
    recompute_flops: int
    forward_ms: float | None
    backward_ms: float | None
    step_ms: float | None
    blocks: tuple[BlockProfile, ...]
    ops: tuple[OpRecord, ...] = field(repr=False)  # thousands of them
    simulated: bool
    device: str
    cuda_peak_bytes: int | None = None
    peak_phase: str | None = None
    peak_breakdown: Mapping[str, int] = field(default_factory=dict, hash=False)
    phase_peaks: Mapping[str, PhasePeak] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for key in ("peak_bytes", "activation_bytes", "param_bytes", "buffer_bytes",
                    "grad_bytes", "optimizer_bytes", "batch_bytes", "flops", "forward_flops",
                    "backward_flops", "recompute_flops"):
            if getattr(self, key) < 0:
                raise ValueError(message("Profile", f"{key} must be >= 0",
                                         {"found": getattr(self, key)}, fix=f"pass {key} >= 0"))
        parts = self.forward_flops + self.backward_flops + self.recompute_flops
        if self.flops != parts:
            raise ValueError(message(
                "Profile", "flops must equal forward_flops + backward_flops + recompute_flops",
                {"flops": self.flops, "sum of the parts": parts},
                fix="pass flops equal to the sum of its parts"))
        for key in ("forward_ms", "backward_ms", "step_ms"):
            value = getattr(self, key)
            if value is not None and (self.simulated or value < 0):
                raise ValueError(message("Profile",
                                         f"{key} must be None when simulated and >= 0 otherwise",
                                         {"found": value, "simulated": self.simulated},
                                         fix=f"pass {key}=None for a simulated profile"))

    @property
    def fixed_bytes(self) -> int:
        """Bytes no checkpointing can remove: parameters, buffers, gradients, optimizer state."""
        return self.param_bytes + self.buffer_bytes + self.grad_bytes + self.optimizer_bytes

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
