"""The arithmetic of the fast plan rows: a uniform stack's memory windows from steps of the
stack cut short, and windows and block runs between two batch sizes.

NOTE [ Windows from shallow steps ]
The planner calibrates its peak model on one whole step without checkpointing, cut
into memory windows (NOTE [ Memory windows ] in measure/windows.py). For a uniform stack
of ``L`` blocks each window's peak is affine in the window's block index ``i`` and in
``L``: it holds what the ``i`` blocks before saved, the gradients of the blocks after
``i`` (in backward), and the parameters, gradients and optimizer state of ``L`` blocks.
So each kind of window gets one affine function ``A + B i + C L``:

* kinds: ``pre``, ``fwd:i``, ``gap:i`` for ``i < L - 1``, the head (``gap:L-1``: last
  block's output to the loss and back), ``bwd:i``, ``after:i``, ``tail``,
  ``optimizer``; the unindexed ones are ``A + C L``.
* the function goes through three of the kind's peaks in steps of the stack cut to
  ``d1`` and ``d2 = d1 + 1`` blocks (``i = 0`` at both, ``i = 1`` at ``d2``), and
  *every* peak of steps cut to ``d1``, ``d2`` and ``d3 = d2 + 1`` blocks must lie on
  it exactly, in the window order of a ``d``-block stack (``_order``); else the
  whole-depth windows step runs (:class:`~remat.simulate.samples.NotAffine`).

Llama-7B in bf16 at batch 4: ``fwd:i`` falls by 64 MiB per block, ``bwd:i`` rises by
one block's gradients (450 MiB) per block after it, the head by 1.07 GiB per block
(parameters, optimizer state). Batch sizes between two measured ones are interpolated
window by window where both peak at the same moment (NOTE [ Peak moments ] in
measure/windows.py), else measured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from remat.measure.windows import StepWindows
from remat.planning.block_run import BlockRun
from remat.simulate.samples import NotAffine, affine

#: Stack lengths the windows are measured at: two to fit, the third to check.
SHALLOW = (2, 3, 4)
_INDEXED = ("fwd", "gap", "bwd", "after")


def _kind(label: str, depth: int) -> tuple[str, int]:
    """``(kind, index)`` of a window label in a ``depth``-block step (index 0 if none)."""
    kind, _, index = label.partition(":")
    if kind not in _INDEXED:
        return kind, 0
    i = int(index)
    return ("head", 0) if kind == "gap" and i == depth - 1 else (kind, i)


def _order(depth: int, after: bool, optimizer: bool) -> tuple[str, ...]:
    """The window labels of a ``depth``-block step in the order they open."""
    labels = ["pre"]
    for i in range(depth):
        labels += [f"fwd:{i}", f"gap:{i}"]
    for i in reversed(range(depth)):
        labels += [f"bwd:{i}", *([f"after:{i}"] if after and i > 0 else [])]
    return (*labels, "tail", *(["optimizer"] if optimizer else []))


def _layout(steps: Mapping[int, StepWindows]) -> tuple[bool, bool]:
    """``(after, optimizer)``: which optional windows the steps have; each step's order must
    be the canonical one for its depth."""
    deepest = steps[max(steps)]
    after = any(label.startswith("after:") for label in deepest.order)
    optimizer = "optimizer" in deepest.order
    for depth, step in steps.items():
        if tuple(step.order) != _order(depth, after, optimizer):
            raise NotAffine
    return after, optimizer


def deepen_windows(steps: Mapping[int, StepWindows], n_blocks: int) -> StepWindows:
    """The windows of the ``n_blocks`` step from steps at :data:`SHALLOW` depths (NOTE
    [ Windows from shallow steps ]).

    Raises:
        NotAffine: the shallow steps' windows are not on one affine function per kind.
    """
    d1, d2, _ = SHALLOW
    after, optimizer = _layout(steps)
    points: dict[str, dict[tuple[int, int], int]] = {}
    phases: dict[str, str] = {}
    for depth, step in steps.items():
        for label, peak in step.peaks.items():
            kind, i = _kind(label, depth)
            points.setdefault(kind, {})[(i, depth)] = peak
            phase = step.phases.get(label, "")
            if phases.setdefault(kind, phase) != phase:
                raise NotAffine  # a kind that peaks in different phases: not one pattern
    lines: dict[str, tuple[int, int, int]] = {}
    for kind, values in points.items():
        try:
            first, deeper = values[(0, d1)], values[(0, d2)]
            slope_l = deeper - first  # d2 = d1 + 1
            slope_i = values[(1, d2)] - deeper if kind in _INDEXED else 0
        except KeyError:
            raise NotAffine from None
        line = (first - slope_l * d1, slope_i, slope_l)
        if any(line[0] + line[1] * i + line[2] * d != v for (i, d), v in values.items()):
            raise NotAffine
        lines[kind] = line
    peaks: dict[str, int] = {}
    for label in _order(n_blocks, after, optimizer):
        kind, i = _kind(label, n_blocks)
        a, b, c = lines[kind]
        peaks[label] = a + b * i + c * n_blocks
    return StepWindows(peaks, tuple(peaks), max(peaks.values()), {}, (), {},
                       phases={label: phases[_kind(label, n_blocks)[0]] for label in peaks})


def interpolate_windows(lo: StepWindows, hi: StepWindows, sizes: Sequence[int],
                        batch_size: int) -> StepWindows:
    """The windows at ``batch_size`` between two steps at ``sizes = (b_lo, b_hi)``.

    Raises:
        NotAffine: some window peaks at different moments at the two sizes (NOTE
            [ Peak moments ]), or the steps' windows differ.
    """
    if lo.order != hi.order or lo.moments != hi.moments or lo.phases != hi.phases \
            or set(lo.moments) != set(lo.peaks):
        raise NotAffine
    b_lo, b_hi = sizes
    peaks = {label: affine(lo.peaks[label], hi.peaks[label], b_lo, b_hi, batch_size)
             for label in lo.order}
    return StepWindows(peaks, lo.order, max(peaks.values()), {}, (), {}, dict(lo.moments),
                       dict(lo.phases))


def mix_run(lo: BlockRun, hi: BlockRun, ends: tuple[int, int], batch_size: int) -> BlockRun:
    """The block run at ``batch_size`` between two runs at ``ends`` (NOTE [ Peak moments ])."""
    if lo.forward_peak_at is None or (lo.forward_peak_at, lo.backward_peak_at,
                                      lo.backward_peak_phase, len(lo.ops)) != (
            hi.forward_peak_at, hi.backward_peak_at, hi.backward_peak_phase, len(hi.ops)):
        raise NotAffine
    b1, b2 = ends

    def line(a: int, b: int) -> int:
        return affine(a, b, b1, b2, batch_size)

    ops = []
    for o1, o2 in zip(lo.ops, hi.ops, strict=True):
        if (o1.name, o1.phase, o1.block, o1.dtype_bytes) != (o2.name, o2.phase, o2.block,
                                                            o2.dtype_bytes):
            raise NotAffine
        ops.append(dataclasses.replace(
            o1, flops=line(o1.flops, o2.flops), read_bytes=line(o1.read_bytes, o2.read_bytes),
            write_bytes=line(o1.write_bytes, o2.write_bytes),
            alloc_bytes=line(o1.alloc_bytes, o2.alloc_bytes)))
    return dataclasses.replace(
        lo, saved_bytes=line(lo.saved_bytes, hi.saved_bytes),
        forward_peak_bytes=line(lo.forward_peak_bytes, hi.forward_peak_bytes),
        backward_peak_bytes=line(lo.backward_peak_bytes, hi.backward_peak_bytes),
        ops=tuple(ops))
