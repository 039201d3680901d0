"""The arithmetic of :mod:`remat.simulate.fast_rows`'s samples: the figures of one shallow fake
step, extrapolated along a line through two of them, checked on a chord (NOTE [ Fast rows ]
in fast_rows.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from remat.core.cost import Category

COMPUTE = ("forward", "backward", "recompute")
EndKey = tuple[str, str, int]
"""``(phase, "first" | "last", k)``: the k-th segment from that end of a phase."""


@dataclass(frozen=True)
class End:
    """The peak of one segment at an end of a phase (NOTE [ Fast rows ], 7).

    ``offset``: the sample of that peak, counted from the segment's first sample; -1 once
    ``peak_bytes`` is only an upper bound (interpolated in batch size between samples whose
    segment peaked at different moments) or a line through such moments (in depth).
    ``breakdown``: bytes per category at that moment (empty for a bound).
    ``block``: the segment's block as ``(index from the stack's first block, index from
    its last)``; None outside every block.
    """

    peak_bytes: int
    offset: int
    breakdown: dict[Category, int]
    block: tuple[int, int] | None = None

    @property
    def exact(self) -> bool:
        return self.offset >= 0

INTS = ("peak_bytes", "opt_peak_bytes", "activation_bytes", "param_bytes", "grad_bytes",
         "optimizer_bytes", "batch_bytes", "flops", "recompute_flops")


@dataclass(frozen=True)
class Sample:
    """The figures of one shallow fake step that the rows are extrapolated from.

    ``peak_bytes`` / ``phase`` / ``breakdown`` are the forward/backward moment's,
    ``opt_peak_bytes`` / ``opt_breakdown`` the optimizer step's (0 / empty without one).
    ``moments``: per phase, its peak bytes and when they were first reached
    (``PhasePeak.order``), for a measured step; empty once interpolated or extrapolated.
    ``rank_segments``: under FSDP, one rank's peak in each of
    :func:`remat.distributed.sharding.segments`; else empty.
    ``ends``: the peaks of the segments at either end of each forward, backward and
    recompute phase (NOTE [ Fast rows ], 7), by ``(phase, "first" | "last", k)``: the
    k-th segment from that end, a segment being a run of samples in one block (or
    outside every block).
    """

    peak_bytes: int
    opt_peak_bytes: int
    activation_bytes: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    batch_bytes: int
    flops: int
    recompute_flops: int
    phase: str | None
    breakdown: dict[Category, int]
    opt_breakdown: dict[Category, int]
    ops: tuple[Any, ...]  # empty once extrapolated in depth
    compute_ms: float  # roofline of forward, backward and recompute
    recompute_ms: float
    optimizer_ms: float
    moments: tuple[tuple[str, int, int], ...] = ()
    rank_segments: tuple[int, ...] = ()  # FSDP: per-rank peak per segment (NOTE [ Fast rows ], 6)
    ends: tuple[tuple[EndKey, End], ...] = ()
    #: reserved above the allocated peak, default and expandable segments (NOTE
    #: [ Reserved per rank ] in point.py): bounds, not on the affine line
    reserved_extra_bytes: int = 0
    expandable_extra_bytes: int = 0


def roofline_times(ops: Sequence[Any], device: Any) -> dict[str, float]:
    from remat.measure import roofline_ms

    return {"compute_ms": float(roofline_ms(ops, device, phases=COMPUTE)),
            "recompute_ms": float(roofline_ms(ops, device, phases=("recompute",))),
            "optimizer_ms": float(roofline_ms(ops, device, phases=("optimizer",)))}


def end_segments(timeline: Any, width: int,
                 blocks: Sequence[str] = ()) -> tuple[tuple[EndKey, End], ...]:
    """:attr:`Sample.ends` of a measured step's timeline: per forward, backward and
    recompute phase, the peaks of its first and last ``width`` segments, where each was
    first reached, what it held and which of ``blocks`` (names in stack order) it ran in
    (NOTE [ Fast rows ], 7); empty without the samples' blocks."""
    if timeline is None or not timeline.blocks:
        return ()
    segments: dict[str, list[list[int]]] = {}  # per phase: [first sample, peak sample]
    last: dict[str, Any] = {}
    live = timeline.live_bytes
    for i, (phase, block) in enumerate(zip(timeline.phases, timeline.blocks, strict=True)):
        if phase == "optimizer":
            continue
        runs = segments.setdefault(phase, [])
        if not runs or last[phase] != block:
            runs.append([i, i])
            last[phase] = block
        elif live[i] > live[runs[-1][1]]:
            runs[-1][1] = i
    chosen = {(phase, end, k): (runs if end == "first" else runs[::-1])[k]
              for phase, runs in sorted(segments.items())
              for end in ("first", "last") for k in range(min(width, len(runs)))}
    held = _breakdowns(timeline.events, {peak for _, peak in chosen.values()})
    index = {name: i for i, name in enumerate(blocks)}

    def place(name: str | None) -> tuple[int, int] | None:
        i = index.get(name, -1) if name is not None else -1
        return (i, len(blocks) - 1 - i) if i >= 0 else None

    return tuple((key, End(live[peak], peak - first, held[peak], place(timeline.blocks[first])))
                 for key, (first, peak) in chosen.items())


def _breakdowns(events: Sequence[Any], at: set[int]) -> dict[int, dict[Category, int]]:
    """Bytes per category at each sample of ``at`` (the running sums of the timeline's
    events up to it: NOTE [ Memory timeline ] in core/timeline.py), non-zero ones only."""
    totals: dict[Category, int] = {}
    out: dict[int, dict[Category, int]] = {}
    ordered = sorted(events, key=lambda event: event[0])
    i = 0
    for sample in sorted(at):
        while i < len(ordered) and ordered[i][0] <= sample:
            category = Category(ordered[i][1])
            totals[category] = totals.get(category, 0) + ordered[i][3]
            i += 1
        out[sample] = {k: v for k, v in totals.items() if v}
    return out


def sample_of(prof: Any, device: Any, width: int = 2,
              rank_segments: tuple[int, ...] = (),
              reserved_extras: tuple[int, int] = (0, 0)) -> Sample:
    """The sample of one shallow step's profile: both moments, every op, roofline times,
    the peaks of the ``width`` segments at either end of each phase (``ends``) and,
    under FSDP, the rank's segment peaks and what the step reserves above its allocated
    peak (both computed by the caller)."""
    ops = tuple(prof.ops)
    moments = {p: m for p, m in prof.phase_peaks.items() if p != "optimizer"}
    phase = max(moments, key=lambda p: (moments[p].peak_bytes, -moments[p].order))
    fwd = moments[phase]
    opt = prof.phase_peaks.get("optimizer")
    return Sample(int(fwd.peak_bytes), int(opt.peak_bytes) if opt is not None else 0,
                  int(prof.activation_bytes), int(prof.param_bytes),
                  int(prof.grad_bytes), int(prof.optimizer_bytes), int(prof.batch_bytes),
                  int(prof.flops), int(prof.recompute_flops), phase, dict(fwd.breakdown),
                  dict(opt.breakdown) if opt is not None else {}, ops,
                  **roofline_times(ops, device),
                  moments=tuple(sorted((p, int(m.peak_bytes), m.order)
                                       for p, m in prof.phase_peaks.items())),
                  rank_segments=rank_segments,
                  ends=end_segments(prof.timeline, width, [b.name for b in prof.blocks]),
                  reserved_extra_bytes=reserved_extras[0],
                  expandable_extra_bytes=reserved_extras[1])


class NotAffine(Exception):
    """Two samples do not line up (different ops): use the exact path."""


def affine(a: int, b: int, xa: int, xb: int, x: int) -> int:
    """The integer affine function through ``(xa, a)`` and ``(xb, b)`` at ``x``."""
    if xa == xb:
        return a
    num = (b - a) * (x - xa)
    if num % (xb - xa):
        raise NotAffine
    return a + num // (xb - xa)


def mix(s1: Sample, s2: Sample, x1: int, x2: int, x: int, *,
         device: Any = None) -> Sample:
    """Every figure affine through two samples at ``x1 < x2``, evaluated at ``x``.

    With ``device`` (the batch direction) each op's FLOPs and bytes are interpolated
    and the times summed from them; without (the depth direction) the times are.
    """
    ints: dict[str, Any] = {k: affine(getattr(s1, k), getattr(s2, k), x1, x2, x) for k in INTS}
    breakdown, opt_breakdown = (
        {k: affine(a.get(k, 0), b.get(k, 0), x1, x2, x) for k in a.keys() | b.keys()}
        for a, b in ((s1.breakdown, s2.breakdown), (s1.opt_breakdown, s2.opt_breakdown)))
    phase = s2.phase if x >= x2 else s1.phase
    if len(s1.rank_segments) != len(s2.rank_segments):
        raise NotAffine
    ints["rank_segments"] = tuple(affine(a, b, x1, x2, x) for a, b in
                                  zip(s1.rank_segments, s2.rank_segments, strict=True))
    ends = _mix_ends(s1, s2, x1, x2, x)
    # reserved above allocated is not affine in depth or batch: the larger of the two
    # (NOTE [ Reserved per rank ] in point.py)
    ints["reserved_extra_bytes"] = max(s1.reserved_extra_bytes, s2.reserved_extra_bytes)
    ints["expandable_extra_bytes"] = max(s1.expandable_extra_bytes, s2.expandable_extra_bytes)
    if device is None:
        times = {k: getattr(s1, k) + (getattr(s2, k) - getattr(s1, k)) * (x - x1) / (x2 - x1)
                 for k in ("compute_ms", "recompute_ms", "optimizer_ms")}
        return Sample(**ints, phase=phase, breakdown=breakdown, opt_breakdown=opt_breakdown,
                       ops=(), **times, ends=ends)
    if len(s1.ops) != len(s2.ops):
        raise NotAffine
    ops = []
    for o1, o2 in zip(s1.ops, s2.ops, strict=True):
        if o1.name != o2.name or o1.phase != o2.phase:
            raise NotAffine
        ops.append(dataclasses.replace(
            o1, flops=affine(o1.flops, o2.flops, x1, x2, x),
            read_bytes=affine(o1.read_bytes, o2.read_bytes, x1, x2, x),
            write_bytes=affine(o1.write_bytes, o2.write_bytes, x1, x2, x)))
    times = roofline_times(ops, device)
    return Sample(**ints, phase=phase, breakdown=breakdown, opt_breakdown=opt_breakdown,
                   ops=tuple(ops), **times, ends=ends)  # type: ignore[arg-type]


def _mix_ends(s1: Sample, s2: Sample, x1: int, x2: int,
              x: int) -> tuple[tuple[EndKey, End], ...]:
    """The end segments both samples hold in the same place, on their line at ``x``: exact
    for a segment that peaks at one moment at both (the same offset in the segment, the
    same kinds of bytes); else a bound, rounded up (in batch size, where a segment's peak
    is convex, an upper bound between ``x1`` and ``x2``).

    In depth, a key is the same segment at both depths where its block is as far from
    the stack's first block, or from its last, at both (or outside every block at both);
    else the key reaches past the other end's segments at the shallower depth (``sqrt``'s
    recomputations, one segment per ``k`` blocks) and is left out: at ``x`` it names a
    segment between the ends, whose peak lies between theirs (NOTE [ Fast rows ], 7)."""
    second = dict(s2.ends)
    out = []
    for key, a in s1.ends:
        b = second.get(key)
        if b is None or not _same_place(a.block, b.block):
            continue
        if a.exact and a.offset == b.offset and a.breakdown.keys() == b.breakdown.keys():
            try:
                out.append((key, End(affine(a.peak_bytes, b.peak_bytes, x1, x2, x), a.offset,
                                     {k: affine(v, b.breakdown[k], x1, x2, x)
                                      for k, v in a.breakdown.items()}, a.block)))
                continue
            except NotAffine:
                pass
        bound = a.peak_bytes + -(-(b.peak_bytes - a.peak_bytes) * (x - x1) // (x2 - x1)) \
            if x2 != x1 else a.peak_bytes
        out.append((key, End(bound, -1, {}, a.block)))
    return tuple(out)


def _same_place(a: tuple[int, int] | None, b: tuple[int, int] | None) -> bool:
    if a is None or b is None:
        return a is b
    return a[0] == b[0] or a[1] == b[1]


def sample_at(samples: dict[int, Sample], b: int, device: Any) -> Sample:
    """The sample at batch size ``b``: measured, else on the chord of the two sizes
    above 1 (NOTE [ Fast rows ], 4)."""
    if b in samples:
        return samples[b]
    lo, hi = min(s for s in samples if s != 1), max(samples)
    return mix(samples[lo], samples[hi], lo, hi, b, device=device)


def on_chord(samples: dict[int, Sample], ends: Sequence[int], middle: int,
              device: Any) -> bool:
    """Whether the middle sample's figures are on the chord of the ends' (NOTE [ Fast rows ])."""
    try:
        chord = mix(samples[ends[0]], samples[ends[1]], ends[0], ends[1], middle,
                     device=device)
    except NotAffine:
        return False
    seen = samples[middle]
    return all(getattr(chord, k) == getattr(seen, k) for k in (*INTS, "rank_segments")) and all(
        {k: v for k, v in getattr(chord, key).items() if v}
        == {k: v for k, v in getattr(seen, key).items() if v}
        for key in ("breakdown", "opt_breakdown"))


def same_moments(lo: Sample, hi: Sample) -> bool:
    """Whether two measured samples of one program (at batch sizes ``lo < hi``) take each
    figure at the same moment, so that every size between is their chord (NOTE [ Peak
    moments ] in measure/windows.py): the optimizer's peak and the peak of the phase that
    holds the forward/backward moment are reached at the same moments, and every other
    phase peaks either at its same moment too or below that phase at both ends (its peak
    is convex in ``b``, so below the chosen phase's line between them)."""
    a, b = ({phase: (peak, order) for phase, peak, order in s.moments} for s in (lo, hi))
    chosen = lo.phase
    if not a or a.keys() != b.keys() or chosen != hi.phase or chosen not in a:
        return False
    for phase in a:
        if a[phase][1] == b[phase][1]:
            continue
        if phase in ("optimizer", chosen) \
                or not (a[phase][0] < a[chosen][0] and b[phase][0] < b[chosen][0]):
            return False
    return True


def deepen(s1: Sample, s2: Sample, depths: tuple[int, int], n_blocks: int) -> Sample:
    """Extrapolate in depth; the two depths must peak at the same moments (same phase,
    same kinds of bytes live) and the result must hold no negative part."""
    for key in ("breakdown", "opt_breakdown"):
        kinds = [{k for k, v in getattr(s, key).items() if v} for s in (s1, s2)]
        if kinds[0] != kinds[1]:
            raise NotAffine
    if s1.phase != s2.phase or [v > 0 for v in s1.rank_segments] != [
            v > 0 for v in s2.rank_segments]:
        raise NotAffine
    out = mix(s1, s2, *depths, n_blocks)
    if any(v < 0 for v in [*out.breakdown.values(), *out.opt_breakdown.values(),
                           *out.rank_segments]):
        raise NotAffine
    return _overtaken(out)


def _overtaken(out: Sample) -> Sample:
    """``out`` with its forward/backward moment moved to the end segment that rises above
    it deeper (NOTE [ Fast rows ], 7); NotAffine where a segment that is only bounded
    could be the highest."""
    exact = [(key, end) for key, end in out.ends if end.exact]
    key, top = max(exact, key=lambda item: item[1].peak_bytes, default=(None, None))
    highest = out.peak_bytes if top is None else max(out.peak_bytes, top.peak_bytes)
    if any(not end.exact and end.peak_bytes > highest for _, end in out.ends):
        raise NotAffine  # another moment may overtake deeper
    if key is None or top is None or top.peak_bytes <= out.peak_bytes:
        return out
    if any(v < 0 for v in top.breakdown.values()):
        raise NotAffine
    return dataclasses.replace(out, peak_bytes=top.peak_bytes, phase=key[0],
                               breakdown=dict(top.breakdown))
