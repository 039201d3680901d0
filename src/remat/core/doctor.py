"""What ``remat doctor`` finds: a job's steps, what grows between them, and the fix.

The records :func:`remat.doctor` returns. The steps are measured in
``remat/measure/doctor.py`` (a few training steps under the storage tracker); a CUDA memory
snapshot is read in ``remat/core/snapshot.py``. Both report in the same terms: bytes by
:class:`~remat.core.cost.Category`, and :class:`Finding` s, each a cause with the fix.

NOTE [ Why a job runs out of memory at step 101 ]
    A job that fits for 100 steps and runs out of memory at step 101 has one of these
    causes, each with its own signature in the steps ``remat doctor`` runs:

    1. Memory grows every step. Bytes alive *between* steps (after the step, what the
       loop keeps) grow from one steady step to the next: gradients never freed, tensors
       the loop keeps (``losses.append(loss)``; a tensor with a ``grad_fn`` keeps its whole
       autograd graph, and a graph never backpropagated keeps every activation it saved),
       module state that grows on each forward (a list, a cache), more of it when a
       checkpointed region's forward runs again in recomputation. The *holder* (what keeps
       the bytes alive: ``.grad``, a module attribute, a Python list, an autograd graph) is
       named (:attr:`DoctorStep.growth`).
    2. Gradients held into the next step: ``.grad`` of step k alive at step k+1's peak
       (``zero_grad`` never called, or ``set_to_none=False``): the peak of every step after
       the first is higher by the gradients' bytes (:attr:`DoctorStep.held_bytes`).
    3. Fragmentation: what the CUDA caching allocator reserves grows while what is
       allocated does not, or a request fails that is smaller than the free bytes the
       allocator holds but larger than its largest free block (``expandable_segments``).
    4. A larger batch or a longer sequence (not a leak: the guard of an applied plan and
       ``remat.plan_seq_len`` answer it; a snapshot's out-of-memory event says by how much
       the step is over).

    A step's first run is not steady: it creates the optimizer state and lazily built
    caches, so growth counts from the end of the first step on (NOTE [ The first step ] in
    remat/measure/profile.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from remat.core.cost import Category
from remat.errors import message

if TYPE_CHECKING:
    from remat.core.snapshot import SnapshotDiagnosis


class Cause(str, Enum):
    """Why memory grows or runs out: the cause a :class:`Finding` names (NOTE [ Why a job
    runs out of memory at step 101 ])."""

    #: ``.grad`` of one step alive at the next step's peak.
    GRADIENTS_KEPT = "gradients_kept"
    #: tensors (and their autograd graphs) the loop keeps across steps.
    OUTPUTS_KEPT = "outputs_kept"
    #: module state that grows on every forward (a list, a cache).
    STATE_GROWS = "state_grows"
    #: module state that grows in recomputation too (a checkpointed forward runs twice).
    RECOMPUTE_GROWS = "recompute_grows"
    #: bytes that grow with no holder found.
    GROWS = "grows"
    #: reserved but unallocated bytes: the allocator's free blocks cannot serve a request.
    FRAGMENTATION = "fragmentation"
    #: activations dominate what was allocated when memory ran out: a plan fixes it.
    ACTIVATIONS = "activations"
    #: the step needs more than the card even with activations removed: a smaller shape.
    SHAPE = "shape"

    def __str__(self) -> str:
        return str(self.value)


#: A finding that makes the report unhealthy (memory grows, or it ran out).
ERROR = "error"
#: A finding that only advises (memory does not grow).
ADVICE = "advice"


@dataclass(frozen=True)
class Finding:
    """One diagnosis: the cause, what holds the bytes, how many, and the fix.

    Args:
        cause: why (:class:`Cause`).
        severity: ``"error"`` (memory grows or ran out: the report is unhealthy) or
            ``"advice"``.
        holder: what keeps the bytes alive or where they were allocated (``"gradients"``,
            a module attribute ``"blocks.1.cache"``, a Python list ``"losses"``, an
            allocation site); empty when none applies.
        size_bytes: the bytes concerned (held, or short), bytes.
        growth_bytes: growth per step, bytes; 0 when nothing grows.
        step: the first step it shows in (1-based); ``None`` for a snapshot.
        detail: what was seen, in words (no figures: the report formats them).
        fix: what to change.

    Example:
        >>> f = Finding(Cause.STATE_GROWS, "error", "blocks.1.cache", 4096, 1024, 2,
        ...             "a list that gets one tensor per forward", "clear it every step")
        >>> f.cause.value
        'state_grows'
    """

    cause: Cause
    severity: str
    holder: str
    size_bytes: int
    growth_bytes: int
    step: int | None
    detail: str
    fix: str

    def __post_init__(self) -> None:
        if not isinstance(self.cause, Cause):
            object.__setattr__(self, "cause", Cause(self.cause))
        if self.severity not in (ERROR, ADVICE):
            raise ValueError(message("Finding", "severity must be 'error' or 'advice'",
                                     {"found": repr(self.severity)},
                                     fix="pass severity='error' or 'advice'"))
        if self.size_bytes < 0:
            raise ValueError(message("Finding", "size_bytes must be >= 0",
                                     {"found": self.size_bytes}, fix="pass bytes >= 0"))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (the cause as its value)."""
        return {"cause": self.cause.value, "severity": self.severity, "holder": self.holder,
                "size_bytes": self.size_bytes, "growth_bytes": self.growth_bytes,
                "step": self.step, "detail": self.detail, "fix": self.fix}


@dataclass(frozen=True)
class DoctorStep:
    """One training step as ``remat doctor`` ran it.

    Args:
        step: its number, from 1.
        start_bytes: bytes alive when it started (what earlier steps left included).
        peak_bytes: its high-water mark of live bytes.
        end_bytes: bytes alive when it ended (after a garbage collection).
        peak_phase: the phase of the peak (``"forward"``, ``"backward"``,
            ``"recompute"``, ``"optimizer"``), or None.
        peak_breakdown: bytes by :class:`Category` at the peak; they sum to
            ``peak_bytes``.
        peak_blocks: activation bytes alive at the peak by the block that created them.
        held_bytes: bytes earlier steps left that were still alive at this step's peak,
            by holder (parameters, buffers, the batch and the optimizer state left out:
            every step holds them).
        growth: bytes alive at the end less bytes alive at the start, by holder (non-zero
            only): what the step left behind, or freed.
        reserved_bytes: the peak the CUDA caching allocator would reserve over this step
            (the steps' allocations replayed, NOTE [ Reserved bytes of a step ]), bytes.
        allocated_bytes: the allocator's allocated peak over this step (512 B rounding),
            bytes.
        expandable_reserved_bytes: ``reserved_bytes`` with ``expandable_segments:True``.

    Example:
        >>> s = DoctorStep(2, 100, 300, 120, "backward", {Category.PARAMETERS: 300})
        >>> s.growth_bytes
        20
    """

    step: int
    start_bytes: int
    peak_bytes: int
    end_bytes: int
    peak_phase: str | None
    peak_breakdown: Mapping[Category, int] = field(default_factory=dict, hash=False)
    peak_blocks: Mapping[str, int] = field(default_factory=dict, hash=False)
    held_bytes: Mapping[str, int] = field(default_factory=dict, hash=False)
    growth: Mapping[str, int] = field(default_factory=dict, hash=False)
    reserved_bytes: int | None = None
    allocated_bytes: int | None = None
    expandable_reserved_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.step < 1:
            raise ValueError(message("DoctorStep", "step must be >= 1", {"found": self.step},
                                     fix="number steps from 1"))
        for key in ("start_bytes", "peak_bytes", "end_bytes"):
            if getattr(self, key) < 0:
                raise ValueError(message("DoctorStep", f"{key} must be >= 0",
                                         {"found": getattr(self, key)}, fix="pass bytes >= 0"))
        object.__setattr__(self, "peak_breakdown",
                           {Category(k): v for k, v in self.peak_breakdown.items()})
        if self.peak_breakdown and sum(self.peak_breakdown.values()) != self.peak_bytes:
            raise ValueError(message(
                "DoctorStep", "peak_breakdown must sum to peak_bytes",
                {"sum": sum(self.peak_breakdown.values()), "peak_bytes": self.peak_bytes},
                fix="pass the bytes by category at the peak"))

    @property
    def growth_bytes(self) -> int:
        """``end_bytes - start_bytes``: what the step left alive (negative: freed)."""
        return self.end_bytes - self.start_bytes

    @property
    def held_total_bytes(self) -> int:
        """All of :attr:`held_bytes`."""
        return sum(self.held_bytes.values())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (categories as their values)."""
        return {"step": self.step, "start_bytes": self.start_bytes,
                "peak_bytes": self.peak_bytes, "end_bytes": self.end_bytes,
                "growth_bytes": self.growth_bytes, "peak_phase": self.peak_phase,
                "peak_breakdown": {c.value: v for c, v in self.peak_breakdown.items()},
                "peak_blocks": dict(self.peak_blocks), "held_bytes": dict(self.held_bytes),
                "growth": dict(self.growth), "reserved_bytes": self.reserved_bytes,
                "allocated_bytes": self.allocated_bytes,
                "expandable_reserved_bytes": self.expandable_reserved_bytes}


@dataclass(frozen=True)
class DoctorReport:
    """What ``remat doctor`` found: the steps it ran, a snapshot it read, the findings.

    Args:
        steps: the training steps run, in order (empty for a snapshot alone).
        findings: the diagnoses, errors first.
        snapshot: the reading of a CUDA memory snapshot, or None.
        device: the device the steps ran on (``"cpu"``, ``"cuda:0"``), or None.

    Example:
        >>> report = DoctorReport()
        >>> report.healthy
        True
    """

    steps: tuple[DoctorStep, ...] = ()
    findings: tuple[Finding, ...] = ()
    snapshot: SnapshotDiagnosis | None = None
    device: str | None = None

    def __post_init__(self) -> None:
        numbers = [s.step for s in self.steps]
        if numbers != list(range(1, len(numbers) + 1)):
            raise ValueError(message("DoctorReport", "steps must be numbered 1, 2, ... in order",
                                     {"found": numbers}, fix="pass the steps in the order run"))

    @property
    def healthy(self) -> bool:
        """No finding is an error: memory does not grow and nothing ran out."""
        return not any(f.severity == ERROR for f in self.findings)

    @property
    def errors(self) -> tuple[Finding, ...]:
        """The findings that make the report unhealthy."""
        return tuple(f for f in self.findings if f.severity == ERROR)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of the whole report."""
        return {"healthy": self.healthy, "device": self.device,
                "steps": [s.to_dict() for s in self.steps],
                "findings": [f.to_dict() for f in self.findings],
                "snapshot": self.snapshot.to_dict() if self.snapshot is not None else None}
