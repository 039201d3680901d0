"""Live bytes over a measured step, op by op and by category: what a timeline plot draws.

NOTE [ Memory timeline ]
    The tracker takes a *sample* each time it checks for a new peak (after every op,
    and when it counts storages made outside an op or registered): the live bytes then
    and the phase. Every change to the live bytes between two samples (a storage
    created, freed, resized or re-tagged) is kept as an *event* ``(sample, category,
    block, delta)`` that takes effect at that sample, so one sample's bytes per category
    are the running sums of the events up to it; they sum to the sample's live bytes,
    and the largest sample is the step's peak. Storages first seen as an op's input are
    counted from the start (NOTE [ What the tracker cannot see ] in tracker.py): their
    event is at sample 0 and the samples before their discovery are raised by them, as
    the tracker raises its peaks. Events cost an append per storage; the dense series
    are built only when asked (:meth:`MemoryTimeline.series`).
"""

from __future__ import annotations

from dataclasses import dataclass

from remat.core.op_record import PHASES
from remat.errors import message

Event = tuple[int, str, "str | None", int]
"""``(sample, category, block, delta bytes)``: a change to the live bytes (NOTE)."""


@dataclass(frozen=True)
class MemoryTimeline:
    """Live bytes at every sample of one step, and the events that make them up.

    Args:
        live_bytes: live bytes at each sample, bytes (NOTE [ Memory timeline ]).
        phases: each sample's phase (``"forward"``, ``"backward"``, ``"recompute"``,
            ``"optimizer"``).
        events: ``(sample, category, block, delta)`` changes, in order; ``block`` is set
            for activations (the block whose forward created them), else None.
        blocks: each sample's running block (forward, or backward and recompute: NOTE
            [ Block attribution ] in remat/measure/attribution.py), None outside the
            blocks. Default: empty (not recorded).

    Example:
        >>> t = MemoryTimeline((4, 6), ("forward", "backward"),
        ...                    ((0, "parameters", None, 4), (1, "activations", "b0", 2)))
        >>> t.series()[("activations", "b0")]
        [0, 2]
    """

    live_bytes: tuple[int, ...]
    phases: tuple[str, ...]
    events: tuple[Event, ...]
    blocks: tuple[str | None, ...] = ()

    def __post_init__(self) -> None:
        if self.blocks and len(self.blocks) != len(self.live_bytes):
            raise ValueError(message("MemoryTimeline", "one block (or None) per sample",
                                     {"samples": len(self.live_bytes),
                                      "blocks": len(self.blocks)},
                                     fix="pass as many blocks as live_bytes, or none"))
        if len(self.live_bytes) != len(self.phases):
            raise ValueError(message("MemoryTimeline", "one phase per sample",
                                     {"samples": len(self.live_bytes),
                                      "phases": len(self.phases)},
                                     fix="pass as many phases as live_bytes"))
        unknown = set(self.phases) - set(PHASES)
        if unknown:
            raise ValueError(message("MemoryTimeline", "unknown phase",
                                     {"found": ", ".join(sorted(unknown))},
                                     fix=f"use phases of {PHASES}"))

    def series(self) -> dict[tuple[str, str | None], list[int]]:
        """Bytes per ``(category, block)`` at every sample; they sum to :attr:`live_bytes`."""
        n = len(self.live_bytes)
        deltas: dict[tuple[str, str | None], list[int]] = {}
        for sample, category, block, delta in self.events:
            if sample < n:
                deltas.setdefault((category, block), [0] * n)[sample] += delta
        for values in deltas.values():
            total = 0
            for i, d in enumerate(values):
                total += d
                values[i] = total
        return {key: values for key, values in deltas.items() if any(values)}

    @property
    def peak_index(self) -> int:
        """The first sample with the most live bytes (-1 with no sample)."""
        if not self.live_bytes:
            return -1
        return self.live_bytes.index(max(self.live_bytes))

    def phase_spans(self) -> list[tuple[str, int, int]]:
        """``(phase, first, end)`` for each run of samples in one phase (``end`` exclusive),
        in order; together they cover every sample once."""
        spans: list[tuple[str, int, int]] = []
        for i, phase in enumerate(self.phases):
            if spans and spans[-1][0] == phase:
                spans[-1] = (phase, spans[-1][1], i + 1)
            else:
                spans.append((phase, i, i + 1))
        return spans
