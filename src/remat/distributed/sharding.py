"""Per-rank peak memory under data parallelism, from a one-device profile.

Two models: arithmetic on one moment's parts (:func:`shard_peak`, NOTE [ Sharding
arithmetic ]; DDP, and FSDP without a timeline), and FSDP2 replayed moment by moment over
the step's timeline (:func:`fsdp_timeline_peak`, NOTE [ FSDP2 per phase ]).

A simulated single-device step gives exact parameter, gradient and optimizer bytes.
Data parallelism changes only those (and adds communication buffers): every rank
still runs the same micro-batch, so activations, the batch, buffers and
temporaries are the same per rank as on one device.

NOTE [ Sharding arithmetic ]
Write the one-device peak as ``peak = P + G + O + R``: parameters, gradients,
optimizer state, and the rest (activations, batch, buffers, temporaries). Then,
per rank with ``W`` ranks:

* ``"none"``: ``peak``.
* ``"ddp"`` (``DistributedDataParallel``): parameters, gradients and optimizer state
  stay whole. DDP allocates flat gradient buckets covering every trainable
  parameter when it is constructed; with the default
  ``gradient_as_bucket_view=False`` the ``.grad`` tensors are separate, so the
  buckets add ``G_total`` bytes. With ``gradient_as_bucket_view=True`` the grads are
  views into the buckets and nothing is added.
* ``"fsdp"`` (FSDP2 ``fully_shard`` per block plus the root, or ZeRO-3):
  ``R + ceil(P/W) + ceil(G/W) + ceil(O/W) + U``, where ``U`` is what is unsharded
  at once: the largest block's parameters (all-gathered for its forward/backward)
  and its gradients before reduce-scatter, plus the root module's own parameters
  and gradients (embeddings, final norm, output head: FSDP2 does not reshard the
  root after forward, and reduce-scatters its gradients at the end of backward).
  Prefetching the next block (FSDP's default overlap) can hold a second block's
  parameters; pass ``prefetch_blocks=1`` to count it.

Caveats: ``G`` should be the gradient bytes alive at the peak. A profile reports
the gradient total; using it assumes all gradients are alive at the peak, which
holds when the peak is at the optimizer step or gradients persist across steps
(``zero_grad(set_to_none=False)``, gradient accumulation), and overstates ``G``'s
share (so slightly understates the sharded peak) when the peak is early in
backward. Communication time and NCCL's own buffers (tens to hundreds of MiB,
set by ``NCCL_BUFFSIZE`` and the number of channels) are not modelled.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from remat.errors import message

Sharding = Literal["none", "fsdp", "ddp"]
SHARDINGS: tuple[str, ...] = ("none", "fsdp", "ddp")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ShardedPeak:
    """One rank's peak, split by category (all bytes, per rank).

    Args:
        peak_bytes: the rank's peak.
        sharding: ``"none"``, ``"fsdp"`` or ``"ddp"``.
        world_size: number of data-parallel ranks.
        param_bytes, grad_bytes: resident (sharded for FSDP) bytes.
        optimizer_bytes: optimizer state; under FSDP its shard plus the shard of the
            step's temporaries (which are part of ``rest_bytes`` otherwise).
        unsharded_bytes: FSDP's all-gathered block and root parameters and gradients;
            DDP's gradient buckets; 0 otherwise.
        rest_bytes: activations, batch, buffers, temporaries (same on every rank).
    """

    peak_bytes: int
    sharding: str
    world_size: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    unsharded_bytes: int
    rest_bytes: int

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ValueError(message("ShardedPeak", "unknown sharding",
                                     {"found": repr(self.sharding)},
                                     fix=f"pass one of {SHARDINGS}"))
        parts = (self.param_bytes, self.grad_bytes, self.optimizer_bytes,
                 self.unsharded_bytes, self.rest_bytes)
        if min(parts) < 0 or sum(parts) != self.peak_bytes:
            raise ValueError(message("ShardedPeak", "parts must be >= 0 and sum to peak_bytes",
                                     {"parts": parts, "peak_bytes": self.peak_bytes},
                                     fix="pass the parts of that same peak"))

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


def shard_peak(
    *,
    peak_bytes: int,
    param_bytes: int,
    grad_bytes: int,
    optimizer_bytes: int,
    sharding: str = "none",
    world_size: int = 1,
    block_param_bytes: int = 0,
    block_grad_bytes: int = 0,
    root_param_bytes: int = 0,
    root_grad_bytes: int = 0,
    prefetch_blocks: int = 0,
    optimizer_temp_bytes: int = 0,
    total_grad_bytes: int | None = None,
    gradient_as_bucket_view: bool = False,
) -> ShardedPeak:
    """One rank's peak under data parallelism, from a single-device peak's parts.

    See NOTE [ Sharding arithmetic ] for the model and its caveats. In short: FSDP
    divides parameter, gradient and optimizer bytes by ``world_size`` and adds the
    largest all-gathered block (and the root's parameters); DDP keeps them whole and
    adds its gradient buckets.

    Args:
        peak_bytes: single-device peak.
        param_bytes, grad_bytes, optimizer_bytes: single-device bytes of each
            (included in ``peak_bytes``).
        sharding: ``"none"``, ``"fsdp"`` or ``"ddp"``. Default: ``"none"``.
        world_size: data-parallel ranks, >= 1. Default: ``1``.
        block_param_bytes, block_grad_bytes: the largest block's parameter and
            gradient bytes (FSDP only).
        root_param_bytes, root_grad_bytes: parameters outside every block and their
            gradients (FSDP only).
        prefetch_blocks: extra blocks whose parameters are gathered ahead (FSDP).
            Default: ``0``.
        optimizer_temp_bytes: temporaries of ``optimizer.step()`` alive at the peak
            (part of ``peak_bytes``, e.g. foreach AdamW's ``sqrt(exp_avg_sq)``); FSDP
            steps a shard, so they are divided like the state. Default: ``0``.
        total_grad_bytes: gradient bytes of every trainable parameter, the size of
            DDP's buckets. Default: ``grad_bytes``.
        gradient_as_bucket_view: DDP's option; ``False`` (its default) adds
            ``total_grad_bytes`` of buckets.

    Returns:
        A :class:`ShardedPeak`.

    Raises:
        ValueError: negative sizes, parts larger than the peak, or bad options.

    Example:
        >>> shard_peak(peak_bytes=100, param_bytes=40, grad_bytes=20, optimizer_bytes=20,
        ...            sharding="fsdp", world_size=4, block_param_bytes=4,
        ...            block_grad_bytes=4).peak_bytes
        48
    """
    api = "remat.simulate.shard_peak"
    values = {"peak_bytes": peak_bytes, "param_bytes": param_bytes, "grad_bytes": grad_bytes,
              "optimizer_bytes": optimizer_bytes, "block_param_bytes": block_param_bytes,
              "block_grad_bytes": block_grad_bytes, "root_param_bytes": root_param_bytes,
              "root_grad_bytes": root_grad_bytes, "prefetch_blocks": prefetch_blocks,
              "optimizer_temp_bytes": optimizer_temp_bytes,
              "total_grad_bytes": grad_bytes if total_grad_bytes is None else total_grad_bytes}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(message(api, f"{name} must be an int >= 0", {"found": repr(value)},
                                     fix=f"pass {name} as an int >= 0"))
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(message(api, "world_size must be an int >= 1",
                                 {"found": repr(world_size)}, fix="pass world_size >= 1"))
    if sharding not in SHARDINGS:
        raise ValueError(message(api, f"unknown sharding {sharding!r}",
                                 fix=f"use one of {', '.join(SHARDINGS)}"))
    rest = peak_bytes - param_bytes - grad_bytes - optimizer_bytes - optimizer_temp_bytes
    if rest < 0:
        raise ValueError(message(
            api, "param_bytes + grad_bytes + optimizer_bytes + optimizer_temp_bytes exceeds "
            "peak_bytes", {"parts": peak_bytes - rest, "peak_bytes": peak_bytes},
            fix="pass the parts of that same peak"))
    if sharding == "none":
        if world_size != 1:
            raise ValueError(message(api, f"world_size={world_size} needs sharding",
                                     fix="pass sharding='fsdp' or 'ddp'"))
        return ShardedPeak(peak_bytes, "none", 1, param_bytes, grad_bytes, optimizer_bytes,
                           0, rest + optimizer_temp_bytes)
    if sharding == "ddp":
        buckets = 0 if gradient_as_bucket_view else values["total_grad_bytes"]
        return ShardedPeak(peak_bytes + buckets, "ddp", world_size, param_bytes, grad_bytes,
                           optimizer_bytes, buckets, rest + optimizer_temp_bytes)
    params = _ceil_div(param_bytes, world_size)
    grads = _ceil_div(grad_bytes, world_size)
    states = _ceil_div(optimizer_bytes + optimizer_temp_bytes, world_size)
    unsharded = ((1 + prefetch_blocks) * block_param_bytes + block_grad_bytes
                 + root_param_bytes + root_grad_bytes)
    return ShardedPeak(rest + params + grads + states + unsharded, "fsdp", world_size,
                       params, grads, states, unsharded, rest)


# NOTE [ FSDP2 per phase ]
# The arithmetic above lowers one peak. Under FSDP2 the rank's peak is usually at another
# moment than the single device's (the optimizer step shrinks by ``W``; backward keeps
# collective buffers), so :func:`fsdp_timeline_peak` replays the single-device step's
# timeline (NOTE [ Memory timeline ] in remat/core/timeline.py) sample by sample and
# rewrites each sample's bytes as one rank holds them, with ``W`` ranks:
#
# 1. Resident: parameters are the rank's shards (dim 0 of each padded to a multiple of
#    ``W``); optimizer state is sharded like them except per-parameter scalars (Adam's
#    ``step``), which every rank keeps whole; optimizer temporaries are divided by ``W``.
# 2. Gathered: the root's parameters from the first forward on (FSDP2 does not reshard
#    the root during a step). In forward, the running block's parameters and its flat
#    all-gather output (the block's parameter bytes again, alive from the all-gather to
#    the copy-out; counted for the whole block). In backward, the block whose gradients
#    are next (the first one in backward order whose gradients are not all there): its
#    parameters once the blocks' backward starts (the first block activation freed in
#    backward), until its reduce-scatter; and, from the start of backward, one flat
#    all-gather buffer of a block's size, which the last block's reduce-scatter no
#    longer holds (measured; which of the prefetch buffer and the previous
#    reduce-scatter input it is was not told apart).
# 3. Gradients: the single device's, except that the blocks whose gradients are complete
#    hold their shards (reduce-scattered); a block's gradients are complete at the first
#    sample where the gradient bytes reach those of the root's head (what backward
#    produced before the first block activation was freed) plus every block from the
#    last down to it. In the optimizer step all gradients are shards.
# 4. Reduce-scatter: after a block's gradients are complete, at the sample with the
#    fewest live bytes before the next gradient (FSDP2's post-backward runs between
#    ops), the rank reshards the block and holds the reduce-scatter input (the block's
#    gradients, flat and padded), its output (their shard) and, on gloo, the backend's
#    copy of the input (NOTE [ Sharded models in the tracker ], 5.), while the block's
#    unsharded gradients are freed except the last parameter's (registration order):
#    FSDP2's loop over the parameters that copies them into the input still references
#    it (measured on gloo CPU ranks: a Llama block's ``down_proj`` weight, a GPT block's
#    last bias). The root's reduce-scatter at the end of backward is counted the same
#    way, after the root is resharded.
#
# What is left out: NCCL's buffers outside PyTorch's allocator; prefetching more than
# the next block; ``reshard_after_forward=False`` on blocks; FSDP groups of several
# blocks (``sqrt`` segments are counted block by block, so their gathered bytes are one
# block's). Fast rows (NOTE [ Fast rows ], 6. in simulate/fast_rows.py) extrapolate the rank's
# largest bytes per segment of the step (:func:`segments`). Measured against the tracker
# on gloo ranks (llama-tiny and gpt-tiny, 2 and 4 ranks, ``none`` and ``full``: equal
# on most ranks, at most one block above on the others) in
# tests/integrations/test_fsdp2_memory.py and docs/distributed.md.


@dataclass(frozen=True)
class FsdpLayout:
    """What FSDP2 shards and gathers, per rank, for :func:`fsdp_timeline_peak`.

    Args:
        world_size: data-parallel ranks, >= 1.
        block_param_bytes: unsharded parameter bytes of each block, in forward order.
        block_grad_bytes: unsharded gradient bytes of each block (trainable parameters).
        block_shard_grad_bytes: one rank's shard of each block's gradients (dim 0 padded).
        block_last_grad_bytes: the gradient bytes of each block's last parameter (in
            registration order), which FSDP2 still references when it reduce-scatters.
        root_param_bytes, root_grad_bytes: parameters outside every block, and their grads.
        root_shard_grad_bytes, root_last_grad_bytes: as for blocks, for the root.
        shard_param_bytes: one rank's shards of every parameter (dim 0 padded), bytes.
        optimizer_scalar_bytes: optimizer state that is not sharded (per-parameter
            scalars such as Adam's ``step``), bytes. Default: ``0``.
        collective_copy: whether the backend copies a reduce-scatter's input (gloo on
            CPU: ``True``; NCCL keeps its buffers outside PyTorch). Default: ``True``.

    Example:
        >>> FsdpLayout(2, (8,), (8,), (4,), (8,), 4, 4, 2, 4, 6).world_size
        2
    """

    world_size: int
    block_param_bytes: tuple[int, ...]
    block_grad_bytes: tuple[int, ...]
    block_shard_grad_bytes: tuple[int, ...]
    block_last_grad_bytes: tuple[int, ...]
    root_param_bytes: int
    root_grad_bytes: int
    root_shard_grad_bytes: int
    root_last_grad_bytes: int
    shard_param_bytes: int
    optimizer_scalar_bytes: int = 0
    collective_copy: bool = True

    def __post_init__(self) -> None:
        n = len(self.block_param_bytes)
        lengths = {len(self.block_grad_bytes), len(self.block_shard_grad_bytes),
                   len(self.block_last_grad_bytes)}
        ints = (self.root_param_bytes, self.root_grad_bytes, self.root_shard_grad_bytes,
                self.root_last_grad_bytes, self.shard_param_bytes,
                self.optimizer_scalar_bytes, *self.block_param_bytes, *self.block_grad_bytes,
                *self.block_shard_grad_bytes, *self.block_last_grad_bytes)
        if self.world_size < 1 or lengths != {n} or min(ints, default=0) < 0:
            raise ValueError(message(
                "FsdpLayout", "world_size must be >= 1, sizes >= 0, one of each per block",
                {"world_size": self.world_size, "blocks": n,
                 "per-block lengths": sorted(lengths)},
                fix="build it with remat.integrations.fsdp2.fsdp_layout(model, world_size)"))


def _block_activation_freed(series: dict[tuple[str, str | None], list[int]],
                            phases: tuple[str, ...]) -> int:
    """The first backward sample at which some block's activations shrink, else -1."""
    blocks = [v for (category, block), v in series.items()
              if block is not None and category in ("activations", "recomputed")]
    for i, phase in enumerate(phases):
        if i and phase in ("backward", "recompute") and any(v[i] < v[i - 1] for v in blocks):
            return i
    return -1


Timeline = tuple[tuple[int, ...], tuple[str, ...], dict[tuple[str, str | None], list[int]]]
"""``(live_bytes, phases, series)`` of a ``MemoryTimeline`` (``series()`` evaluated)."""

def segments(period: int = 1) -> tuple[str, ...]:
    """Segments of a step for :func:`fsdp_segment_peaks`, for blocks whose pattern repeats
    every ``period`` blocks: the phase group (``fwd``, ``bwd``) and where the running
    block is (``root`` when none runs; ``s<i>``: the ``i``-th block from the first,
    ``e<i>``: from the last, ``i < 2 * period``), then the optimizer step (``opt``). A
    uniform stack's rank peak is in one of them (NOTE [ FSDP2 per phase ], fast rows).

    Example:
        >>> segments()
        ('fwd:root', 'fwd:s0', 'fwd:s1', 'fwd:e0', 'fwd:e1', 'bwd:root', ..., 'opt:root')
    """
    ends = [f"{side}{i}" for side in "se" for i in range(2 * period)]
    return (*(f"{group}:{where}" for group in ("fwd", "bwd") for where in ("root", *ends)),
            "opt:root")


def _positions(k: int | None, blocks: int) -> tuple[str, ...]:
    """Every position name of block ``k`` of ``blocks`` (None: no block runs)."""
    if k is None:
        return ("root",)
    return (f"s{k}", f"e{blocks - 1 - k}")


def fsdp_moments(timeline: Timeline,
                 layout: FsdpLayout) -> list[tuple[str, int | None, ShardedPeak]]:
    """Every moment of a single-device step as one rank holds it under FSDP2, with its
    phase group (``fwd``, ``bwd``, ``opt``) and running block (NOTE [ FSDP2 per phase ]).

    Args:
        timeline: ``(live_bytes, phases, series)`` of the single-device step's
            ``MemoryTimeline``.
        layout: what FSDP2 shards and gathers (:class:`FsdpLayout`).

    Returns:
        ``(group, block index or None, ShardedPeak)`` per sample, then one per
        reduce-scatter.
    """
    live_bytes, phases, series = timeline
    w = layout.world_size
    n = len(live_bytes)

    def column(category: str) -> list[int]:
        out = [0] * n
        for (cat, _), values in series.items():
            if cat == category:
                out = [a + b for a, b in zip(out, values, strict=True)]
        return out

    params, grads = column("parameters"), column("gradients")
    states, temps = column("optimizer_state"), column("optimizer_temporaries")
    blocks = len(layout.block_param_bytes)
    freed = _block_activation_freed(series, phases)
    head = grads[freed - 1] if freed > 0 else 0
    # gradient bytes at which block k (in forward order) is complete: NOTE, 3.
    done_at = [head + sum(layout.block_grad_bytes[k:]) for k in range(blocks)]
    starts = sorted(next((i for i, v in enumerate(vals) if v), n)
                    for (c, b), vals in series.items() if c == "activations" and b is not None)
    out: list[tuple[str, int | None, ShardedPeak]] = []

    def moment(i: int, *, finished: int, gathered: int, extra: int = 0) -> ShardedPeak:
        """Sample ``i`` as one rank holds it: ``finished`` blocks (from the last) have
        their gradients reduce-scattered; ``gathered`` and ``extra`` bytes are held."""
        last = blocks - finished
        rank_grads = (grads[i] - sum(layout.block_grad_bytes[last:])
                      + sum(layout.block_shard_grad_bytes[last:]))
        if phases[i] == "optimizer":
            rank_grads = grads[i] and (sum(layout.block_shard_grad_bytes)
                                       + layout.root_shard_grad_bytes)
        scalars = min(layout.optimizer_scalar_bytes, states[i])
        rank_states = _ceil_div(states[i] - scalars, w) + scalars + _ceil_div(temps[i], w)
        rest = live_bytes[i] - params[i] - grads[i] - states[i] - temps[i]
        return ShardedPeak(rest + layout.shard_param_bytes + rank_grads + rank_states
                           + gathered + extra, "fsdp", w, layout.shard_param_bytes,
                           rank_grads, rank_states, gathered + extra, rest)

    root = layout.root_param_bytes
    first_root = next((i for i in range(n) if params[i] > 0), n)
    for i in range(first_root, n):
        if phases[i] == "forward":  # NOTE, 2.: the running block and its flat buffer
            running = [k for k in range(min(blocks, len(starts))) if starts[k] <= i]
            k = running[-1] if running else None
            block = 2 * layout.block_param_bytes[k] if k is not None else 0
            out.append(("fwd", k, moment(i, finished=0, gathered=root + block)))
        elif phases[i] == "optimizer":
            out.append(("opt", None, moment(i, finished=blocks, gathered=root)))
        else:
            finished = sum(1 for k in range(blocks) if freed > 0 and grads[i] >= done_at[k])
            if finished < blocks:
                k = blocks - 1 - finished
                block = layout.block_param_bytes[k] * (2 if freed >= 0 and i >= freed else 1)
                out.append(("bwd", k, moment(i, finished=finished, gathered=root + block)))
            else:
                out.append(("bwd", None, moment(i, finished=finished, gathered=root)))
    # reduce-scatters (NOTE, 4.): block k right after its gradients are complete
    copies = 2 if layout.collective_copy else 1
    for k in reversed(range(blocks) if freed >= 0 else ()):
        first = next((i for i in range(freed, n)
                      if phases[i] in ("backward", "recompute") and grads[i] >= done_at[k]),
                     None)
        if first is None:
            continue
        end = next((i for i in range(first + 1, n) if grads[i] != grads[first]), n)
        i = min(range(first, end), key=lambda j: (live_bytes[j], j))
        held = (copies * layout.block_grad_bytes[k] + layout.block_shard_grad_bytes[k]
                - layout.block_grad_bytes[k] + layout.block_last_grad_bytes[k])
        out.append(("bwd", k,
                    moment(i, finished=blocks - 1 - k,
                           gathered=root + (layout.block_param_bytes[k] if k else 0),
                           extra=held)))
    bwd = [i for i in range(n) if phases[i] in ("backward", "recompute")]
    if bwd and layout.root_grad_bytes:
        held = (copies * layout.root_grad_bytes + layout.root_shard_grad_bytes
                - layout.root_grad_bytes + layout.root_last_grad_bytes)
        out.append(("bwd", None, moment(bwd[-1], finished=blocks, gathered=0, extra=held)))
    return out


def fsdp_timeline_peak(timeline: Timeline, layout: FsdpLayout) -> ShardedPeak:
    """One rank's peak under FSDP2, replaying a single-device step moment by moment.

    Where :func:`shard_peak` lowers the single-device peak, this rewrites every sample of
    the step's timeline as one rank holds it and takes the largest (NOTE [ FSDP2 per
    phase ]): it finds the moment the rank peaks at (usually a block's reduce-scatter in
    backward) at the cost of one pass over the samples.

    Args:
        timeline: ``(tl.live_bytes, tl.phases, tl.series())`` of the single-device step's
            ``MemoryTimeline`` ``tl``, bytes.
        layout: what FSDP2 shards and gathers (:class:`FsdpLayout`).

    Returns:
        A :class:`ShardedPeak` of ``"fsdp"`` at the rank's largest moment (the first of
        equals): ``grad_bytes`` the rank's gradients then, ``unsharded_bytes`` everything
        gathered or buffered for collectives.

    Example:
        >>> tl = prof.timeline
        >>> fsdp_timeline_peak((tl.live_bytes, tl.phases, tl.series()), layout).peak_bytes
    """
    moments = fsdp_moments(timeline, layout)
    if not moments:
        return ShardedPeak(0, "fsdp", layout.world_size, 0, 0, 0, 0, 0)
    return max((peak for _, _, peak in moments), key=lambda p: p.peak_bytes)


def fsdp_segment_peaks(timeline: Timeline, layout: FsdpLayout,
                       period: int = 1) -> tuple[int, ...]:
    """The rank's largest bytes in each of :func:`segments` (0 where a segment has no
    moment), for the fast rows (NOTE [ FSDP2 per phase ]): on a uniform stack whose
    pattern repeats every ``period`` blocks, :func:`fsdp_timeline_peak` is their maximum."""
    best = dict.fromkeys(segments(period), 0)
    blocks = len(layout.block_param_bytes)
    for group, k, peak in fsdp_moments(timeline, layout):
        for where in _positions(k, blocks):
            segment = f"{group}:{where}"
            if segment in best:
                best[segment] = max(best[segment], peak.peak_bytes)
    return tuple(best.values())


def _shard_bytes(p: Any, world_size: int) -> int:
    """One rank's bytes of ``p`` under ``fully_shard``: dim 0 padded to a multiple of
    ``world_size`` (FSDP2's ``Shard(0)``)."""
    if p.dim() == 0:
        return int(p.element_size())
    return _ceil_div(int(p.shape[0]), world_size) * (int(p.numel()) // max(int(p.shape[0]), 1)
                                                     ) * int(p.element_size())


def scalar_state_bytes(optimizer_bytes: int, model: Any) -> int:
    """Optimizer state that FSDP does not shard: what is left of ``optimizer_bytes`` after
    whole copies of ``model``'s trainable parameters (Adam's per-parameter ``step``),
    when that is below 8 bytes a parameter; else 0.

    Example:
        >>> scalar_state_bytes(2 * 400 + 8, model_with_two_params_of_100_floats)
        8
    """
    trainable = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    grads = sum(int(p.numel()) * int(p.element_size()) for p in trainable)
    if not grads:
        return 0
    left = optimizer_bytes - (optimizer_bytes // grads) * grads
    return left if left < 8 * len(trainable) else 0


def fsdp_layout(model: Any, world_size: int, *, blocks: Any = None,
                optimizer_scalar_bytes: int = 0, collective_copy: bool = True) -> FsdpLayout:
    """The :class:`FsdpLayout` of ``model`` (unsharded, any device including meta) when
    each block and then the root are ``fully_shard``-ed over ``world_size`` ranks.

    Args:
        model: the model, before sharding.
        world_size: data-parallel ranks, >= 1.
        blocks: which modules are blocks (``remat.blocks`` spec). Default: automatic.
        optimizer_scalar_bytes, collective_copy: see :class:`FsdpLayout`.

    Example:
        >>> fsdp_layout(build_model("llama-tiny"), 4).world_size
        4
    """
    from remat.blocks import named_blocks
    from remat.errors import BlocksNotFound

    try:
        named = named_blocks(model, blocks)
    except BlocksNotFound:
        named = []
    seen: set[int] = set()
    per_block: list[list[Any]] = []
    for _, block in named:
        params = [p for p in block.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        per_block.append(params)
    root = [p for p in dict.fromkeys(model.parameters()) if id(p) not in seen]

    def whole(ps: list[Any], trainable: bool) -> int:
        return sum(int(p.numel()) * int(p.element_size()) for p in ps
                   if p.requires_grad or not trainable)

    def shard(ps: list[Any]) -> int:
        return sum(_shard_bytes(p, world_size) for p in ps if p.requires_grad)

    def last(ps: list[Any]) -> int:
        trainable = [p for p in ps if p.requires_grad]
        return whole(trainable[-1:], True)

    return FsdpLayout(
        world_size=world_size,
        block_param_bytes=tuple(whole(ps, False) for ps in per_block),
        block_grad_bytes=tuple(whole(ps, True) for ps in per_block),
        block_shard_grad_bytes=tuple(shard(ps) for ps in per_block),
        block_last_grad_bytes=tuple(last(ps) for ps in per_block),
        root_param_bytes=whole(root, False), root_grad_bytes=whole(root, True),
        root_shard_grad_bytes=shard(root), root_last_grad_bytes=last(root),
        shard_param_bytes=sum(_shard_bytes(p, world_size)
                              for p in dict.fromkeys(model.parameters())),
        optimizer_scalar_bytes=optimizer_scalar_bytes, collective_copy=collective_copy)
