"""The fast path of :func:`remat.simulate.simulate`: a few shallow fake steps per strategy.

NOTE [ Fast rows ]
A transformer's blocks are identical, and every tensor of its step has a size that is
a constant or proportional to the micro-batch ``b`` (no ``b**2`` term: attention's
``(b, heads, s, s)`` is linear in ``b``). So for a uniform stack of ``L`` blocks:

1. *Depth*: every figure of the step (peak bytes and their breakdown, saved bytes,
   FLOPs, each op's roofline time) is affine in the number of blocks ``L`` once the
   strategy's pattern repeats: the peak sits at the same moment relative to the
   stack's ends (start of backward, recompute of the last block, end of backward),
   and each extra block adds the same bytes to it. The stack is cut to ``L1`` and
   ``L2`` blocks (``2`` and ``3``; for ``every:N`` two lengths congruent to ``L``
   modulo ``N``), each is simulated, and the figures are extrapolated to ``L``
   with integer arithmetic.
2. *Batch*: at a fixed depth, each moment's live bytes, each op's FLOPs and bytes
   moved are affine in ``b``, so the peak (the largest moment) is convex in ``b``.
   Two sizes ``b1 < b2`` give the chord. Where both peak at the same moments (each
   phase's peak reached at the same op, or a phase below the chosen one at both:
   ``same_moments``), every size between is on it (NOTE [ Peak moments ] in
   measure/windows.py) and none is simulated. Else a third ``b1 < bm < b2`` is, and
   checks the chord: a convex function that meets its chord inside the interval is
   affine on all of it. When that fails too (the peak moves, e.g. from the end of
   backward to the loss as ``b`` grows), each half, ``[b1, bm]`` and ``[bm, b2]``,
   is treated the same way. Roofline times are summed per op from the op's
   interpolated FLOPs and bytes, so an op that turns compute-bound at larger ``b``
   is priced exactly.
3. *Two moments*: each shallow step runs with the optimizer and reports each
   phase's own peak (:attr:`remat.measure.Profile.phase_peaks`): the
   forward/backward moment (the largest of the forward, backward and recompute
   peaks, optimizer state included) and the optimizer step's moment (its
   temporaries, and whatever backward left alive, which differs by strategy). Both
   are affine in ``L`` and ``b`` and extrapolated side by side; the one-device peak
   is the larger, and under sharding both are sharded as
   :func:`~remat.simulate.point.point` does (NOTE [ Peaks under sharding ]).
4. *Batch size 1 is not on the line*: a dimension of size 1 makes tensors
   contiguous whatever their strides, so a ``reshape`` or ``contiguous`` that copies
   at ``b >= 2`` is a free view at ``b = 1`` (the causal-LM loss flattens the shifted
   logits ``logits[:, :-1]``: a view at ``b = 1``, a copy of the logits above).
   Size 1 is sampled at both depths on its own, and the chord runs through the
   sizes above it. All sizes, strategies and depths share one fake copy of the
   stack cut to the deepest first depth pair of any strategy, warmed up once
   (:class:`remat.measure.profile.WarmFake`) and cut further in place (``cut_copy``:
   each depth's optimizer keeps the warm state of the parameters left, which is what
   a warm-up at that depth makes; the copy starts without strategies, each is
   applied to it and removed again: that state does not depend on the strategy).
   Each depth has its own chord: a stack's peak can move in ``b`` at one depth and
   not at the other.
5. *The peak's moment can change with depth*: with few blocks the largest moment
   may be the loss's (at the start of backward, logits and their gradient alive)
   while with more it is a recomputation late in backward, where the gradients
   of many blocks are alive. Two depths whose samples peak at different moments
   (phase or kinds of live bytes differ) are not extrapolated; the sizes concerned
   are sampled one step deeper and the deeper pair is tried, up to ``_DEEPER``
   pairs, before the row takes the exact path. (Llama-7B ``full`` at ``b`` 2-16
   peaks at the loss with 2 blocks and in recomputation from 3.)

6. *FSDP*: the rank's peak is not the one-device peak sharded but the largest moment
   of the step as one rank holds it (NOTE [ FSDP2 per phase ] in distributed/sharding.py). Each
   shallow step reports the rank's largest bytes per segment (forward or backward of
   the root, the first ``2N`` and the last ``2N`` blocks for a pattern of ``N``
   blocks; the optimizer step), each affine in ``L`` and ``b`` like the figures above,
   and the row's rank peak is the largest extrapolated one. A block further inside is
   never larger than both of the nearest ones of its residue modulo ``N`` on either
   side (its bytes are affine in its index; the first and last block of each residue
   are kept apart because the stack's ends hold other buffers), so the depths start at
   ``2N + 1`` blocks. ``sqrt`` (FSDP groups of several blocks) takes the exact path.
7. *A phase's peak can move to its other end with depth*: in backward the loss's
   moment (every block's saved tensors alive) grows with ``L`` by a block's saved
   bytes, the end of backward (every block's gradients alive) by a block's
   gradients; at two shallow depths the first may be the larger and at ``L`` the
   second (``ops`` at micro-batch 1: the loss at 2 and 3 blocks, the end of backward
   from 4). Each sample keeps the peaks of the segments at either end of each phase
   (a segment: a run of samples in one block, or outside every block; the first and
   last ``step + 1`` of them, ``step`` the pattern's period). Within a phase the
   blocks between are passed in order and each one's moments are affine in its
   position (saved tensors of the blocks before it, gradients of the blocks after),
   so a phase's peak lies in its end segments. Each end segment keeps where in it
   its peak was first reached and the bytes per category then; an end segment that
   peaks at the same place at both depths (same offset, same kinds of bytes) is
   extrapolated like the peak, and where it rises above the extrapolated peak the
   row's moment moves to it (its bytes, phase and breakdown: Llama-7B ``none`` at
   micro-batch 1 and ``full`` at 4 and 8 peak at the end of backward at 32 blocks,
   at the loss at 2 and 3). Interpolated in batch between sizes whose segment peaked
   at different places, an end segment is only an upper bound; one that rises above
   every known moment has the peak possibly moving: the pair is not extrapolated, and
   the deeper pairs of 5 are tried. A key names the same segment at two depths when
   its block is as far from the stack's first block, or from its last, at both;
   else it reached past the other end's segments at the shallower depth (``sqrt``'s
   recomputations run one segment per ``k`` blocks: at ``k + r`` blocks the second
   from the last is the last segment's) and is left out: deeper it names a segment
   between the ends.

Parameter, gradient and optimizer-state bytes come out exact (they are affine in
``L`` by construction). ``sqrt`` is cut to one and two of its full segments (of
``k = ceil(sqrt(L))`` blocks) plus its last one, keeping ``k``. Non-uniform stacks
(several stacks, blocks of different shapes), stacks too short to cut and unknown
patterns fall back to the exact path: a full fake step per row (a strategy's rows after
one shared warm-up: :func:`~remat.simulate.point.points`); a batch size whose
depth pairs all peak at different moments (5) takes it for that row alone.
``simulate(..., exact=True)`` always takes it; the tests compare the two row by row.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

from remat.blocks import BlocksSpec
from remat.core.cost import StepCost
from remat.measure.profile import WarmFake
from remat.simulate.point import card_fit, fit_note, reserved_extras, shard
from remat.simulate.result import SimulationRow
from remat.simulate.samples import (
    NotAffine,
    Sample,
    deepen,
    mix,
    on_chord,
    same_moments,
    sample_at,
    sample_of,
)
from remat.simulate.sim_setup import Setup

_DEEPER = 3  # depth pairs tried before a row takes the exact path (NOTE [ Fast rows ], 5)


def uniform_stack(model: nn.Module,
                  blocks: BlocksSpec) -> tuple[nn.Module, str, list[nn.Module]] | None:
    """``model``'s one uniform stack of blocks (container, attribute, blocks), else None.

    Uniform: one ``ModuleList`` / ``Sequential`` holding exactly the blocks (at least
    five), each of one type with parameters of the same names, shapes and dtypes.
    """
    from remat.blocks import named_blocks
    from remat.errors import BlocksNotFound

    try:
        named = named_blocks(model, blocks)
    except BlocksNotFound:
        return None
    parents = {name.rpartition(".")[0] for name, _ in named}
    if len(parents) != 1 or len(named) < 5:
        return None
    path = parents.pop()
    container = model.get_submodule(path)
    modules = [m for _, m in named]
    if not isinstance(container, (nn.ModuleList, nn.Sequential)) \
            or list(container) != modules:
        return None
    shapes = [[(n, p.shape, p.dtype, p.requires_grad) for n, p in m.named_parameters()]
              + [type(m)] for m in modules]
    if any(s != shapes[0] for s in shapes):
        return None
    owner, _, attr = path.rpartition(".")
    return model.get_submodule(owner), attr, modules


def _depths(label: str, n_blocks: int, sharding: str = "none") -> tuple[int, int] | None:
    """``(L1, step)``: the shallowest stack length to cut to and the step between cut
    lengths over which ``label``'s pattern repeats, else None (stack too short, or a
    pattern of several blocks under FSDP: NOTE [ Fast rows ], 6)."""
    kind, _, arg = label.partition(":")
    if n_blocks < 1:  # no uniform stack to cut
        return None
    if sharding == "fsdp":  # NOTE [ Fast rows ], 6.
        if kind == "sqrt":
            return None
        step = int(arg) if kind == "every" and arg.isdigit() else 1
        first = 2 * step + 1
        first += (n_blocks - first) % step
        return (first, step) if first + step < n_blocks else None
    if kind == "sqrt":
        k, r = _sqrt_shape(n_blocks)
        return (k + r, k) if 2 * k + r < n_blocks else None
    step = int(arg) if kind == "every" and arg.isdigit() else 1
    first = step + n_blocks % step if step > 1 else 2
    if first + step >= n_blocks:
        return None
    return first, step


def _sqrt_shape(n_blocks: int) -> tuple[int, int]:
    """``(k, r)``: ``sqrt``'s segment length for ``n_blocks`` and its last segment's."""
    from remat.strategies.builtin.sqrt import sqrt_segments

    segments = sqrt_segments(n_blocks)
    return len(segments[0]), len(segments[-1])


def _apply(cut: Setup, label: str, modules: Sequence[nn.Module], n_blocks: int) -> None:
    """Apply ``label`` to the cut stack; ``sqrt`` keeps the full stack's segment length
    (full segments of ``k`` blocks, then the last one of ``r``), so that depth adds whole
    segments."""
    from remat.strategies import apply
    from remat.strategies.regions import install_segment

    if label != "sqrt":
        apply(cut.model, label, blocks=cut.blocks)
        return
    k, r = _sqrt_shape(n_blocks)
    apply(cut.model, "none", blocks=cut.blocks)
    starts = [*range(0, len(modules) - r, k), len(modules) - r]
    for start, end in zip(starts, [*starts[1:], len(modules)], strict=True):
        install_segment(list(modules[start:end]), label="sqrt")


@contextmanager
def _cut(setup: Setup, stack: tuple[nn.Module, str, list[nn.Module]],
         depth: int) -> Iterator[Setup]:
    """``setup`` with its stack cut to ``depth`` blocks (and an optimizer for what is left)."""
    owner, attr, modules = stack
    original = getattr(owner, attr)
    setattr(owner, attr, nn.ModuleList(modules[:depth])
            if isinstance(original, nn.ModuleList) else nn.Sequential(*modules[:depth]))
    try:
        optimizer = setup.optimizer
        if optimizer is not None:
            params = [p for p in dict.fromkeys(setup.model.parameters()) if p.requires_grad]
            accepted = inspect.signature(type(optimizer)).parameters
            optimizer = type(optimizer)(params, **{k: v for k, v in optimizer.defaults.items()
                                                   if k in accepted})
        yield dataclasses.replace(setup, optimizer=optimizer)
    finally:
        setattr(owner, attr, original)


@contextmanager
def cut_copy(model: nn.Module, path: str, attr: str, modules: Sequence[nn.Module],
             optimizer: Any, depth: int) -> Iterator[Any]:
    """A fake copy's stack (``attr`` of its submodule ``path``, holding ``modules``) cut
    in place to its first ``depth`` blocks, and an optimizer over the parameters left,
    each group's hyperparameters and each parameter's warm state kept (NOTE [ Fast rows
    ], 4); the state a step at this depth adds goes back to ``optimizer``."""
    owner = model.get_submodule(path)
    stack = getattr(owner, attr)
    setattr(owner, attr, nn.ModuleList(modules[:depth])
            if isinstance(stack, nn.ModuleList) else nn.Sequential(*modules[:depth]))
    sub = optimizer
    try:
        if optimizer is not None and depth < len(modules):
            present = set(model.parameters())
            groups = [{**group, "params": [p for p in group["params"] if p in present]}
                      for group in optimizer.param_groups]
            cls: Any = type(optimizer)  # torch.optim classes take groups alone
            sub = cls([g for g in groups if g["params"]])
            # in the groups' order, as a step creates it: the allocation log replays the
            # state in this order (a set's order follows addresses: another each run)
            sub.state.update({p: optimizer.state[p] for group in groups
                              for p in group["params"] if p in optimizer.state})
        yield sub
    finally:
        setattr(owner, attr, stack)
        if sub is not optimizer:
            optimizer.state.update(sub.state)  # what a step at this depth created


class FastContext:
    """What every strategy's fast rows share: the setup, its one uniform stack, and warm
    fake copies of it cut short (NOTE [ Fast rows ], 4); the first is cut to the deepest
    first depth pair of the strategies to come, ``labels``, and serves every depth."""

    def __init__(self, setup: Setup, labels: Sequence[str] = ()) -> None:
        self.setup = setup
        self.stack = uniform_stack(setup.model, setup.blocks)
        n_blocks = len(self.stack[2]) if self.stack is not None else 0
        cuts = [cut for cut in (_depths(label, n_blocks, setup.sharding) for label in labels)
                if cut]
        self.depth = max((first + step for first, step in cuts), default=0)
        self._path = next((n for n, m in setup.model.named_modules()
                           if self.stack is not None and m is self.stack[0]), "")
        #: per depth, a warm fake copy of the stack cut to it and the copy's blocks
        self._copies: dict[int, tuple[WarmFake, list[nn.Module]]] = {}

    @contextmanager
    def warm_copy(self, depth: int, seq_len: int,
                  first: int) -> Iterator[tuple[WarmFake, Setup, list[nn.Module]]]:
        """The stack cut to ``depth`` blocks as a warm fake copy (one copy at this depth or
        deeper, warmed up on batch size ``first`` once, cut in place), the setup on that
        copy (its optimizer over the parameters left), and the copy's blocks left."""
        assert self.stack is not None
        deep = min((d for d in self._copies if d >= depth), default=None)
        if deep is None:
            deep = max(depth, self.depth)
            self._copies[deep] = self._copy(deep, seq_len, first)
        warm, blocks = self._copies[deep]
        full = warm.optimizer
        with cut_copy(warm.model, self._path, self.stack[1], blocks, full,
                      depth) as optimizer:
            warm.optimizer = optimizer
            try:
                yield (warm, dataclasses.replace(self.setup, model=warm.model,
                                                 optimizer=optimizer), blocks[:depth])
            finally:
                warm.optimizer = full

    def _copy(self, depth: int, seq_len: int, first: int) -> tuple[WarmFake, list[nn.Module]]:
        from remat.measure.step import Step, check_runnable
        from remat.measure.tracked_step import check_trainable
        from remat.strategies import remove

        assert self.stack is not None
        check_trainable(self.setup.model)
        check_runnable(self.setup.model, api="remat.simulate", simulate=True)
        with _cut(self.setup, self.stack, depth) as cut:
            step = Step(cut.model, cut.batch_fn(first, seq_len), loss_fn=cut.loss_fn,
                        optimizer=cut.optimizer, blocks=cut.blocks)
            warm = WarmFake(step, step.batch, prepare=remove)
        owner = warm.model.get_submodule(self._path)
        return warm, list(getattr(owner, self.stack[1]))


def _measure(ctx: FastContext, label: str, depth: int, sizes: Sequence[int],
             seq_len: int) -> dict[int, Sample]:
    """Samples of ``label``'s step (optimizer included) at ``depth`` blocks, on the warm
    fake copy every strategy shares (NOTE [ Fast rows ], 4)."""
    from remat.strategies import remove

    assert ctx.stack is not None
    if not sizes:
        return {}
    with ctx.warm_copy(depth, seq_len, sizes[0]) as (warm, on_copy, blocks):
        _apply(on_copy, label, blocks, len(ctx.stack[2]))
        try:
            profs = warm.profiles([on_copy.batch_fn(b, seq_len) for b in sizes])
        finally:
            remove(on_copy.model)
        period = _depths(label, len(ctx.stack[2]), "fsdp") or (0, 1)
        # the copy is cut to ``depth`` only inside this block
        cut = _depths(label, len(ctx.stack[2]))
        width = 1 + (cut[1] if cut is not None else 1)  # NOTE [ Fast rows ], 7
        return {b: sample_of(prof, on_copy.device, width,
                             _rank_segments(on_copy, prof, period[1]),
                             reserved_extras(on_copy, prof))
                for b, prof in zip(sizes, profs, strict=True)}


def _rank_segments(setup: Setup, prof: Any, period: int) -> tuple[int, ...]:
    """Under FSDP, the rank's peak per segment of a shallow step whose pattern repeats
    every ``period`` blocks (NOTE [ Fast rows ], 6)."""
    from remat.distributed.sharding import fsdp_segment_peaks
    from remat.simulate.point import fsdp_layout_of

    timeline = prof.timeline
    if setup.sharding != "fsdp" or timeline is None:
        return ()
    layout = fsdp_layout_of(setup, setup.model, int(prof.optimizer_bytes))
    return fsdp_segment_peaks((timeline.live_bytes, timeline.phases, timeline.series()),
                              layout, period)


def _level(ctx: FastContext, label: str, depth: int, sizes: Sequence[int],
           seq_len: int) -> dict[int, Sample]:
    """Samples at one depth that give every size (NOTE [ Fast rows ], 2 and 4): batch
    size 1 on its own, the smallest and largest size above it, and the sizes between
    from them (:func:`_between`)."""
    ones = [b for b in sizes if b == 1]
    affine = [b for b in sizes if b != 1]
    if len(affine) <= 2:
        return _measure(ctx, label, depth, sizes, seq_len)
    samples = _measure(ctx, label, depth, [*ones, affine[0], affine[-1]], seq_len)
    _between(ctx, label, depth, affine, samples, seq_len)
    return samples


def _between(ctx: FastContext, label: str, depth: int, span: Sequence[int],
             samples: dict[int, Sample], seq_len: int) -> None:
    """Add to ``samples`` (which hold ``span``'s ends) every size of ``span`` between its
    ends (NOTE [ Fast rows ], 2): interpolated where the ends peak at the same moments
    (NOTE [ Peak moments ] in measure/windows.py), or on the chord of the ends checked at
    a middle size, which is measured; else each half on its own."""
    lo, hi, inner = span[0], span[-1], list(span[1:-1])
    if not inner:
        return
    device = ctx.setup.device

    def chord(skip: int | None = None) -> dict[int, Sample] | None:
        try:
            return {b: mix(samples[lo], samples[hi], lo, hi, b, device=device)
                    for b in inner if b != skip}
        except NotAffine:
            return None

    if same_moments(samples[lo], samples[hi]) and (mixed := chord()) is not None:
        samples.update(mixed)
        return
    middle = inner[len(inner) // 2]
    samples.update(_measure(ctx, label, depth, [middle], seq_len))
    if on_chord(samples, (lo, hi), middle, device) and (mixed := chord(middle)) is not None:
        samples.update(mixed)
        return
    cut = list(span).index(middle)
    _between(ctx, label, depth, span[:cut + 1], samples, seq_len)
    _between(ctx, label, depth, span[cut:], samples, seq_len)


def fast_rows(ctx: FastContext, label: str, sizes: Sequence[int],
              seq_len: int) -> list[SimulationRow | None] | None:
    """``label``'s rows from shallow fake steps (NOTE [ Fast rows ]): None for the whole
    label, or for one row, where the exact path must run instead."""
    if ctx.stack is None:
        return None
    n_blocks = len(ctx.stack[2])
    cut = _depths(label, n_blocks, ctx.setup.sharding)
    if cut is None:
        return None
    first, step = cut
    device = ctx.setup.device
    samples: dict[int, Sample] = {}
    try:
        levels = {d: _level(ctx, label, d, sizes, seq_len) for d in (first, first + step)}
        depth = first + step
        pending = list(sizes)
        for _ in range(_DEEPER):
            for b in pending:
                try:
                    samples[b] = deepen(sample_at(levels[depth - step], b, device),
                                         sample_at(levels[depth], b, device),
                                         (depth - step, depth), n_blocks)
                except NotAffine:
                    continue
            pending = [b for b in pending if b not in samples]
            depth += step
            if not pending or depth >= n_blocks:
                break
            # NOTE [ Fast rows ], 5: the two depths peak at different moments
            levels[depth] = _measure(ctx, label, depth, pending, seq_len)
    except NotAffine:
        return None
    return [_row(ctx.setup, label, b, seq_len, samples[b]) if b in samples else None
            for b in sizes]


def _moments(setup: Setup, sample: Sample) -> tuple[int, int, str | None]:
    """``(one-device peak, rank peak, phase)`` from the two moments (NOTE [ Fast rows ], 3),
    sharded as :func:`remat.simulate.point._rank_peak` shards an exact step."""
    fwd_peak, opt_peak = sample.peak_bytes, sample.opt_peak_bytes
    in_optimizer = setup.optimizer is not None and opt_peak > fwd_peak
    peak, phase = (opt_peak, "optimizer") if in_optimizer else (fwd_peak, sample.phase)
    if setup.sharding == "none":
        return peak, peak, phase
    if setup.sharding == "fsdp" and sample.rank_segments:
        return peak, max(sample.rank_segments), phase
    moments = [sample.opt_breakdown if in_optimizer else sample.breakdown]
    if setup.sharding == "fsdp" and in_optimizer:
        moments.append(sample.breakdown)
    return peak, max(shard(m, sample.grad_bytes, setup).peak_bytes for m in moments), phase


def _row(setup: Setup, label: str, batch_size: int, seq_len: int,
         sample: Sample) -> SimulationRow:
    from remat.simulate.point import per_rank

    peak, rank_peak, phase = _moments(setup, sample)
    optimizer_ms = sample.optimizer_ms
    if setup.sharding == "fsdp":
        optimizer_ms /= setup.world_size
    step_ms = sample.compute_ms + optimizer_ms
    samples_per_s = batch_size * setup.world_size / (step_ms / 1e3) if step_ms > 0 else 0.0
    cost = StepCost(
        peak_bytes=rank_peak, step_ms=step_ms, activation_bytes=sample.activation_bytes,
        param_bytes=per_rank(setup, sample.param_bytes),
        grad_bytes=per_rank(setup, sample.grad_bytes),
        optimizer_bytes=per_rank(setup, sample.optimizer_bytes),
        flops=sample.flops, recompute_flops=sample.recompute_flops,
        recompute_ms=sample.recompute_ms,
    )
    fit = card_fit(setup, rank_peak, sample.reserved_extra_bytes,
                   sample.expandable_extra_bytes)
    return SimulationRow(
        strategy=label, batch_size=batch_size, seq_len=seq_len, cost=cost,
        fits=fit.fits,
        samples_per_s=samples_per_s, tokens_per_s=samples_per_s * seq_len,
        single_device_peak_bytes=peak, peak_phase=phase, note=fit_note(fit),
        reserved_bytes=fit.reserved_bytes, margin_bytes=fit.margin_bytes,
    )
