"""One pipeline rank's bytes under a schedule (NOTE [ Pipeline schedules ] in schedule.py).

NOTE [ Pipeline rank bytes ]
    :func:`pipeline_rank_bytes` simulates one step of the whole model as one rank runs
    it (fake tensors): with ``tp > 1`` the step of tensor-parallel rank 0, the model
    parallelized as ``apply_tp`` does on a fake process group (``rank_model`` in
    tp_step.py, NOTE [ One tensor-parallel rank, simulated ]), so every byte below is
    the rank's own, DTensor's redistributions included. Every block and the largest
    modules outside the blocks (embedding, final norm, head, however nested) are
    attribution units, and each unit goes to its chunk: blocks by index; modules
    outside the blocks to the first chunk when they come before the first block in the
    model's module order (the embedding), to the last chunk otherwise (final norm,
    head). Per chunk and micro-batch: the saved activations (what no unit holds goes to
    the last chunk: the loss's, and tables the model's forward computes once outside
    every block, such as RoPE's, which each real stage computes for itself); its
    parameters, gradients and optimizer state as the rank's step holds them (each
    parameter's local shard, its gradient, the optimizer's state of it; a tied
    embedding and head count on both ends, as a pipeline holds both copies, once when
    both ends are one chunk); its backward working set: the most bytes the step's
    backward and recompute held at once while that chunk's units ran (the logits'
    gradient on the last chunk); and the roofline time of its recompute, priced from
    the rank's own ops (an op on DTensors by its shards). A rank's peak is the most,
    over its action list, of its static bytes plus every held chunk-micro-batch's
    saved bytes, plus, at a ``B``, that chunk's working set; one chunk and one
    micro-batch without FSDP is the simulated step itself, whose peak it takes (so
    ``stages=1`` with one micro-batch gives :func:`tp_rank_bytes`'s figures: tested).
    With ``dp > 1`` (FSDP over pipeline replicas) the replay is NOTE [ FSDP under pipeline
    parallelism ] in pipeline_fsdp.py: shards, plus the chunks' parameters unsharded
    from their first forward and gradients unsharded from their first backward, as
    ``torch.distributed.pipelining`` runs FSDP. Without a pipeline (``stages=1``) FSDP
    reshards after every forward and backward: the static bytes are sharded
    ``ceil(x / dp)`` and the largest block is counted gathered (parameters and
    gradients).
    A uniform stack of more than three blocks (one list of blocks of one shape, as the
    fast simulation rows require: NOTE [ Fast rows ] in simulate/fast_rows.py) is simulated cut to
    three blocks, before it is parallelized (TP's layout of a block does not depend on
    the blocks around it), and every block between the first and the last takes the
    middle one's figures (strategies that treat blocks alike only; ``every:N`` and
    ``sqrt`` run the whole stack). ``tests/distributed/test_pipeline.py`` checks the cut
    against the whole stack byte for byte, with TP and SP too.
    Not modelled: point-to-point buffers, the stage inputs a rank receives and keeps
    for its backward besides the first block's saved input, collective buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from remat.distributed.pipeline_fsdp import FsdpChunk, fsdp_rank_bytes, plain_rank_bytes
from remat.distributed.pipeline_record import CUT_DEPTH, cut_stack, expand_record, record_step
from remat.distributed.schedule import check_schedule, held_microbatches, schedule_actions
from remat.errors import message

API = "remat.distributed.pipeline.pipeline_rank_bytes"


def chunk_blocks(n_blocks: int, chunks: int) -> tuple[range, ...]:
    """Consecutive block indices per chunk, as even as possible (earlier chunks get the
    remainder), as torchtitan's even split does.

    Example:
        >>> chunk_blocks(5, 2)
        (range(0, 3), range(3, 5))
    """
    if chunks > n_blocks:
        raise ValueError(message(API, "more pipeline chunks than blocks",
                                 {"blocks": n_blocks, "chunks (stages x virtual stages)": chunks},
                                 fix="use fewer stages or virtual stages"))
    base, extra = divmod(n_blocks, chunks)
    out, start = [], 0
    for c in range(chunks):
        size = base + (1 if c < extra else 0)
        out.append(range(start, start + size))
        start += size
    return tuple(out)


# ---- bytes per rank ----------------------------------------------------------------------

@dataclass(frozen=True)
class StageBytes:
    """One pipeline rank's bytes (NOTE [ Pipeline rank bytes ]; all bytes are per rank).

    Args:
        rank: pipeline rank.
        blocks: block indices on this rank (all its chunks).
        held_microbatches: most chunk-micro-batches held at once.
        param_bytes, grad_bytes, optimizer_bytes: static bytes. With ``dp > 1`` under a
            pipeline: parameter and optimizer-state shards, and the gradients unsharded
            as the step holds them (NOTE [ FSDP under pipeline parallelism ]).
        activation_bytes: saved activations of one micro-batch through the rank's chunks.
        peak_bytes: the rank's peak over its schedule.
        recompute_ms: roofline time of the recompute of one micro-batch through the
            rank's chunks on ``device``, ms.
        gathered_param_bytes: unsharded parameters held at once at most besides the
            shards (``dp > 1``; 0 otherwise). Default: 0.
    """

    rank: int
    blocks: tuple[int, ...]
    held_microbatches: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    peak_bytes: int
    recompute_ms: float
    gathered_param_bytes: int = 0

    def __post_init__(self) -> None:
        sizes = (self.param_bytes, self.grad_bytes, self.optimizer_bytes,
                 self.activation_bytes, self.peak_bytes, self.held_microbatches,
                 self.gathered_param_bytes)
        if self.rank < 0 or min(sizes) < 0 or self.recompute_ms < 0:
            raise ValueError(message("StageBytes", "rank and sizes must be >= 0",
                                     {"rank": self.rank, "sizes": sizes},
                                     fix="pass the figures of one pipeline rank"))

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        out = asdict(self)
        out["blocks"] = list(self.blocks)
        return out


@dataclass
class _Chunk:
    saved: int = 0
    work: int = 0
    params: int = 0
    grads: int = 0
    state: int = 0
    scalars: int = 0
    blocks: list[tuple[int, int]] = field(default_factory=list)
    recompute_ms: float = 0.0


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if name else prefix


def _unit_chunk(model: nn.Module, blocks: Sequence[str],
                ranges: Sequence[range]) -> Callable[[str | None], int]:
    """Map an attribution unit (or a module name) to its chunk."""
    chunk_of_block = {name: c for c, r in enumerate(ranges) for i in r
                      for name in (blocks[i],)}
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    first = order.get(blocks[0], 0)
    last = len(ranges) - 1

    def find(unit: str | None) -> int:
        if unit is None:
            return last
        name = unit
        while name:
            if name in chunk_of_block:
                return chunk_of_block[name]
            name = name.rpartition(".")[0]
        return 0 if order.get(unit, first + 1) < first else last
    return find


def pipeline_rank_bytes(model: Any, *, seq_len: int, batch_size: int, stages: int,
                        microbatches: int, schedule: str = "1f1b", virtual_stages: int = 1,
                        tp: int = 1, sequence_parallel: bool = False, dp: int = 1,
                        strategy: str = "none", dtype: str = "bf16",
                        optimizer: str = "adamw", device: str = "h100-80gb",
                        exact: bool = False, reshard_after_forward: bool = False,
                        tp_plan: dict[str, Any] | None = None) -> tuple[StageBytes, ...]:
    """Each pipeline rank's static, activation and peak bytes under a schedule.

    One simulated step of the whole model as one tensor-parallel rank runs it (fake
    tensors and a fake process group, nothing allocated), split into chunks and
    replayed over the schedule's action lists (NOTE [ Pipeline rank bytes ], NOTE
    [ Micro-batches in flight ]). Cheap (one step whatever the degrees; a uniform
    stack cut to three blocks), but the replay is arithmetic on that step:
    collective and point-to-point buffers are not in it, so keep a margin. When
    ``torch.distributed`` is already initialized here and ``tp > 1`` it runs in a
    subprocess (the caller's group is left alone).

    Args:
        model: a preset name, a factory (called on the meta device) or a module.
        seq_len: tokens per sequence.
        batch_size: sequences per micro-batch.
        stages: pipeline ranks ``p``.
        microbatches: micro-batches per step ``m``.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved-1f1b"``. Default: ``"1f1b"``.
        virtual_stages: chunks per rank (interleaved only). Default: 1.
        tp: tensor-parallel degree within each stage (``apply_tp``'s layout). Default: 1.
        sequence_parallel: with ``tp > 1``. Default: ``False``.
        dp: data-parallel (FSDP) degree over pipeline replicas. Default: 1.
        reshard_after_forward: with ``dp > 1`` and ``stages > 1``, FSDP's
            ``reshard_after_forward`` of every group: ``False`` (torchtitan's default
            under pipeline parallelism) keeps each chunk's parameters gathered from its
            first forward to the step's end; ``True`` gathers them again at every
            forward, less memory during forwards, one more all-gather per micro-batch
            (NOTE [ FSDP under pipeline parallelism ]). Default: ``False``.
        strategy: remat strategy applied to every block. Default: ``"none"``.
        dtype: precision (see :data:`remat.simulate.PRECISIONS`). Default: ``"bf16"``.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"`` or ``"none"``. Default: ``"adamw"``.
        device: device whose roofline prices the recompute. Default: ``"h100-80gb"``.
        exact: simulate the whole stack; by default a uniform stack of more than three
            blocks is simulated cut to three (its first, a middle and its last block
            stand for all), which gives the same bytes. Default: ``False``.

    Returns:
        One :class:`StageBytes` per pipeline rank.

    Raises:
        RematError: with ``tp > 1``, as :func:`tp_rank_bytes` (a head count ``tp`` does
            not divide, a step that fails under the layout).

    Example:
        >>> ranks = pipeline_rank_bytes("llama-7b", seq_len=4096, batch_size=1, stages=4,
        ...                             microbatches=8, strategy="full")  # doctest: +SKIP
        >>> [r.held_microbatches for r in ranks]  # doctest: +SKIP
        [4, 3, 2, 1]
    """
    from remat.distributed.tp_step import run_isolated
    from remat.simulate.sim_setup import check_ints

    check_schedule(API, schedule, stages, microbatches, virtual_stages)
    check_ints(API, "seq_len, batch_size, tp and dp", (seq_len, batch_size, tp, dp))
    kwargs = {"model": model, "seq_len": seq_len, "batch_size": batch_size,
              "stages": stages, "microbatches": microbatches, "schedule": schedule,
              "virtual_stages": virtual_stages, "tp": tp,
              "sequence_parallel": sequence_parallel, "dp": dp, "strategy": strategy,
              "dtype": dtype, "optimizer": optimizer, "device": device, "exact": exact,
              "reshard_after_forward": reshard_after_forward, "tp_plan": tp_plan}
    out: tuple[StageBytes, ...] = run_isolated(_rank_bytes, kwargs, tp=tp, api=API)
    return out


def _rank_bytes(model: Any, *, seq_len: int, batch_size: int, stages: int,
                microbatches: int, schedule: str, virtual_stages: int, tp: int,
                sequence_parallel: bool, dp: int, strategy: str, dtype: str,
                optimizer: str, device: str, exact: bool, reshard_after_forward: bool,
                tp_plan: dict[str, Any] | None = None) -> tuple[StageBytes, ...]:
    """:func:`pipeline_rank_bytes` in a process without a ``torch.distributed`` group."""
    import dataclasses

    from remat.blocks import named_blocks
    from remat.devices import get_device
    from remat.distributed.tp_step import rank_model, step_failed
    from remat.simulate.precision import get_precision, make_optimizer
    from remat.simulate.sim_setup import make_setup

    # one chunk, one micro-batch, no FSDP: the rank runs the simulated step itself
    whole_step = stages == 1 and microbatches == 1 and dp == 1
    kind = strategy.partition(":")[0]
    cut = not (exact or whole_step or kind in ("every", "sqrt"))
    blocks: list[str] = []

    def prepare(inner: nn.Module) -> AbstractContextManager[None]:
        blocks.extend(n for n, _ in named_blocks(inner, None, api=API))
        return cut_stack(inner, CUT_DEPTH) if cut else nullcontext()

    with rank_model(model, seq_len=seq_len, tp=tp, sequence_parallel=sequence_parallel,
                    dtype=dtype, api=API, prepare=prepare, tp_plan=tp_plan) as (inner, all_dtensor):
        setup = make_setup(inner, precision=get_precision(dtype), optimizer=optimizer,
                           device=get_device("h100-80gb"), world_size=1, sharding="none",
                           blocks=None, loss_fn=None, batch_fn=None)
        if tp > 1:  # foreach kernels refuse lists mixing DTensors and plain tensors
            trainable = [p for p in dict.fromkeys(inner.parameters()) if p.requires_grad]
            setup = dataclasses.replace(setup, optimizer=make_optimizer(
                optimizer, trainable, foreach=all_dtensor))
        depth = len(named_blocks(inner, None, api=API))
        try:
            record = record_step(setup, strategy, batch_size, seq_len, blocks[:depth], device)
        except RuntimeError as error:
            if tp == 1:
                raise
            raise step_failed(error, inner, tp=tp, sequence_parallel=sequence_parallel,
                              api=API) from error
    if depth < len(blocks):
        record = expand_record(record, blocks, depth)
    n_chunks = stages * virtual_stages
    ranges = chunk_blocks(len(blocks), n_chunks)
    chunk_of = _unit_chunk(inner, blocks, ranges)
    chunks = [_Chunk() for _ in range(n_chunks)]
    for unit, nbytes in record.saved.items():
        chunks[chunk_of(unit)].saved += nbytes
    chunks[-1].saved += record.rest  # what no unit holds (the loss's)
    for c, chunk in enumerate(chunks):
        chunk.work = max((v for k, v in record.work.items() if chunk_of(k) == c), default=0)
        chunk.recompute_ms = sum(v for k, v in record.recompute_ms.items()
                                 if chunk_of(k) == c)

    block_index = {name: i for i, name in enumerate(blocks)}
    counted: set[tuple[int, int]] = set()  # (chunk, parameter): tied ones once per chunk
    for name, module in inner.named_modules():
        c = chunk_of(name)
        for p_name, p in module.named_parameters(recurse=False):
            if (c, id(p)) in counted:
                continue
            counted.add((c, id(p)))
            key = _join(name, p_name)
            param_bytes, grad_bytes = record.params[key]
            chunks[c].params += param_bytes
            if p.requires_grad:
                moments, scalars = record.state.get(key, (0, 0))
                chunks[c].grads += grad_bytes
                chunks[c].state += moments + scalars
                chunks[c].scalars += scalars
        if name in block_index:
            own = [(_join(name, n), p.requires_grad)
                   for n, p in module.named_parameters(remove_duplicate=False)]
            chunks[c].blocks.append((sum(record.params[k][0] for k, _ in own),
                                     sum(record.params[k][1] for k, grad in own if grad)))

    actions = schedule_actions(schedule, stages=stages, microbatches=microbatches,
                               virtual_stages=virtual_stages)
    counts = held_microbatches(schedule, stages=stages, microbatches=microbatches,
                               virtual_stages=virtual_stages)
    out = []
    for rank, rank_actions in enumerate(actions):
        mine = [c for c in range(n_chunks) if c % stages == rank]
        figures = {c: FsdpChunk.of(chunks[c]) for c in mine}
        if dp > 1 and stages > 1:  # NOTE [ FSDP under pipeline parallelism ]
            fsdp = fsdp_rank_bytes(rank_actions, figures, dp=dp,
                                   reshard_after_forward=reshard_after_forward)
        else:
            fsdp = plain_rank_bytes(rank_actions, figures, dp=dp)
        peak = record.peak if whole_step else fsdp.peak_bytes
        out.append(StageBytes(
            rank=rank, blocks=tuple(i for c in mine for i in ranges[c]),
            held_microbatches=counts[rank], param_bytes=fsdp.param_bytes,
            grad_bytes=fsdp.grad_bytes, optimizer_bytes=fsdp.optimizer_bytes,
            activation_bytes=sum(chunks[c].saved for c in mine), peak_bytes=peak,
            recompute_ms=sum(chunks[c].recompute_ms for c in mine),
            gathered_param_bytes=fsdp.gathered_param_bytes))
    return tuple(out)

