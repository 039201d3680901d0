"""The peak model: a step's peak memory for any combination of per-block decisions.

A sum of saved bytes is not a peak. The peak of a training step is the largest
of its memory windows (NOTE [ Memory windows ] in ``remat/measure/windows.py``), and each window
holds different things: the forward of block i holds what blocks 0..i-1 saved
plus block i's forward working set; the head window (last block's output to
the loss and back) holds what every block saved plus the logits and the loss;
the backward of block i holds what blocks 0..i-1 still keep, the gradients
produced so far, and block i's backward working set (its recomputed
activations included); the tail and the optimizer step hold gradients and
optimizer state.

NOTE [ Peak model ]
    Every window ``w`` is written as::

        peak_w(d) = constant_w + sum(saved[j][d_j] for j < prefix_w) + own_w[d_{block_w}]

    where ``saved[j][c]`` is what block j keeps under candidate c (a hidden
    state counted in the block whose graph keeps it, NOTE [ Who keeps a hidden
    state ] in ``remat/planning/block_run.py``, so the sums are additive per block),
    ``own_w`` is the forward (``fwd:i``) or backward (``bwd:i``) working set
    of the window's block (measured per candidate, see ``remat/planning/candidates.py``), and
    ``constant_w`` is everything the decisions do not change (parameters,
    gradients, optimizer state, batch, embeddings, logits, loss). The
    constants are calibrated from one tracked whole-model step without
    checkpointing: ``constant_w = measured_w - sum(saved[j][none]) - own_w[none]``,
    so the model reproduces that step's peak exactly and predicts the others
    from the measured parts. The predicted peak is ``max_w peak_w(d)``.
    ``benchmarks/peak_windows.py`` checks it window by window: exact for
    llama-small and gpt-small in fp32 and bf16 (2026-11-22).

NOTE [ Candidate protocol ]
    The peak model and the solver read four numbers of a candidate and nothing
    else: ``saved_bytes``, ``forward_peak_bytes``, ``backward_peak_bytes`` and
    ``recompute_ms`` (:class:`CandidateLike`). The PyTorch planner's
    ``Candidate`` (planning/candidates.py) and the JAX backend's ``JaxCandidate``
    both satisfy it, so this module knows neither framework. :class:`PeakModel`
    is generic in its candidate type: a model built from PyTorch candidates hands
    PyTorch candidates back from ``tables``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

from remat.errors import current_call, message

Term = Literal["forward", "backward"]


class CandidateLike(Protocol):
    """What the peak model and the solver read of a candidate (NOTE [ Candidate protocol ]).

    Attributes:
        saved_bytes: bytes the block keeps for backward under the candidate.
        forward_peak_bytes: the block's forward working set.
        backward_peak_bytes: the block's backward working set (recomputation included).
        recompute_ms: the candidate's cost; the solver minimises its sum.
    """

    @property
    def saved_bytes(self) -> int: ...
    @property
    def forward_peak_bytes(self) -> int: ...
    @property
    def backward_peak_bytes(self) -> int: ...
    @property
    def recompute_ms(self) -> float: ...


C = TypeVar("C", bound=CandidateLike)
C_co = TypeVar("C_co", bound=CandidateLike, covariant=True)


class CandidateGroup(Protocol[C_co]):
    """Blocks sharing one candidate table (the PyTorch planner's ``BlockGroup``)."""

    @property
    def names(self) -> Sequence[str]: ...
    @property
    def candidates(self) -> Sequence[C_co]: ...


class StepPeaks(Protocol):
    """A measured step's peak per memory window (the PyTorch planner's ``StepWindows``)."""

    @property
    def peaks(self) -> Mapping[str, int]: ...
    @property
    def order(self) -> Sequence[str]: ...
    @property
    def peak_bytes(self) -> int: ...


@dataclass(frozen=True)
class Window:
    """One memory window of the step (see NOTE [ Peak model ]).

    Args:
        label: ``"pre"``, ``"fwd:i"``, ``"gap:i"``, ``"bwd:i"``, ``"after:i"``, ``"tail"``
            or ``"optimizer"``.
        constant_bytes: the part no decision changes.
        prefix: blocks ``0 .. prefix-1`` contribute their saved bytes.
        block: the block whose working set is in the window, or None.
        term: which working set (``"forward"`` or ``"backward"``), or None.
    """

    label: str
    constant_bytes: int
    prefix: int
    block: int | None = None
    term: Term | None = None

    def own_bytes(self, candidate: CandidateLike) -> int:
        """The window's block's working set under ``candidate`` (0 without a block)."""
        if self.term == "forward":
            return candidate.forward_peak_bytes
        if self.term == "backward":
            return candidate.backward_peak_bytes
        return 0


def _structure(label: str) -> tuple[int, int | None, Term | None]:
    """``(prefix, block, term)`` of a window label."""
    kind, _, index = label.partition(":")
    i = int(index) if index else 0
    if kind == "fwd":
        return i, i, "forward"
    if kind == "gap":
        return i + 1, None, None
    if kind == "bwd":
        return i, i, "backward"
    if kind == "after":
        return i, None, None
    if kind in ("pre", "tail", "optimizer"):
        return 0, None, None
    raise ValueError(message(current_call("remat.plan"), f"unknown memory window {label!r}",
                             fix="please report this with the model and budget"))


@dataclass(frozen=True)
class PeakModel(Generic[C]):
    """Predicts the step's peak for per-block candidate choices (see NOTE [ Peak model ]).

    Args:
        windows: the step's windows with calibrated constants.
        tables: per block (forward order), its candidates (any :class:`CandidateLike`).
        block_names: the blocks' qualified names.
        reference_peak_bytes: the measured peak of the calibration step (no checkpointing).
        held_copies: other micro-batches held through every window but ``optimizer``
            (a pipeline stage with ``held_copies + 1`` in flight, NOTE [ Micro-batches in
            flight ] in planning/in_flight.py). Default: 0.
        held_bytes: what each held copy keeps besides its blocks' saved bytes, bytes.
            Default: 0.
    """

    windows: tuple[Window, ...]
    tables: tuple[tuple[C, ...], ...]
    block_names: tuple[str, ...]
    reference_peak_bytes: int
    held_copies: int = 0
    held_bytes: int = 0

    def __post_init__(self) -> None:
        if self.held_copies < 0 or self.held_bytes < 0:
            raise ValueError(message("PeakModel", "held_copies and held_bytes must be >= 0",
                                     {"held_copies": self.held_copies,
                                      "held_bytes": self.held_bytes},
                                     fix="pass the micro-batches in flight minus one"))

    def holds(self, window: Window) -> bool:
        """Whether the held copies are alive in ``window`` (all but the optimizer's)."""
        return self.held_copies > 0 and window.label != "optimizer"

    @classmethod
    def calibrate(cls, groups: Sequence[CandidateGroup[C]], block_names: Sequence[str],
                  step: StepPeaks) -> PeakModel[C]:
        """Fit the window constants to a tracked step without checkpointing."""
        by_name = {name: tuple(group.candidates) for group in groups for name in group.names}
        tables = tuple(by_name[name] for name in block_names)
        none = [table[0] for table in tables]  # candidates start with "none"
        windows = []
        for label in step.order:
            prefix, block, term = _structure(label)
            window = Window(label, 0, prefix, block, term)
            variable = sum(c.saved_bytes for c in none[:prefix])
            if block is not None:
                variable += window.own_bytes(none[block])
            windows.append(Window(label, step.peaks[label] - variable, prefix, block, term))
        return cls(tuple(windows), tables, tuple(block_names), step.peak_bytes)

    @property
    def num_blocks(self) -> int:
        """Number of blocks."""
        return len(self.tables)

    def window_bytes(self, choice: Sequence[int]) -> dict[str, int]:
        """Predicted peak of every window for ``choice`` (candidate index per block)."""
        chosen = [self.tables[i][c] for i, c in enumerate(choice)]
        prefix_sums = [0]
        for cand in chosen:
            prefix_sums.append(prefix_sums[-1] + cand.saved_bytes)
        held = self.held_copies * (self.held_bytes + prefix_sums[-1])
        out: dict[str, int] = {}
        for w in self.windows:
            own = w.own_bytes(chosen[w.block]) if w.block is not None else 0
            out[w.label] = w.constant_bytes + prefix_sums[w.prefix] + own + \
                (held if self.holds(w) else 0)
        return out

    def predict(self, choice: Sequence[int]) -> int:
        """Predicted step peak, bytes, for ``choice`` (candidate index per block)."""
        if len(choice) != self.num_blocks:
            raise ValueError(message("PeakModel.predict",
                                     f"expected {self.num_blocks} choices",
                                     {"found": len(choice)},
                                     fix="pass one candidate index per block"))
        return max(self.window_bytes(choice).values())

    def peak_window(self, choice: Sequence[int]) -> str:
        """Label of the window holding the predicted peak."""
        values = self.window_bytes(choice)
        return max(values, key=lambda k: values[k])
