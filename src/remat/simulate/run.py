"""``simulate``: every strategy at every batch size on hardware you don't have.

Builds the model on the meta device, applies each strategy, runs the real training
step under FakeTensorMode (:func:`remat.measure.profile` with ``simulate=True``) and
turns each profile into a row: the peak per rank, whether it fits the device,
a roofline step time and throughput. A Llama-7B step takes a few seconds on a
laptop CPU and no device memory.

NOTE [ Simulated bytes vs torch.cuda.max_memory_allocated ]
Simulated bytes are exact sums of tensor storage sizes (``nbytes``), the same as a
real run's tracker on the same device type. ``torch.cuda.max_memory_allocated``
reads higher, by:

1. Allocator rounding: the CUDA caching allocator rounds every request up to a
   multiple of 512 bytes (``kMinBlockSize``), so each live tensor at the peak
   costs up to 511 extra bytes (tens of KiB for a whole Llama step: negligible).
   ``max_memory_reserved`` (and ``nvidia-smi``) read higher still: requests up to
   1 MiB are served from 2 MiB segments, larger ones from segments rounded to
   2 MiB (20 MiB for 1-10 MiB requests), and freed blocks that cannot be reused
   for a larger request (fragmentation) stay reserved; on long runs that can be
   several GiB (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` reduces it).
2. Workspaces invisible to a dispatch mode: cuBLAS allocates its workspace through
   the caching allocator (by default 4-32 MiB per handle and stream, depending on
   the GPU; ``CUBLAS_WORKSPACE_CONFIG``), as do cuDNN and some attention kernels.
3. Kernel choice: the simulation runs CPU kernels' shape functions. For fused
   attention the CPU kernel saves the same logsumexp (``(b, heads, s)`` fp32) as
   CUDA's FlashAttention; CUDA's memory-efficient kernel pads it to a multiple of
   32. With attention dropout (``dropout_p > 0``) CPU SDPA falls back to the math
   path and materialises the ``(b, heads, s, s)`` probabilities and dropout mask,
   which CUDA's flash kernel never stores: simulated peaks of models with attention
   dropout (the built-in GPT presets) are then too high for CUDA; set dropout to 0
   (as Llama-style training does) for CUDA-faithful bytes. Autocast uses the CPU op
   lists (see NOTE [ Autocast policy in simulation ] in precision.py).
4. Outside PyTorch: the CUDA context (300-800 MiB, not in either counter but in
   ``nvidia-smi``) and NCCL buffers for distributed runs.

So a plan that simulates at 79 GiB of an 80 GiB card is not safe; keep a margin of
a few GiB. ``remat.profile`` on CUDA reports ``allocator_peak_bytes`` next to the
tracker's ``peak_bytes`` to measure items 1-3 on a real device.

The parts: :mod:`~remat.simulate.sim_setup` (model, batch, precision),
:mod:`~remat.simulate.point` (one simulated step as a row; NOTE [ Step time ] and
NOTE [ Peaks under sharding ]), :mod:`~remat.simulate.planned_rows` (the ``"plan"`` rows;
NOTE [ Planner hook ]) and :mod:`~remat.simulate.result` (the result objects).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any

from remat.device_memory import OutsideMemory, Workspaces
from remat.devices import DeviceSpec, get_device
from remat.distributed.sharding import SHARDINGS
from remat.errors import message
from remat.measure.step import is_accumulating, step_loss
from remat.simulate.fast_rows import FastContext, fast_rows
from remat.simulate.hf import is_hf_model, unpacked_sequences
from remat.simulate.planned_rows import plan_rows
from remat.simulate.point import points, static_parts
from remat.simulate.precision import Precision, get_precision
from remat.simulate.result import SimulationResult, SimulationRow
from remat.simulate.sim_setup import (
    API,
    BatchFn,
    LossFn,
    ModelSource,
    Setup,
    build_model,
    check_ints,
    make_setup,
)


def __getattr__(name: str) -> Any:
    # DEFAULT_STRATEGIES is kept for compatibility, read live from the registry (a
    # strategy registered later appears in it); prefer default_strategies("simulate").
    if name == "DEFAULT_STRATEGIES":
        from remat.strategies.registry import default_strategies

        return tuple(default_strategies("simulate"))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def simulate(
    model: ModelSource,
    *,
    seq_len: int,
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32),
    dtype: str | Precision = "bf16",
    optimizer: str = "adamw",
    device: str | DeviceSpec = "h100-80gb",
    strategies: Sequence[str] | None = None,
    world_size: int = 1,
    sharding: str = "none",
    plan: bool = False,
    blocks: Any = None,
    loss_fn: LossFn | None = None,
    batch_fn: BatchFn | None = None,
    on_row: Callable[[SimulationRow], None] | None = None,
    exact: bool = False,
    outside: OutsideMemory | None = None,
    workspaces: Workspaces | None = None,
    fits_on: str = "reserved",
    accumulating: bool = False,
) -> SimulationResult:
    """Simulate training steps of every strategy and batch size on a device you don't have.

    The model is built on the meta device and each step runs under FakeTensorMode:
    exact bytes (the same as a real run on the same device type), no memory
    allocated, seconds per step even at 7B. By default a uniform stack of blocks is
    cut to two and three blocks and each figure extrapolated to the model's depth
    and across batch sizes (NOTE [ Fast rows ] in fast_rows.py): a few shallow steps per
    strategy instead of a full step per row; ``exact=True`` runs the full step for
    every row. The step time is a roofline estimate, not a
    measurement (see NOTE [ Step time ]). Sharded runs are arithmetic on the
    one-device simulation (see NOTE [ Peaks under sharding ]).

    Warning:
        A module passed in is modified in place: converted to the precision's
        parameter dtype and left without a strategy. Pass a factory or a preset name
        to keep your model as it is.

    Args:
        model: a preset name (``"llama-7b"``), a factory ``() -> nn.Module`` (called
            under ``torch.device("meta")``), or a module (ideally on the meta device).
        seq_len: tokens per sequence.
        batch_sizes: micro-batch sizes per rank. Default: ``(1, 2, 4, 8, 16, 32)``.
        dtype: training precision, see :data:`remat.simulate.precision.PRECISIONS`.
            Default: ``"bf16"`` (pure bf16).
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"`` or ``"none"``. Default: ``"adamw"``.
        device: a name from :data:`remat.devices.DEVICES` or a
            :class:`DeviceSpec`. Default: ``"h100-80gb"``.
        strategies: strategy names. Default: ``default_strategies("simulate")`` from the
            registry (:func:`remat.strategies.default_strategies`), read at call time:
            every registered strategy but ``offload`` (in a simulation every tensor is a
            fake CPU tensor, so there is no separate host memory to offload to).
        world_size: data-parallel ranks. Default: ``1``.
        sharding: ``"none"``, ``"fsdp"`` (FSDP / ZeRO-3) or ``"ddp"``. Default: ``"none"``.
        plan: also simulate the planner's plan per batch size (see NOTE [ Planner hook ]).
            Default: ``False``.
        blocks: which modules are blocks (as for :func:`remat.apply`). Default: detected.
        loss_fn: ``loss_fn(output, batch) -> scalar``. Default: ``output.loss``.
        batch_fn: ``batch_fn(batch_size, seq_len) -> batch``. Default: random token ids
            and labels from ``model.config.vocab_size``.
        on_row: called with each row as soon as it is simulated (progress bars).
        exact: simulate the whole model's step for every row instead of extrapolating
            from shallow steps (NOTE [ Fast rows ]), and run the whole planner and its
            closed loop for every plan row instead of composing it from shallow steps
            (NOTE [ Fast plan rows ] in plan_fast.py). Default: ``False``.
        outside: what a rank holds outside PyTorch's allocator, measured on your job
            (CUDA context, NCCL buffers); each field set replaces its estimate (NOTE
            [ Fits on the card ] in card_fit.py). Default: the estimates.
        workspaces: the library workspaces a rank allocates through the allocator;
            each field set replaces its estimate. Default: the estimates.
        fits_on: ``"reserved"``: a row fits when its predicted reserved peak (PyTorch's
            caching allocator) with the workspaces is within the card's capacity less
            the outside memory; ``"allocated"``: its allocated peak is (an allocator
            that reserves what it allocates, such as ``backend:cudaMallocAsync``).
            Default: ``"reserved"``.
        accumulating: simulate a gradient-accumulation micro-step after the first (the
            gradients of the micro-steps before it held from its start, the optimizer
            stepping at its end: the highest micro-step), as a job that calls
            ``optimizer.step()`` every few micro-batches, or zeroes gradients in place,
            runs; its peak is up to the gradients' bytes above a plain step's. Not with
            ``sharding="fsdp"``: what an FSDP rank holds between micro-steps depends on
            whether each one reduces its gradients. Default: ``False``.

    Returns:
        A :class:`SimulationResult`.

    Raises:
        ValueError: bad sizes, unknown precision, optimizer, device, sharding or strategy.

    Example:
        >>> result = simulate("llama-7b", seq_len=2048, batch_sizes=[1, 2, 4],
        ...                   strategies=["none", "full"], device="h100-80gb")  # doctest: +SKIP
        >>> result.largest_batch("none"), result.largest_batch("full")  # doctest: +SKIP
        (2, 4)
    """
    started = time.perf_counter()
    sizes, labels = _check_arguments(seq_len, batch_sizes, world_size, sharding, strategies,
                                     plan)
    loss_fn = _step_loss(loss_fn, accumulating, sharding)
    precision = get_precision(dtype)
    spec = get_device(device)
    inner, name = build_model(model, seq_len)
    setup = make_setup(inner, precision=precision, optimizer=optimizer, device=spec,
                       world_size=world_size, sharding=sharding, blocks=blocks,
                       loss_fn=loss_fn, batch_fn=batch_fn, outside=outside,
                       workspaces=workspaces, fits_on=fits_on)
    rows = _run(setup, labels, sizes, seq_len, plan=plan, hf_masks=batch_fn is None,
                on_row=on_row, exact=exact)
    return SimulationResult(
        model=name,
        n_params=sum(p.numel() for p in dict.fromkeys(inner.parameters())),
        seq_len=seq_len,
        precision=precision.name,
        optimizer=optimizer.lower(),
        device=spec.name,
        device_memory_bytes=spec.capacity_bytes,
        world_size=world_size,
        sharding=sharding,
        batch_sizes=sizes,
        strategies=tuple(labels) + (("plan",) if plan else ()),
        rows=tuple(rows),
        elapsed_s=time.perf_counter() - started,
        outside_bytes=setup.card.outside_bytes,
        workspace_bytes=setup.card.workspace_bytes,
        accumulating=is_accumulating(loss_fn),  # accumulating=True, or an Accumulating loss
    )


def _step_loss(loss_fn: LossFn | None, accumulating: bool, sharding: str) -> LossFn | None:
    """``loss_fn`` as the simulated step runs it (:func:`~remat.measure.step.step_loss`),
    after refusing an accumulating FSDP rank (``accumulating=True`` or an accumulating
    loss)."""
    loss = step_loss(loss_fn, accumulating=accumulating, api=API)
    if is_accumulating(loss) and sharding == "fsdp":
        raise ValueError(message(
            API, "accumulating=True cannot be simulated with sharding='fsdp'",
            {"why": "an FSDP rank holds its gradients' shard between micro-steps that "
                    "reduce them, and whole gradients between micro-steps that do not "
                    "(set_requires_gradient_sync(False)); the simulation knows neither"},
            fix="simulate with sharding='ddp' for whole gradients held, or plan your FSDP "
                "rank with remat.plan(..., accumulating=True) under torchrun"))
    return loss


def _check_arguments(seq_len: int, batch_sizes: Sequence[int], world_size: int, sharding: str,
                     strategies: Sequence[str] | None,
                     plan: bool) -> tuple[tuple[int, ...], list[str]]:
    """The batch sizes (sorted, distinct) and strategy labels, after checking every argument."""
    from remat.strategies import parse_strategy
    from remat.strategies.registry import default_strategies

    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(message(API, "seq_len must be a positive int", {"found": repr(seq_len)},
                                 fix="pass seq_len as an int >= 1"))
    sizes = check_ints(API, "batch_sizes", batch_sizes)
    if sharding not in SHARDINGS:
        raise ValueError(message(API, f"unknown sharding {sharding!r}",
                                 fix=f"use one of {', '.join(SHARDINGS)}"))
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(message(API, "world_size must be an int >= 1",
                                 {"found": repr(world_size)}, fix="pass world_size >= 1"))
    if sharding == "none" and world_size != 1:
        raise ValueError(message(API, f"world_size={world_size} needs sharding",
                                 fix="pass sharding='fsdp' or 'ddp' (data parallelism without "
                                     "sharding is 'ddp')"))
    if strategies is None:
        strategies = default_strategies("simulate")
    labels = [str(parse_strategy(s, api=API)) for s in strategies]
    if len(set(labels)) != len(labels) or not labels and not plan:
        raise ValueError(message(API, "strategies must be non-empty and distinct",
                                 {"found": list(strategies)},
                                 fix="list each strategy once"))
    return sizes, labels


#: A fast row whose margin on the card is within this share of the card's limit is
#: simulated exactly (NOTE [ Reserved per rank ] in point.py).
_CONFIRM_SHARE = 0.05


def _confirmed(setup: Setup, row: SimulationRow | None) -> SimulationRow | None:
    """A fast row, or None where its fit is too close to call from the shallow steps'
    reserved estimate: the exact path replays its whole step."""
    if row is None or abs(row.margin_bytes) > _CONFIRM_SHARE * setup.card.limit_bytes:
        return row
    return None


def _run(setup: Setup, labels: Sequence[str], sizes: Sequence[int], seq_len: int, *,
         plan: bool, hf_masks: bool, on_row: Callable[[SimulationRow], None] | None,
         exact: bool) -> list[SimulationRow]:
    """Every strategy's rows, then the plan's; the model is left without a strategy."""
    from remat.strategies import apply, remove
    from remat.strategies.offload import simulated_host

    rows: list[SimulationRow] = []
    with ExitStack() as stack:
        if hf_masks and is_hf_model(setup.inner):
            stack.enter_context(unpacked_sequences())  # NOTE [ HF masks under FakeTensorMode ]
        stack.enter_context(simulated_host())  # a GPU's host: NOTE [ Simulated host ]
        stack.callback(remove, setup.model)
        fast = None if exact else FastContext(setup, labels)
        for label in labels:
            fast_done = fast_rows(fast, label, sizes, seq_len) if fast is not None else None
            done: list[SimulationRow | None] = (
                [_confirmed(setup, r) for r in fast_done] if fast_done is not None
                else [None] * len(sizes))
            missing = [b for b, row in zip(sizes, done, strict=True) if row is None]
            exact_rows: Iterator[SimulationRow] = iter(())
            if missing:  # the exact path, for the rows the fast one could not give
                apply(setup.model, label, blocks=setup.blocks)
                exact_rows = points(setup, label, missing, seq_len)  # simulated as read
            for fast_row in done:
                row = fast_row if fast_row is not None else next(exact_rows)
                rows.append(row)
                if on_row is not None:
                    on_row(row)
        if plan:
            static = static_parts(setup, rows, sizes[0], seq_len)
            rows.extend(plan_rows(setup, sizes, seq_len, static, on_row, rows, fast=fast))
    return rows
