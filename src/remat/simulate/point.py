"""One simulated point: a strategy (already applied) at one micro-batch size, as a row.

NOTE [ Step time ]
The predicted step time is the roofline sum over the recorded ops
(:func:`remat.measure.roofline_ms`): forward, backward, recomputation and the
optimizer step. With FSDP the optimizer runs on a 1/world_size shard, so its part
is divided by ``world_size``; communication is not modelled (it overlaps with
compute in a well-tuned run), nor are kernel-launch gaps, so the time is a lower
bound and throughputs are upper bounds. ``samples_per_s`` and ``tokens_per_s``
count all ranks.

NOTE [ Peaks under sharding ]
Under FSDP the per-rank peak replays the simulated step's timeline moment by moment
(NOTE [ FSDP2 per phase ] in distributed/sharding.py; the fast rows extrapolate its segments). Under
DDP, per-rank peaks come from :func:`remat.distributed.sharding.shard_peak` applied to
the breakdown of live bytes at the simulated peak; what follows is the arithmetic
``shard_peak`` does for a profile without a timeline. A one-device peak in the
optimizer step (AdamW's foreach temporaries) shrinks under FSDP while the
activation peak does not, so when the one-device peak is in the optimizer phase a
second simulation without the optimizer gives the forward/backward peak's
breakdown (plus the constant optimizer state), and the rank's peak is the larger
of the two, sharded.

NOTE [ Reserved per rank ]
A row fits when its rank's reserved peak, library workspaces included, is within the
card's capacity less what lives outside the allocator (NOTE [ Fits on the card ] in
card_fit.py). On one device the reserved peak is the simulated step's allocations
replayed through the model of PyTorch's caching allocator (``Profile.reserved``: the
first and a steady step, under the job's ``PYTORCH_CUDA_ALLOC_CONF``), exactly as for a
real step. Under sharding the rank's allocations are not replayed one by one: its
reserved peak is its allocated peak plus what the one-device step's transient storages
(those its forward and backward create and free: activations, recomputations,
temporaries) reserve above their own live peak: the same requests in the same order on a
rank. Parameters, gradients and optimizer state are left out of that replay: on a rank
they are shards (FSDP) or buckets, allocated in another pattern.
Fast rows take that overhead from their shallow steps (NOTE [ Fast rows ]): the largest
of the samples a row is built from.
It is an estimate: what a step reserves above its allocated peak is not affine in depth
or batch, so fast rows read it from steps of the same shape and keep the largest; a fast row whose
margin is within 5% of the card's limit (``_CONFIRM_SHARE`` in run.py), where that
estimate could decide the fit, is simulated exactly instead, and ``exact=True`` replays
every row's whole step. Plan rows composed from candidates take
the ``none`` row's overhead at their batch size. ``simulate(..., fits_on="allocated")``
judges a row on its allocated peak instead, for an allocator that reserves what it
allocates (``backend:cudaMallocAsync``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from remat.card_fit import CardFit
from remat.core.allocator_replay import AllocationLog, predict_step_reserved
from remat.core.cost import Category, StepCost
from remat.distributed.sharding import (
    FsdpLayout,
    ShardedPeak,
    fsdp_layout,
    fsdp_timeline_peak,
    scalar_state_bytes,
    shard_peak,
)
from remat.simulate.result import SimulationRow
from remat.simulate.sim_setup import Setup


def shard(breakdown: Mapping[Category, int], grad_total_bytes: int, setup: Setup) -> ShardedPeak:
    """Shard one moment's live bytes (NOTE [ Sharding arithmetic ] in distributed/sharding.py)."""
    layout = setup.layout
    return shard_peak(
        peak_bytes=sum(breakdown.values()),
        param_bytes=breakdown.get(Category.PARAMETERS, 0),
        grad_bytes=breakdown.get(Category.GRADIENTS, 0),
        optimizer_bytes=breakdown.get(Category.OPTIMIZER_STATE, 0),
        optimizer_temp_bytes=breakdown.get(Category.OPTIMIZER_TEMPORARIES, 0),
        total_grad_bytes=grad_total_bytes,
        sharding=setup.sharding,
        world_size=setup.world_size,
        block_param_bytes=layout.block_param_bytes,
        block_grad_bytes=layout.block_grad_bytes,
        root_param_bytes=layout.root_param_bytes,
        root_grad_bytes=layout.root_grad_bytes,
    )


def profile_point(setup: Setup, batch: Any, optimizer: torch.optim.Optimizer | None) -> Any:
    """One simulated step of ``setup.model`` (with its current strategy) on ``batch``."""
    return next(profile_points(setup, [batch], optimizer))


def profile_points(setup: Setup, batches: Sequence[Any],
                   optimizer: torch.optim.Optimizer | None) -> Iterator[Any]:
    """:func:`profile_point` on each of ``batches``, one warm-up for them all, each yielded
    as soon as it is simulated (:func:`remat.measure.profile.simulated_profiles`)."""
    from remat.measure.profile import simulated_profiles

    return simulated_profiles(setup.model, batches, loss_fn=setup.loss_fn, optimizer=optimizer,
                              blocks=setup.blocks)


def per_rank(setup: Setup, nbytes: int) -> int:
    """Resident bytes of one rank: divided (rounded up) under FSDP, else whole."""
    return -(-nbytes // setup.world_size) if setup.sharding == "fsdp" else nbytes


def fsdp_layout_of(setup: Setup, model: Any, optimizer_bytes: int) -> FsdpLayout:
    """The FSDP2 layout of ``model`` (``setup.model`` or a cut copy of it) on
    ``setup.world_size`` GPU ranks (NCCL: no backend copies; NOTE [ FSDP2 per phase ])."""
    return fsdp_layout(model, setup.world_size, blocks=setup.blocks, collective_copy=False,
                       optimizer_scalar_bytes=scalar_state_bytes(optimizer_bytes, model))


def _rank_peak(setup: Setup, prof: Any, batch: Any) -> int:
    """The per-rank peak of a profiled step; see NOTE [ Peaks under sharding ]."""
    if setup.sharding == "none":
        return int(prof.peak_bytes)  # exact, no arithmetic
    timeline = prof.timeline
    if setup.sharding == "fsdp" and timeline is not None and timeline.live_bytes:
        layout = fsdp_layout_of(setup, setup.model, int(prof.optimizer_bytes))
        return fsdp_timeline_peak((timeline.live_bytes, timeline.phases, timeline.series()),
                                  layout).peak_bytes
    moments = [dict(prof.peak_breakdown)]
    if setup.sharding == "fsdp" and setup.optimizer is not None \
            and prof.peak_phase == "optimizer":
        # The forward/backward peak, with the optimizer state (constant outside the
        # optimizer step) added back.
        fwd_bwd = profile_point(setup, batch, None)
        moments.append({**fwd_bwd.peak_breakdown,
                        Category.OPTIMIZER_STATE: int(prof.optimizer_bytes)})
    return max(shard(m, int(prof.grad_bytes), setup).peak_bytes for m in moments)


def _step_ms(setup: Setup, prof: Any) -> float:
    """Roofline step time, ms; see NOTE [ Step time ]."""
    from remat.measure import roofline_ms

    compute_ms = roofline_ms(prof.ops, setup.device, phases=("forward", "backward", "recompute"))
    optimizer_ms = roofline_ms(prof.ops, setup.device, phases=("optimizer",))
    if setup.sharding == "fsdp":
        optimizer_ms /= setup.world_size
    return float(compute_ms + optimizer_ms)


def point(setup: Setup, strategy: str, batch_size: int, seq_len: int) -> SimulationRow:
    """Simulate one step of ``setup.model`` as it is now and turn it into a row."""
    return next(points(setup, strategy, [batch_size], seq_len))


def points(setup: Setup, strategy: str, batch_sizes: Sequence[int],
           seq_len: int) -> Iterator[SimulationRow]:
    """:func:`point` at each of ``batch_sizes``, one warm-up for them all, each row yielded
    as soon as its step is simulated (``setup.model`` as it is then: read them all before
    changing its strategy).

    The trade-off against one :func:`point` per size: the sizes share one fake copy and
    its warm-up step (:func:`profile_points`), so ``n`` sizes cost ``n + 1`` fake steps
    instead of ``2 n``; each size's tracked step is still the whole step at that size.
    """
    if not batch_sizes:
        return iter(())
    batches = [setup.batch_fn(b, seq_len) for b in batch_sizes]
    profiles = profile_points(setup, batches, setup.optimizer)
    return (row_of(setup, strategy, b, seq_len, prof, batch)
            for b, prof, batch in zip(batch_sizes, profiles, batches, strict=True))


def card_fit(setup: Setup, rank_peak_bytes: int, reserved_extra_bytes: int,
             expandable_extra_bytes: int | None) -> CardFit:
    """The row's fit on its card (NOTE [ Reserved per rank ]): the rank's allocated peak
    plus what the one-device step reserves above its allocated peak, with the default
    segments and with expandable ones; ``fits_on="allocated"`` counts none."""
    if setup.fits_on == "allocated":
        return setup.card.check(rank_peak_bytes, rank_peak_bytes)
    return setup.card.check(
        rank_peak_bytes, rank_peak_bytes + max(reserved_extra_bytes, 0),
        None if expandable_extra_bytes is None
        else rank_peak_bytes + max(expandable_extra_bytes, 0))


def reserved_extras(setup: Setup, prof: Any) -> tuple[int, int]:
    """What the profiled step reserves above its allocated peak, with the job's allocator
    settings and with expandable segments, bytes (NOTE [ Reserved per rank ]); none
    replayed with ``fits_on="allocated"``. Under sharding only the forward and backward's
    transient storages are replayed (:func:`_transient_log`): the rank's parameters,
    gradients and optimizer state are shards, laid out otherwise."""
    if setup.fits_on == "allocated":
        return 0, 0
    log = prof.allocations
    if log is None:
        return 0, 0
    if setup.sharding != "none":
        log = _transient_log(log)
    peak = log.live_peak_bytes
    expandable = dataclasses.replace(setup.allocator, expandable_segments=True)
    return (max(predict_step_reserved(log, setup.allocator).reserved_bytes - peak, 0),
            max(predict_step_reserved(log, expandable).reserved_bytes - peak, 0))


def _transient_log(log: AllocationLog) -> AllocationLog:
    """The forward and backward's own storages, without those alive when backward ends
    (the gradients) or when the step starts (NOTE [ Reserved per rank ]): what a rank
    allocates as the one device does, the sharded state left out."""
    end = log.optimizer_start if log.optimizer_start is not None else len(log.events)
    events = log.events[:end]
    alive: set[object] = set()
    for key, signed, _, _ in events:
        if signed > 0:
            alive.add(key)
        else:
            alive.discard(key)
    return AllocationLog((), tuple(e for e in events if e[0] not in alive))


def fit_note(fit: CardFit) -> str:
    """The row's note about its fit: empty, or that expandable segments make it fit."""
    return "fits with expandable_segments:True" if fit.needs_expandable_segments else ""


def row_of(setup: Setup, strategy: str, batch_size: int, seq_len: int, prof: Any,
           batch: Any) -> SimulationRow:
    """The row of a simulated step's profile (its step: ``setup.model`` as it is now on
    ``batch``, with ``setup.optimizer``)."""
    from remat.measure import roofline_ms

    peak = _rank_peak(setup, prof, batch)
    step_ms = _step_ms(setup, prof)
    samples_per_s = batch_size * setup.world_size / (step_ms / 1e3) if step_ms > 0 else 0.0
    cost = StepCost(
        peak_bytes=peak,
        step_ms=step_ms,
        activation_bytes=int(prof.activation_bytes),
        param_bytes=per_rank(setup, int(prof.param_bytes)),
        grad_bytes=per_rank(setup, int(prof.grad_bytes)),
        optimizer_bytes=per_rank(setup, int(prof.optimizer_bytes)),
        flops=int(prof.flops),
        recompute_flops=int(prof.recompute_flops),
        recompute_ms=float(roofline_ms(prof.ops, setup.device, phases=("recompute",))),
    )
    fit = card_fit(setup, peak, *reserved_extras(setup, prof))
    return SimulationRow(
        strategy=strategy,
        batch_size=batch_size,
        seq_len=seq_len,
        cost=cost,
        fits=fit.fits,
        samples_per_s=samples_per_s,
        tokens_per_s=samples_per_s * seq_len,
        single_device_peak_bytes=int(prof.peak_bytes),
        peak_phase=prof.peak_phase,
        note=fit_note(fit),
        reserved_bytes=fit.reserved_bytes,
        margin_bytes=fit.margin_bytes,
    )


def static_parts(setup: Setup, rows: Sequence[SimulationRow], batch_size: int,
                 seq_len: int) -> dict[Category, int]:
    """One device's parameter, gradient and optimizer-state bytes by :class:`Category`
    (from a row, else one profile): the static categories (NOTE [ Static bytes ] in
    remat/core/cost.py) a per-rank budget translates; every key present."""
    if rows and setup.sharding != "fsdp":  # rows hold whole (unsharded) figures then
        cost = rows[0].cost
    else:
        cost = profile_point(setup, setup.batch_fn(batch_size, seq_len), setup.optimizer).cost
    return {category: cost.held.get(category, 0) for category in
            (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE)}
