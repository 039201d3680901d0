"""The arithmetic of :mod:`remat.simulate._fast`'s samples: the figures of one shallow fake
step, extrapolated along a line through two of them, checked on a chord (NOTE [ Fast rows ]
in _fast.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from remat.core.cost import Category

COMPUTE = ("forward", "backward", "recompute")
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
    :func:`remat.simulate.sharding.segments`; else empty.
    ``ends``: the peaks of the segments at either end of each forward, backward and
    recompute phase (NOTE [ Fast rows ], 7), by ``(phase, "first" | "last", k)``: the
    k-th segment from that end, a segment being a run of samples in one block (or
    outside every block); bytes, upper bounds once interpolated in batch size.
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
    ends: tuple[tuple[tuple[str, str, int], int], ...] = ()


def roofline_times(ops: Sequence[Any], device: Any) -> dict[str, float]:
    from remat.measure import roofline_ms

    return {"compute_ms": float(roofline_ms(ops, device, phases=COMPUTE)),
            "recompute_ms": float(roofline_ms(ops, device, phases=("recompute",))),
            "optimizer_ms": float(roofline_ms(ops, device, phases=("optimizer",)))}


def end_segments(timeline: Any, width: int) -> tuple[tuple[tuple[str, str, int], int], ...]:
    """:attr:`Sample.ends` of a measured step's timeline: per forward, backward and
    recompute phase, the peak bytes of its first and last ``width`` segments (NOTE [ Fast
    rows ], 7); empty without the samples' blocks."""
    if timeline is None or not timeline.blocks:
        return ()
    segments: dict[str, list[int]] = {}
    last: dict[str, Any] = {}
    for live, phase, block in zip(timeline.live_bytes, timeline.phases, timeline.blocks,
                                  strict=True):
        if phase == "optimizer":
            continue
        peaks = segments.setdefault(phase, [])
        if not peaks or last[phase] != block:
            peaks.append(live)
            last[phase] = block
        elif live > peaks[-1]:
            peaks[-1] = live
    return tuple(((phase, end, k), (peaks if end == "first" else peaks[::-1])[k])
                 for phase, peaks in sorted(segments.items())
                 for end in ("first", "last") for k in range(min(width, len(peaks))))


def sample_of(prof: Any, device: Any, width: int = 2,
              rank_segments: tuple[int, ...] = ()) -> Sample:
    """The sample of one shallow step's profile: both moments, every op, roofline times,
    the peaks of the ``width`` segments at either end of each phase (``ends``) and,
    under FSDP, the rank's segment peaks (computed by the caller)."""
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
                  ends=end_segments(prof.timeline, width))


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
              x: int) -> tuple[tuple[tuple[str, str, int], int], ...]:
    """The end segments both samples hold, on their line at ``x`` rounded up: exact for a
    segment that peaks at one moment at both, else (in batch size, where a segment's
    peak is convex) an upper bound between ``x1`` and ``x2``."""
    second = dict(s2.ends)
    return tuple((key, a + -(-(second[key] - a) * (x - x1) // (x2 - x1)) if x2 != x1 else a)
                 for key, a in s1.ends if key in second)


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
    if any(nbytes > out.peak_bytes for _, nbytes in out.ends):
        raise NotAffine  # another moment overtakes deeper (NOTE [ Fast rows ], 7)
    return out
