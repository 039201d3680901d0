"""One training step's cost (:class:`StepCost`) and the one set of byte categories.

Every record that reports what a step costs (:class:`~remat.core.results.Profile`,
:class:`~remat.core.rows.StrategyRow`, :class:`~remat.simulate.SimulationRow`,
:class:`~remat.Plan`) embeds a :class:`StepCost`, and every byte breakdown
(``Profile.peak_breakdown``, ``PhasePeak.breakdown``, ``BudgetTooSmall.breakdown``) is keyed
by :class:`Category`, whichever backend measured it.

NOTE [ Categories of each backend ]
    The PyTorch tracker counts storages by kind (remat/measure/ledger.py) and maps them
    one to one: params -> ``parameters``, buffers -> ``buffers``, grads -> ``gradients``,
    optimizer_state -> ``optimizer_state``, batch -> ``batch``, forward ->
    ``activations``, recompute -> ``recomputed``, backward -> ``backward_temporaries``,
    optimizer -> ``optimizer_temporaries``, other -> ``other``.
    A compiled step (remat.compiled) knows the static bytes by kind (as above) but sees
    the step itself through the allocator only: its peak above the static bytes is
    ``step_temporaries`` (activations, gradients and temporaries, not split).
    A JAX step (XLA's memory analysis) has arguments, outputs and temporaries:
    arguments are split into ``parameters`` (nnx.Param state), ``buffers`` (other model
    state) and ``batch``, with any difference (arguments XLA adds or prunes) in ``other``;
    outputs are the ``gradients`` (one per parameter) and the rest (the loss) in
    ``other``, less the bytes aliased to arguments; temporaries are
    ``step_temporaries``. Where a split cannot be made exactly, the whole figure goes to
    ``other`` so the categories still sum to the peak.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from remat.errors import message


class Category(str, Enum):
    """What a byte at a step's peak is: the one set of names every breakdown uses.

    A ``str`` enum: ``Category.PARAMETERS == "parameters"``, so a breakdown can be read
    with plain strings (``breakdown["parameters"]``) and writes to JSON as its value.
    NOTE [ Categories of each backend ] says how each backend's figures map onto them.
    """

    PARAMETERS = "parameters"
    BUFFERS = "buffers"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    BATCH = "batch"
    ACTIVATIONS = "activations"
    RECOMPUTED = "recomputed"
    BACKWARD_TEMPORARIES = "backward_temporaries"
    OPTIMIZER_TEMPORARIES = "optimizer_temporaries"
    STEP_TEMPORARIES = "step_temporaries"
    OTHER = "other"

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


_BYTES = ("peak_bytes", "param_bytes", "buffer_bytes", "grad_bytes", "optimizer_bytes",
          "batch_bytes", "activation_bytes", "recompute_flops")
_OPTIONAL_INTS = ("forward_flops", "backward_flops", "flops")
_TIMES = ("forward_ms", "backward_ms", "step_ms", "recompute_ms")


#: The categories no checkpointing can remove (NOTE [ Static bytes ]).
STATIC: tuple[Category, ...] = (Category.PARAMETERS, Category.BUFFERS, Category.GRADIENTS,
                                Category.OPTIMIZER_STATE, Category.BATCH)


def static_bytes(breakdown: Mapping[Category, int]) -> int:
    """The static bytes of a breakdown: those no checkpointing can remove.

    NOTE [ Static bytes ]
        The static bytes are the parameters, buffers, gradients, optimizer state and
        batch (:data:`STATIC`), and this is their one definition: the planner's context,
        the JAX planner, the compiled planner, ``remat simulate`` and a pipeline rank's
        chunks all sum a breakdown with it. The batch counts: it is alive from the
        step's start to its end whatever the plan, it is part of the un-checkpointed
        peak, and only a smaller batch (not checkpointing) shrinks it, so a budget of
        ``"activations:50%"`` keeps it whole (NOTE [ Budget forms ]). A figure that
        needs another sum names it as this one less a category (a pipeline chunk
        before its first backward: the static bytes less its gradients), never as a
        second list of categories.

    The trade-off: one sum for every backend, so a category a backend cannot split out
    (a compiled step's gradients are in ``step_temporaries``) is not static there.

    Args:
        breakdown: bytes by :class:`Category` (strings naming one are read too), bytes.

    Example:
        >>> static_bytes({Category.PARAMETERS: 100, Category.BATCH: 8,
        ...               Category.ACTIVATIONS: 50})
        108
    """
    return sum(breakdown.get(category, 0) for category in STATIC)


def _bad(what: str, value: Any, fix: str) -> ValueError:
    return ValueError(message("StepCost", what, {"found": repr(value)}, fix=fix))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class StepCost:
    """One training step's cost: its peak bytes and what they are, FLOPs and times.

    The one record of a step's cost that profiles, comparison rows, simulation rows and
    plans embed (as ``.cost``). Each holds what its source knows: a profile knows
    everything; a comparison or simulation row knows the total FLOPs but not the
    forward/backward split; a plan knows its predicted peak and recompute cost only.
    Unknown FLOP splits and times are ``None``; unknown byte figures are 0 and an
    unknown breakdown is empty. The trade-off: one validated shape for every record,
    at the price of optional fields that a reader must check before using.

    NOTE [ A step's bytes and its peak's ]
        Each byte figure is stored once. ``breakdown`` is what is alive at the peak's
        moment; the byte fields (``param_bytes`` ... ``activation_bytes``, read together
        as :attr:`held`) are the step's own figures, each at its own moment: gradients
        when backward ended, optimizer state when the step started, activations when
        backward started. They are different figures, not two copies: a peak inside
        backward holds part of the gradients and of the activations, and a first step
        peaking in the optimizer holds the state it just created. Neither form is
        derived from the other, so a record without a peak breakdown (a plan, a
        simulated row) still carries its step's figures.

    Args:
        peak_bytes: the step's high-water mark of live bytes, bytes.
        breakdown: bytes by :class:`Category` at that peak, bytes (non-zero categories;
            strings naming a category are accepted and converted). When not empty, the
            values sum to ``peak_bytes``. Default: empty (not known).
        param_bytes: parameter bytes (tied weights once). Default: 0.
        buffer_bytes: buffer (non-parameter model state) bytes. Default: 0.
        grad_bytes: gradient bytes when backward ended. Default: 0.
        optimizer_bytes: optimizer-state bytes. Default: 0.
        batch_bytes: the batch's bytes. Default: 0.
        activation_bytes: bytes forward created that were still alive when backward
            started (what autograd saved, plus the loss), bytes. Default: 0.
        forward_flops: forward and loss FLOPs; ``None`` when not known. Default: None.
        backward_flops: backward FLOPs, recomputation excluded; ``None`` when not known.
        recompute_flops: FLOPs run again during backward. Default: 0.
        flops: the step's FLOPs (optimizer excluded). Default: ``None``: derived as
            ``forward_flops + backward_flops + recompute_flops`` when both parts are
            known (and checked against that sum when given), else left ``None``.
        forward_ms: forward time, ms; ``None`` when not timed or simulated.
        backward_ms: backward time (recomputation included), ms; ``None`` likewise.
        step_ms: whole-step time, ms; ``None`` likewise.
        recompute_ms: time spent recomputing, ms; ``None`` when not known.

    Raises:
        ValueError: a negative or non-integer byte/FLOP figure, a negative or non-finite
            time, a breakdown key that is not a category or values that do not sum to
            ``peak_bytes``, or ``flops`` that disagree with its parts.

    Example:
        >>> cost = StepCost(peak_bytes=300, breakdown={Category.PARAMETERS: 100,
        ...                 Category.ACTIVATIONS: 200}, param_bytes=100,
        ...                 activation_bytes=200, forward_flops=10, backward_flops=20)
        >>> cost.flops, cost.breakdown["parameters"]
        (30, 100)
    """

    peak_bytes: int
    breakdown: Mapping[Category, int] = field(default_factory=dict, hash=False)
    param_bytes: int = 0
    buffer_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    batch_bytes: int = 0
    activation_bytes: int = 0
    forward_flops: int | None = None
    backward_flops: int | None = None
    recompute_flops: int = 0
    flops: int | None = None
    forward_ms: float | None = None
    backward_ms: float | None = None
    step_ms: float | None = None
    recompute_ms: float | None = None

    def __post_init__(self) -> None:
        for key in _BYTES:
            value = getattr(self, key)
            if not _is_int(value) or value < 0:
                raise _bad(f"{key} must be an int >= 0", value,
                           f"pass {key} as a non-negative int")
        for key in _OPTIONAL_INTS:
            value = getattr(self, key)
            if value is not None and (not _is_int(value) or value < 0):
                raise _bad(f"{key} must be an int >= 0 or None", value,
                           f"pass {key} as a non-negative int, or None when not known")
        for key in _TIMES:
            value = getattr(self, key)
            if value is not None and not (isinstance(value, int | float)
                                          and math.isfinite(value) and value >= 0):
                raise _bad(f"{key} must be a finite number of ms >= 0 or None", value,
                           f"pass {key} in ms, or None when not timed")
        breakdown: dict[Category, int] = {}
        for key, value in dict(self.breakdown).items():
            try:
                category = Category(key)
            except ValueError:
                raise _bad(f"breakdown key {key!r} is not a Category", key,
                           f"use one of {', '.join(c.value for c in Category)}") from None
            if not _is_int(value) or value < 0:
                raise _bad(f"breakdown[{category.value!r}] must be an int >= 0", value,
                           "pass bytes as non-negative ints")
            breakdown[category] = value
        if breakdown and sum(breakdown.values()) != self.peak_bytes:
            raise _bad(f"breakdown sums to {sum(breakdown.values())} B, not peak_bytes "
                       f"({self.peak_bytes} B)", {c.value: v for c, v in breakdown.items()},
                       "the breakdown is what is alive at the peak: it must add up to it")
        object.__setattr__(self, "breakdown", breakdown)
        parts = self.forward_flops, self.backward_flops
        if parts[0] is not None and parts[1] is not None:
            total = parts[0] + parts[1] + self.recompute_flops
            if self.flops is None:
                object.__setattr__(self, "flops", total)
            elif self.flops != total:
                raise _bad(f"flops ({self.flops}) must equal forward_flops + backward_flops + "
                           f"recompute_flops ({total})", self.flops,
                           "leave flops out to derive it from its parts")
        if self.flops is not None and self.recompute_flops > self.flops:
            raise _bad(f"recompute_flops ({self.recompute_flops}) exceeds flops "
                       f"({self.flops})", self.recompute_flops,
                       "recompute_flops is part of the step's flops")

    @property
    def held(self) -> dict[Category, int]:
        """The step's own byte figures by :class:`Category` (NOTE [ A step's bytes and
        its peak's ]): parameters, buffers, gradients, optimizer state, batch and
        activations, non-zero only; a view of the fields, not a second copy."""
        figures = {Category.PARAMETERS: self.param_bytes, Category.BUFFERS: self.buffer_bytes,
                   Category.GRADIENTS: self.grad_bytes,
                   Category.OPTIMIZER_STATE: self.optimizer_bytes,
                   Category.BATCH: self.batch_bytes, Category.ACTIVATIONS: self.activation_bytes}
        return {category: value for category, value in figures.items() if value}

    @property
    def static_bytes(self) -> int:
        """The step's static bytes, ``static_bytes(cost.held)`` (NOTE [ Static bytes ])."""
        return static_bytes(self.held)


class CostViews:
    """Read-only views of a record's ``cost`` under the names its readers use.

    :class:`~remat.core.results.Profile`, :class:`~remat.core.rows.StrategyRow` and
    :class:`~remat.simulate.result.SimulationRow` hold one :class:`StepCost` (their only
    copy of these figures) and inherit these views of it, so ``profile.peak_bytes`` is
    ``profile.cost.peak_bytes``: a name to read it by, not a second value.
    """

    cost: StepCost

    @property
    def peak_bytes(self) -> int:
        """``cost.peak_bytes``: the step's high-water mark of live bytes."""
        return self.cost.peak_bytes

    @property
    def activation_bytes(self) -> int:
        """``cost.activation_bytes``: forward's bytes still alive when backward starts."""
        return self.cost.activation_bytes

    @property
    def param_bytes(self) -> int:
        """``cost.param_bytes``: parameter bytes (tied weights once)."""
        return self.cost.param_bytes

    @property
    def buffer_bytes(self) -> int:
        """``cost.buffer_bytes``: buffer bytes."""
        return self.cost.buffer_bytes

    @property
    def grad_bytes(self) -> int:
        """``cost.grad_bytes``: gradient bytes."""
        return self.cost.grad_bytes

    @property
    def optimizer_bytes(self) -> int:
        """``cost.optimizer_bytes``: optimizer-state bytes."""
        return self.cost.optimizer_bytes

    @property
    def batch_bytes(self) -> int:
        """``cost.batch_bytes``: the batch's bytes."""
        return self.cost.batch_bytes

    @property
    def flops(self) -> int:
        """``cost.flops``: forward + backward + recompute FLOPs (0 when not known)."""
        return self.cost.flops or 0

    @property
    def recompute_flops(self) -> int:
        """``cost.recompute_flops``: FLOPs run while recomputing."""
        return self.cost.recompute_flops
