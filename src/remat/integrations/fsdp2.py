"""FSDP2 (``fully_shard``) with remat: the order that works, and memory per rank.

Example::

    >>> import torch.distributed as dist
    >>> from remat.integrations.fsdp2 import apply_fsdp
    >>> dist.init_process_group("gloo")                 # torchrun sets the rest
    >>> model = apply_fsdp(build_model("llama-small"), "full")

NOTE [ Order: checkpoint, compile, shard ]
    The documented order (torchtitan's) is: 1. ``remat.apply`` (checkpoint
    regions), 2. optionally ``torch.compile`` of each block, 3. ``fully_shard`` of
    each block, then of the root. remat installs regions by replacing the
    *instance* ``forward`` (see NOTE [ Instance forward ] in
    ``remat/strategies/regions.py``): FSDP2's pre/post-forward hooks run around
    ``__call__``, so they stay outside the checkpointed region, parameters are
    all-gathered before the region runs, and recomputation in backward runs after
    FSDP2's pre-backward hook has all-gathered them again. Because nothing is
    wrapped, the reverse order (``fully_shard`` first, ``remat.apply`` after) works
    too, with one exception (Rule 2).

NOTE [ sqrt segments under FSDP2 ]
    Rule 1: a ``sqrt`` segment is one region spanning several blocks; its
    recomputation runs the blocks' forwards back to back inside the last block's
    backward, so every block of the segment must be all-gathered at that moment.
    That holds when the segment is one FSDP2 group: ``fully_shard([b0, b1, ...])``
    (:func:`shard_groups` returns these groups; :func:`apply_fsdp` uses them).
    Rule 2: with one group per block, FSDP2's pre-forward hook re-wraps each
    block's input (``RegisterPostBackwardFunction``), so the next block no longer
    receives the previous block's output object and the segment cannot be
    recorded; and the earlier blocks would be resharded before recomputation.
    :func:`check_segments_sharding` detects this and says how to fix it.

NOTE [ Memory per rank ]
    FSDP divides parameters, gradients and optimizer state by the world size and
    adds what is unsharded at the moment: gathered parameters, collective buffers,
    gradients not yet reduce-scattered. :func:`per_rank_peak` replays a profile's
    timeline moment by moment (NOTE [ FSDP2 per phase ] in
    ``remat/distributed/sharding.py``); without a timeline it adds the largest shard
    group's parameters and gradients plus the root's to one moment (NOTE [ Sharding
    arithmetic ]). Activations are per micro-batch and do not
    change. A per-rank budget therefore equals a single-device budget raised by
    the bytes sharding saves (:func:`single_device_budget_bytes`), which is what a
    single-device planner can be given.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from remat.blocks import BlocksSpec, named_blocks
from remat.distributed.sharding import (
    ShardedPeak,
    fsdp_layout,
    fsdp_timeline_peak,
    scalar_state_bytes,
    shard_peak,
)
from remat.errors import RematError, StrategyError, message
from remat.integrations.compile import compile_blocks
from remat.strategies.handler import handler_of
from remat.strategies.regions import region_of
from remat.strategies.registry import parse_strategy

__all__ = [
    "ProfileBytes",
    "apply_fsdp",
    "check_segments_sharding",
    "is_sharded",
    "per_rank_peak",
    "shard_groups",
    "single_device_budget_bytes",
]

M = TypeVar("M", bound=nn.Module)


class ProfileBytes(Protocol):
    """The parts of a :class:`remat.measure.Profile` the per-rank arithmetic reads."""

    @property
    def peak_bytes(self) -> int: ...

    @property
    def param_bytes(self) -> int: ...

    @property
    def grad_bytes(self) -> int: ...

    @property
    def optimizer_bytes(self) -> int: ...


# ---- detection -------------------------------------------------------------------------

def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` already ran on ``module`` (without importing FSDP)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    return fsdp_module is not None and isinstance(module, fsdp_module)


def _fsdp_state(module: nn.Module) -> Any:
    from torch.distributed.fsdp import fully_shard

    return fully_shard.state(module)  # type: ignore[attr-defined]


def check_segments_sharding(segments: Sequence[Sequence[nn.Module]], *,
                            api: str = "remat.apply") -> None:
    """Raise when ``sqrt`` segments cannot run on the FSDP2 sharding they meet.

    A segment works when none of its blocks is sharded yet, or when all of them
    are one FSDP2 group (NOTE [ sqrt segments under FSDP2 ], Rule 1).

    Args:
        segments: the blocks of each segment, in order.
        api: public API named in the error. Default: ``"remat.apply"``.

    Raises:
        RematError: a segment's blocks are sharded in different groups (or only
            some of them); the message gives both fixes.
    """
    for index, members in enumerate(segments):
        sharded = [is_sharded(m) for m in members]
        if len(members) < 2 or not any(sharded):
            continue
        states = {id(_fsdp_state(m)) for m, s in zip(members, sharded, strict=True) if s}
        if all(sharded) and len(states) == 1:
            continue
        raise RematError(message(
            api, f"sqrt segment {index} spans {len(members)} blocks that fully_shard already "
            "sharded one by one",
            {"blocks": ", ".join(type(m).__name__ for m in members),
             "FSDP groups": f"{len(states)} for {sum(sharded)} sharded blocks",
             "why": "a segment is recomputed as a whole, so its blocks must be all-gathered "
                    "together"},
            fix="apply remat before sharding, e.g. remat.integrations.fsdp2.apply_fsdp(model, "
                "'sqrt'), which shards each segment as one group (fully_shard([block_i, ..., "
                "block_j])); or keep per-block sharding and use a per-block strategy such as "
                "'full' or 'every:N'"))


def shard_groups(model: nn.Module, *, blocks: BlocksSpec = None) -> list[list[nn.Module]]:
    """The modules to ``fully_shard`` together, in forward order.

    One group per block, except that the blocks of a ``sqrt`` segment form one group
    (NOTE [ sqrt segments under FSDP2 ]). Call it after ``remat.apply``.

    Args:
        model: the model, with or without a strategy applied.
        blocks: which modules are blocks (see :func:`remat.find_blocks`). Default: automatic.

    Returns:
        A list of groups, each a list of modules (``fully_shard`` accepts either).

    Example:
        >>> remat.apply(model, "sqrt")   # 4 blocks -> segments [0, 1], [2, 3]
        >>> [len(g) for g in shard_groups(model)]
        [2, 2]
    """
    groups: list[list[nn.Module]] = []
    seen: set[int] = set()
    for _, block in named_blocks(model, blocks, api="remat.integrations.fsdp2.shard_groups"):
        if id(block) in seen:
            continue
        info = region_of(block)
        segment = info.segment if info is not None else None
        members = list(segment.members) if segment is not None else [block]
        seen.update(id(m) for m in members)
        groups.append(members)
    return groups


# ---- the documented order --------------------------------------------------------------

def _default_mesh(model: nn.Module) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RematError(message(
            "remat.integrations.fsdp2.apply_fsdp", "torch.distributed is not initialized",
            fix="launch with torchrun and call torch.distributed.init_process_group() first "
                "(backend 'nccl' on GPUs, 'gloo' on CPU), or pass mesh="))
    devices = {p.device.type for p in model.parameters()}
    device_type = "cuda" if "cuda" in devices or (
        devices <= {"meta"} and torch.cuda.is_available()
    ) else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def apply_fsdp(model: M, strategy: str | Any, *, mesh: Any = None, compile: bool = False,
               blocks: BlocksSpec = None, reshard_after_forward: bool = True,
               mp_policy: Any = None, compile_kwargs: dict[str, Any] | None = None) -> M:
    """Checkpoint, optionally compile, and shard a model with FSDP2, in that order.

    Does NOTE [ Order: checkpoint, compile, shard ]: ``remat.apply(model, strategy)``,
    then ``block.compile()`` for each block when ``compile=True``, then
    ``fully_shard`` on each block (each ``sqrt`` segment as one group), then on the
    root. Sharding trades communication for memory: each rank keeps 1/world of the
    parameters, gradients and optimizer state, and all-gathers one group at a time.

    Warning:
        Give it the model before any ``fully_shard`` call: it shards the model itself.

    Args:
        model: the model, not yet sharded (parameters on their training device, or on
            ``meta`` to be materialised with ``to_empty`` afterwards).
        strategy: a strategy string (see :func:`remat.apply`) or a Plan.
        mesh: the 1-D data-parallel ``DeviceMesh``. Default: ``None``, a mesh over the
            whole default process group on the parameters' device type (cuda or cpu).
        compile: ``torch.compile`` each block in place (``nn.Module.compile``; state_dict
            keys unchanged). Default: ``False``.
        blocks: which modules are blocks (see :func:`remat.find_blocks`). Default: automatic.
        reshard_after_forward: FSDP2's option for the block groups (``True`` frees the
            gathered parameters after forward and gathers them again in backward).
            Default: ``True``.
        mp_policy: an FSDP2 ``MixedPrecisionPolicy``. Default: ``None`` (FSDP2's default).
        compile_kwargs: keyword arguments for ``torch.compile``. Default: ``None``.

    Returns:
        ``model``, modified in place (its class becomes FSDP2's ``FSDP<Class>``).

    Raises:
        RematError: the model is already sharded, or torch.distributed is not initialized.
        StrategyError: ``compile=True`` with ``sqrt`` (segments cannot be compiled per block).

    Example:
        >>> dist.init_process_group("gloo")
        >>> model = apply_fsdp(build_model("llama-tiny"), "ops")
        >>> model(**batch).loss.backward()
    """
    from torch.distributed.fsdp import fully_shard

    from remat.strategies.apply import apply

    api = "remat.integrations.fsdp2.apply_fsdp"
    already = [name or "<root>" for name, m in model.named_modules() if is_sharded(m)]
    if already:
        raise RematError(message(
            api, "fully_shard already ran on the model; apply_fsdp shards the model itself",
            {"sharded": f"{already[:4]}{' ...' if len(already) > 4 else ''}"},
            fix="pass the model before any fully_shard call, or keep your own fully_shard "
                "calls and run remat.apply(model, strategy) after them (every strategy but "
                "'sqrt' works in that order)"))
    if compile and isinstance(strategy, str) \
            and handler_of(parse_strategy(strategy, api=api)).spans_blocks:
        raise StrategyError(message(  # before touching the model
            api, f"compile=True cannot compile {strategy!r} block by block",
            {"why": "its regions span several blocks' calls"},
            fix=f"use 'full', 'every:N', 'ops' or a plan with compile=True, or compile=False "
                f"with {strategy!r}"))
    apply(model, strategy, blocks=blocks)
    groups = shard_groups(model, blocks=blocks)
    if compile:
        compile_blocks(model, blocks=blocks, api=api, **(compile_kwargs or {}))
    if mesh is None:
        mesh = _default_mesh(model)
    options: dict[str, Any] = {"mesh": mesh}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    for group in groups:
        fully_shard(group[0] if len(group) == 1 else group,
                    reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, **options)
    return model


# ---- per-rank memory -------------------------------------------------------------------

def _bytes_of(params: Sequence[nn.Parameter], *, trainable: bool) -> int:
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad or not trainable)


def _unique_params(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        for p in module.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def per_rank_peak(profile: ProfileBytes, model: nn.Module, *, world_size: int,
                  sharding: str = "fsdp", blocks: BlocksSpec = None,
                  prefetch_blocks: int = 0) -> ShardedPeak:
    """One rank's peak when the profiled step runs under FSDP2 (or DDP) on ``world_size`` ranks.

    With a profile that has a timeline (``remat.profile`` gives one) and ``"fsdp"``,
    replays the step moment by moment as one rank holds it: shards, the gathered root
    and block, collective buffers, gradients reduce-scattered so far (NOTE [ FSDP2 per
    phase ] in ``remat/distributed/sharding.py``; equal to the tracker's per-rank peak on
    gloo ranks). A profile on another device than the CPU is taken to run on NCCL, which
    makes no copy of a reduce-scatter's input in PyTorch's memory. Without a timeline,
    turns the profile's parameter, gradient and optimizer bytes into the sharded ones
    and adds what is all-gathered at once: the largest shard group (one block, or one
    ``sqrt`` segment) and the root's own parameters and gradients.
    See NOTE [ Memory per rank ] and ``remat.distributed.sharding.shard_peak``.

    Args:
        profile: a single-device profile of the step (``remat.profile(...)`` with the
            optimizer, so ``optimizer_bytes`` is counted), on the micro-batch each rank runs.
        model: the profiled model (unsharded), with the strategy applied that will run.
        world_size: data-parallel ranks, >= 1.
        sharding: ``"fsdp"`` or ``"ddp"``. Default: ``"fsdp"``.
        blocks: which modules are blocks. Default: automatic.
        prefetch_blocks: groups FSDP gathers ahead of the running one (the arithmetic
            only; the timeline model counts FSDP2's own prefetch). Default: ``0``.

    Returns:
        A :class:`~remat.distributed.sharding.ShardedPeak` (all bytes per rank).

    Example:
        >>> prof = remat.profile(model, batch, optimizer=torch.optim.AdamW(model.parameters()))
        >>> per_rank_peak(prof, model, world_size=8).peak_bytes < prof.peak_bytes
        True
    """
    timeline = getattr(profile, "timeline", None)
    if sharding == "fsdp" and timeline is not None and timeline.live_bytes:
        # NOTE [ FSDP2 per phase ] in remat/distributed/sharding.py: moment by moment
        # gloo (CPU) copies a reduce-scatter's input on its thread; NCCL keeps its own
        copies = str(getattr(profile, "device", "cpu")).startswith("cpu")
        layout = fsdp_layout(model, world_size, blocks=blocks, collective_copy=copies,
                             optimizer_scalar_bytes=scalar_state_bytes(
                                 profile.optimizer_bytes, model))
        return fsdp_timeline_peak((timeline.live_bytes, timeline.phases, timeline.series()),
                                  layout)
    groups = shard_groups(model, blocks=blocks)
    in_blocks = {id(p) for group in groups for p in _unique_params(group)}
    root = [p for p in _unique_params([model]) if id(p) not in in_blocks]
    block_params = max((_bytes_of(_unique_params(g), trainable=False) for g in groups),
                       default=0)
    block_grads = max((_bytes_of(_unique_params(g), trainable=True) for g in groups),
                      default=0)
    if sharding == "ddp":
        block_params = block_grads = 0
    return shard_peak(
        peak_bytes=profile.peak_bytes,
        param_bytes=profile.param_bytes,
        grad_bytes=profile.grad_bytes,
        optimizer_bytes=profile.optimizer_bytes,
        sharding=sharding,
        world_size=world_size,
        block_param_bytes=block_params,
        block_grad_bytes=block_grads,
        root_param_bytes=_bytes_of(root, trainable=False) if sharding == "fsdp" else 0,
        root_grad_bytes=_bytes_of(root, trainable=True) if sharding == "fsdp" else 0,
        prefetch_blocks=prefetch_blocks,
    )


def single_device_budget_bytes(budget_bytes: int, profile: ProfileBytes, model: nn.Module, *,
                               world_size: int, blocks: BlocksSpec = None,
                               prefetch_blocks: int = 0) -> int:
    """The single-device budget equivalent to a per-rank ``budget_bytes`` under FSDP2.

    Sharding changes only parameter, gradient and optimizer bytes, which no
    checkpointing decision touches, so a single-device planner meets the per-rank
    budget exactly when it is given the budget plus the bytes sharding saves:
    ``budget + (single-device peak - per-rank peak)`` (NOTE [ Memory per rank ]).

    Args:
        budget_bytes: memory per GPU, bytes, > 0.
        profile: a single-device profile of the step (optimizer included).
        model: the profiled model (unsharded).
        world_size: data-parallel ranks, >= 1.
        blocks: which modules are blocks. Default: automatic.
        prefetch_blocks: see :func:`per_rank_peak`. Default: ``0``.

    Returns:
        Bytes to pass to ``remat.plan(model, batch, budget=...)``.

    Raises:
        ValueError: ``budget_bytes`` is not a positive int.

    Example:
        >>> plan = remat.plan(model, batch, budget=single_device_budget_bytes(
        ...     parse_bytes("20GiB"), prof, model, world_size=8))
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(message(
            "remat.integrations.fsdp2.single_device_budget_bytes",
            "budget_bytes must be an int > 0", {"found": repr(budget_bytes)},
            fix="pass bytes, e.g. remat.parse_bytes('20GiB')"))
    rank = per_rank_peak(profile, model, world_size=world_size, blocks=blocks,
                         prefetch_blocks=prefetch_blocks)
    return budget_bytes + profile.peak_bytes - rank.peak_bytes

