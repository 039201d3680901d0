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
a few GiB. ``remat.profile`` on CUDA reports ``cuda_peak_bytes`` next to the
tracker's ``peak_bytes`` to measure items 1-3 on a real device.

NOTE [ Step time ]
The predicted step time is the roofline sum over the recorded ops
(:func:`remat.measure.roofline_ms`): forward, backward, recomputation and the
optimizer step. With FSDP the optimizer runs on a 1/world_size shard, so its part
is divided by ``world_size``; communication is not modelled (it overlaps with
compute in a well-tuned run), nor are kernel-launch gaps, so the time is a lower
bound and throughputs are upper bounds. ``samples_per_s`` and ``tokens_per_s``
count all ranks.

NOTE [ Peaks under sharding ]
Per-rank peaks come from :func:`remat.simulate.sharding.shard_peak` applied to
the breakdown of live bytes at the simulated peak. A one-device peak in the
optimizer step (AdamW's foreach temporaries) shrinks under FSDP while the
activation peak does not, so when the one-device peak is in the optimizer phase a
second simulation without the optimizer gives the forward/backward peak's
breakdown (plus the constant optimizer state), and the rank's peak is the larger
of the two, sharded.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from remat.devices import DeviceSpec, get_device
from remat.simulate.hf import is_hf_model, unpacked_sequences
from remat.simulate.precision import Precision, get_precision, make_optimizer
from remat.simulate.sharding import SHARDINGS, ShardedPeak, shard_peak

__all__ = [
    "DEFAULT_STRATEGIES",
    "SimulationResult",
    "SimulationRow",
    "default_batch",
    "simulate",
]

_API = "remat.simulate"

#: Strategies simulated by default. ``offload`` is left out: in a simulation every
#: tensor is a (fake) CPU tensor, so there is no separate host memory to offload to.
DEFAULT_STRATEGIES: tuple[str, ...] = ("none", "full", "every:2", "sqrt", "attn", "mlp", "ops")

ModelSource = nn.Module | Callable[[], nn.Module] | str
BatchFn = Callable[[int, int], Any]
LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class SimulationRow:
    """One strategy at one micro-batch size, simulated.

    Args:
        strategy: the strategy (``"plan"`` for the planner's plan).
        batch_size: sequences per micro-batch per rank.
        seq_len: tokens per sequence.
        peak_bytes: peak live tensor bytes on one rank (after sharding arithmetic).
        fits: ``peak_bytes <= device memory``.
        step_ms: predicted step time, ms (see NOTE [ Step time ]).
        samples_per_s: sequences per second over all ranks.
        tokens_per_s: tokens per second over all ranks.
        single_device_peak_bytes: the simulated one-device peak (before sharding).
        activation_bytes: bytes saved by forward for backward (per rank).
        param_bytes, grad_bytes, optimizer_bytes: per rank, resident (sharded for FSDP).
        flops: forward + backward + recompute FLOPs of one rank's step.
        recompute_flops: FLOPs spent recomputing (0 for op-level checkpointing that
            recomputes only pointwise ops: they cost bandwidth, not FLOPs).
        recompute_ms: roofline time of the recomputation, part of ``step_ms``.
        peak_phase: phase of the one-device peak (``"forward"``, ``"backward"``,
            ``"recompute"`` or ``"optimizer"``).
        note: why a row is missing figures (e.g. the planner found no plan), else ``""``.
    """

    strategy: str
    batch_size: int
    seq_len: int
    peak_bytes: int
    fits: bool
    step_ms: float
    samples_per_s: float
    tokens_per_s: float
    single_device_peak_bytes: int
    activation_bytes: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    flops: int
    recompute_flops: int
    recompute_ms: float = 0.0
    peak_phase: str | None = None
    note: str = ""

    def __post_init__(self) -> None:
        for key in ("batch_size", "seq_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"SimulationRow: {key} must be >= 1, got {getattr(self, key)}")
        for key in ("peak_bytes", "single_device_peak_bytes", "activation_bytes",
                    "param_bytes", "grad_bytes", "optimizer_bytes", "flops",
                    "recompute_flops"):
            if getattr(self, key) < 0:
                raise ValueError(f"SimulationRow: {key} must be >= 0, got {getattr(self, key)}")
        for key in ("step_ms", "samples_per_s", "tokens_per_s", "recompute_ms"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"SimulationRow: {key} must be >= 0, got {getattr(self, key)}")


@dataclass(frozen=True)
class SimulationResult:
    """Every simulated strategy and batch size for one model, precision and device.

    Args:
        model: model name (preset, Hugging Face class, or module class).
        n_params: parameter count (tied weights once).
        seq_len: tokens per sequence.
        precision: ``"bf16"``, ``"amp-bf16"``, ``"fp32"`` or ``"amp-fp16"``.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"`` or ``"none"``.
        device: the device's name.
        device_memory_bytes: its memory.
        world_size: data-parallel ranks.
        sharding: ``"none"``, ``"fsdp"`` or ``"ddp"``.
        batch_sizes: micro-batch sizes simulated, ascending.
        strategies: strategies simulated, in order (``"plan"`` last when planned).
        rows: one row per strategy and batch size, strategies in order, batches ascending.
        elapsed_s: wall time of the simulation, seconds.

    Example:
        >>> result = simulate("llama-tiny", seq_len=32, batch_sizes=[1, 2],
        ...                   strategies=["none", "full"], device="l4")  # doctest: +SKIP
        >>> result.largest_batch("full")  # doctest: +SKIP
        2
    """

    model: str
    n_params: int
    seq_len: int
    precision: str
    optimizer: str
    device: str
    device_memory_bytes: int
    world_size: int
    sharding: str
    batch_sizes: tuple[int, ...]
    strategies: tuple[str, ...]
    rows: tuple[SimulationRow, ...]
    elapsed_s: float = field(default=0.0, compare=False)

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ValueError(f"SimulationResult: sharding must be one of {SHARDINGS}, "
                             f"got {self.sharding!r}")
        unknown = sorted({r.strategy for r in self.rows} - set(self.strategies))
        if unknown:
            raise ValueError(f"SimulationResult: rows name strategies {unknown} that are not "
                             f"in strategies={self.strategies}")

    def rows_for(self, strategy: str) -> tuple[SimulationRow, ...]:
        """The rows of one strategy, batch sizes ascending."""
        if strategy not in self.strategies:
            raise KeyError(f"SimulationResult: no strategy {strategy!r}; simulated: "
                           f"{', '.join(self.strategies)}")
        return tuple(sorted((r for r in self.rows if r.strategy == strategy),
                            key=lambda r: r.batch_size))

    def row(self, strategy: str, batch_size: int) -> SimulationRow:
        """The row of one strategy and batch size (KeyError if not simulated)."""
        for r in self.rows_for(strategy):
            if r.batch_size == batch_size:
                return r
        raise KeyError(f"SimulationResult: batch size {batch_size} was not simulated for "
                       f"{strategy!r}; batch sizes: {list(self.batch_sizes)}")

    def largest_batch(self, strategy: str) -> int | None:
        """The largest simulated batch size whose peak fits the device, or ``None``.

        Peaks grow with the batch size, so this is also where the fitting range ends:
        a larger untested size between two tested ones may fit too.
        """
        fitting = [r.batch_size for r in self.rows_for(strategy) if r.fits]
        return max(fitting) if fitting else None

    @property
    def largest_batches(self) -> dict[str, int | None]:
        """:meth:`largest_batch` for every strategy."""
        return {s: self.largest_batch(s) for s in self.strategies}

    def best(self) -> SimulationRow | None:
        """The fitting row with the highest throughput (ties: less memory), or ``None``."""
        fitting = [r for r in self.rows if r.fits]
        if not fitting:
            return None
        return max(fitting, key=lambda r: (r.tokens_per_s, -r.peak_bytes))

    def to_dict(self) -> dict[str, Any]:
        """Every figure as JSON-ready data, with the largest batch per strategy and the best row."""
        best = self.best()
        return {
            **{k: v for k, v in asdict(self).items() if k != "rows"},
            "batch_sizes": list(self.batch_sizes),
            "strategies": list(self.strategies),
            "rows": [asdict(r) for r in self.rows],
            "largest_batch": self.largest_batches,
            "best": asdict(best) if best is not None else None,
        }

    def to_json(self, **kwargs: Any) -> str:
        """:meth:`to_dict` as a JSON string (``kwargs`` go to :func:`json.dumps`)."""
        kwargs.setdefault("indent", 2)
        return json.dumps(self.to_dict(), **kwargs)


# ---- model, batch, precision --------------------------------------------------------------

class _Autocast(nn.Module):
    """Runs the wrapped model's forward (and loss) under ``torch.autocast``."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.model = model
        self.dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        device_type = next(self.model.parameters()).device.type
        with torch.autocast(device_type, dtype=self.dtype):
            return self.model(*args, **kwargs)


def _preset_factory(name: str, seq_len: int) -> tuple[Callable[[], nn.Module], str]:
    from remat.models import PRESETS, build_model

    if name not in PRESETS:
        raise ValueError(f"{_API}: unknown preset {name!r}; presets: {', '.join(PRESETS)}. "
                         "Pass a module or a factory for other models.")
    overrides: dict[str, Any] = {}
    if seq_len > PRESETS[name].max_seq_len:
        overrides["max_seq_len"] = seq_len
    return (lambda: build_model(name, **overrides)), name


def _build_model(source: ModelSource, seq_len: int) -> tuple[nn.Module, str]:
    if isinstance(source, str):
        factory, name = _preset_factory(source, seq_len)
    elif isinstance(source, nn.Module):
        return source, type(source).__name__
    elif callable(source):
        factory, name = source, ""
    else:
        raise TypeError(f"{_API}: model must be an nn.Module, a factory returning one, or a "
                        f"preset name, got {type(source).__name__}")
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"{_API}: the model factory returned {type(model).__name__}, "
                        "not an nn.Module")
    return model, name or type(model).__name__


def default_batch(model: nn.Module, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Random ``input_ids``/``labels`` for a built-in or Hugging Face causal LM.

    Raises:
        ValueError: the model has no ``config.vocab_size``; pass ``batch_fn``.
    """
    from remat.models import GPTConfig, LlamaConfig, make_batch

    config = getattr(model, "config", None)
    if isinstance(config, (GPTConfig, LlamaConfig)):
        return make_batch(config, batch_size, seq_len, device="cpu")
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        raise ValueError(
            f"{_API}: cannot make a batch for {type(model).__name__} (no config.vocab_size). "
            "Pass batch_fn=lambda batch_size, seq_len: {...} returning the model's inputs."
        )
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=generator)  # (B, T)
    return {"input_ids": ids, "labels": ids.clone()}


@dataclass(frozen=True)
class _Layout:
    """Parameter bytes of the largest block and of the root (outside every block)."""

    block_param_bytes: int
    block_grad_bytes: int
    root_param_bytes: int
    root_grad_bytes: int


def _nbytes(params: Iterable[nn.Parameter], *, trainable: bool) -> int:
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad or not trainable)


def _layout(model: nn.Module, blocks: Any) -> _Layout:
    from remat.blocks import named_blocks
    from remat.errors import BlocksNotFound

    try:
        named = named_blocks(model, blocks, api=_API)
    except BlocksNotFound:
        named = []
    in_block: set[int] = set()
    largest = (0, 0)
    for _, block in named:
        params = list(block.parameters())
        in_block.update(id(p) for p in params)
        largest = max(largest, (_nbytes(params, trainable=False),
                                _nbytes(params, trainable=True)))
    root = [p for p in dict.fromkeys(model.parameters()) if id(p) not in in_block]
    return _Layout(largest[0], largest[1], _nbytes(root, trainable=False),
                   _nbytes(root, trainable=True))


# ---- one simulated point -------------------------------------------------------------------

@dataclass(frozen=True)
class _Setup:
    model: nn.Module          # what is profiled (maybe wrapped for autocast)
    inner: nn.Module          # what strategies are applied to
    optimizer: torch.optim.Optimizer | None
    precision: Precision
    device: DeviceSpec
    world_size: int
    sharding: str
    layout: _Layout
    blocks: Any
    loss_fn: LossFn | None
    batch_fn: BatchFn


def _shard(breakdown: Mapping[str, int], grad_total_bytes: int, setup: _Setup) -> ShardedPeak:
    """Shard one moment's live bytes; see NOTE [ Sharding arithmetic ] in sharding.py."""
    layout = setup.layout
    return shard_peak(
        peak_bytes=sum(breakdown.values()),
        param_bytes=breakdown.get("params", 0),
        grad_bytes=breakdown.get("grads", 0),
        optimizer_bytes=breakdown.get("optimizer_state", 0),
        optimizer_temp_bytes=breakdown.get("optimizer", 0),
        total_grad_bytes=grad_total_bytes,
        sharding=setup.sharding,
        world_size=setup.world_size,
        block_param_bytes=layout.block_param_bytes,
        block_grad_bytes=layout.block_grad_bytes,
        root_param_bytes=layout.root_param_bytes,
        root_grad_bytes=layout.root_grad_bytes,
    )


def _profile(setup: _Setup, batch: Any, optimizer: torch.optim.Optimizer | None) -> Any:
    from remat.measure import profile

    return profile(setup.model, batch, loss_fn=setup.loss_fn, optimizer=optimizer,
                   simulate=True, blocks=setup.blocks)


def _point(setup: _Setup, strategy: str, batch_size: int, seq_len: int) -> SimulationRow:
    from remat.measure import roofline_ms

    batch = setup.batch_fn(batch_size, seq_len)
    prof = _profile(setup, batch, setup.optimizer)
    single_peak = int(prof.peak_bytes)
    world = setup.world_size
    if setup.sharding == "none":
        peak = single_peak  # exact, no arithmetic
    else:
        moments = [dict(prof.peak_breakdown)]
        if setup.sharding == "fsdp" and setup.optimizer is not None \
                and prof.peak_phase == "optimizer":
            # See NOTE [ Peaks under sharding ]: the forward/backward peak, with the
            # optimizer state (constant outside the optimizer step) added back.
            fwd_bwd = _profile(setup, batch, None)
            moments.append({**fwd_bwd.peak_breakdown,
                            "optimizer_state": int(prof.optimizer_bytes)})
        peak = max(_shard(m, int(prof.grad_bytes), setup).peak_bytes for m in moments)
    compute_ms = roofline_ms(prof.ops, setup.device, phases=("forward", "backward", "recompute"))
    optimizer_ms = roofline_ms(prof.ops, setup.device, phases=("optimizer",))
    if setup.sharding == "fsdp":
        optimizer_ms /= world  # NOTE [ Step time ]
    step_ms = compute_ms + optimizer_ms
    samples_per_s = batch_size * world / (step_ms / 1e3) if step_ms > 0 else 0.0

    def per_rank(nbytes: int) -> int:
        return -(-nbytes // world) if setup.sharding == "fsdp" else nbytes

    return SimulationRow(
        strategy=strategy,
        batch_size=batch_size,
        seq_len=seq_len,
        peak_bytes=peak,
        fits=peak <= setup.device.memory_bytes,
        step_ms=step_ms,
        samples_per_s=samples_per_s,
        tokens_per_s=samples_per_s * seq_len,
        single_device_peak_bytes=single_peak,
        activation_bytes=int(prof.activation_bytes),
        param_bytes=per_rank(int(prof.param_bytes)),
        grad_bytes=per_rank(int(prof.grad_bytes)),
        optimizer_bytes=per_rank(int(prof.optimizer_bytes)),
        flops=int(prof.flops),
        recompute_flops=int(prof.recompute_flops),
        recompute_ms=float(roofline_ms(prof.ops, setup.device, phases=("recompute",))),
        peak_phase=prof.peak_phase,
    )


# ---- the planner hook ----------------------------------------------------------------------
# NOTE [ Planner hook ]
# ``plan=True`` adds rows labelled "plan": for each batch size, remat.plan(...,
# simulate=True) picks per-block decisions for the device budget, the plan is applied
# and simulated like a strategy. A batch size no plan fits gets a row with the smallest
# reachable peak and no times. The planner is imported lazily (it imports this
# package's device table).

def _single_device_budget(setup: _Setup, fixed: tuple[int, int, int]) -> int:
    """The one-device peak whose sharded peak is the device memory (inverse of _shard)."""
    memory = setup.device.memory_bytes
    params, grads, states = fixed
    if setup.sharding == "ddp":
        return max(memory - grads, 0)
    if setup.sharding == "fsdp":
        w = setup.world_size
        layout = setup.layout
        sharded = -(-params // w) + -(-grads // w) + -(-states // w)
        unsharded = (layout.block_param_bytes + layout.block_grad_bytes
                     + layout.root_param_bytes + layout.root_grad_bytes)
        return max(memory + params + grads + states - sharded - unsharded, 0)
    return memory


def _plan_rows(setup: _Setup, batch_sizes: Sequence[int], seq_len: int,
               fixed: tuple[int, int, int],
               on_row: Callable[[SimulationRow], None] | None) -> list[SimulationRow]:
    from remat.errors import BudgetTooSmall
    from remat.planning.planner import plan as planner
    from remat.strategies import apply

    budget = _single_device_budget(setup, fixed)
    kwargs = {"budget": budget, "optimizer": setup.optimizer, "loss_fn": setup.loss_fn,
              "blocks": setup.blocks, "simulate": True, "device": setup.device}
    rows: list[SimulationRow] = []
    for batch_size in batch_sizes:
        batch = setup.batch_fn(batch_size, seq_len)
        try:
            chosen = planner(setup.model, batch, **kwargs)
        except BudgetTooSmall as exc:
            row = SimulationRow(
                strategy="plan", batch_size=batch_size, seq_len=seq_len,
                peak_bytes=int(exc.min_peak_bytes), fits=False, step_ms=0.0,
                samples_per_s=0.0, tokens_per_s=0.0,
                single_device_peak_bytes=int(exc.min_peak_bytes), activation_bytes=0,
                param_bytes=fixed[0], grad_bytes=fixed[1], optimizer_bytes=fixed[2], flops=0,
                recompute_flops=0, note="no plan fits the budget",
            )
        else:
            apply(setup.model, chosen, blocks=setup.blocks)
            row = _point(setup, "plan", batch_size, seq_len)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


# ---- the public entry point ---------------------------------------------------------------

def _adapt_blocks(blocks: Any, wrapped: bool) -> Any:
    if not wrapped or blocks is None or isinstance(blocks, type) \
            or isinstance(blocks, (list, tuple)):
        return blocks
    user = blocks
    return lambda name, module: user(name.removeprefix("model."), module)


def _check_ints(api: str, name: str, values: Iterable[Any]) -> tuple[int, ...]:
    out = tuple(values)
    if not out or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in out):
        raise ValueError(f"{api}: {name} must be a non-empty list of positive ints, got "
                         f"{list(out)}")
    return tuple(sorted(set(out)))


def simulate(
    model: ModelSource,
    *,
    seq_len: int,
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32),
    dtype: str | Precision = "bf16",
    optimizer: str = "adamw",
    device: str | DeviceSpec = "h100-80gb",
    strategies: Sequence[str] = DEFAULT_STRATEGIES,
    world_size: int = 1,
    sharding: str = "none",
    plan: bool = False,
    blocks: Any = None,
    loss_fn: LossFn | None = None,
    batch_fn: BatchFn | None = None,
    on_row: Callable[[SimulationRow], None] | None = None,
) -> SimulationResult:
    """Simulate training steps of every strategy and batch size on a device you don't have.

    The model is built on the meta device and each step runs under FakeTensorMode:
    exact bytes (the same as a real run on the same device type), no memory
    allocated, seconds per step even at 7B. The price of exactness is one simulated
    step per strategy and batch size; the step time is a roofline estimate, not a
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
        strategies: strategy names. Default: :data:`DEFAULT_STRATEGIES`.
        world_size: data-parallel ranks. Default: ``1``.
        sharding: ``"none"``, ``"fsdp"`` (FSDP / ZeRO-3) or ``"ddp"``. Default: ``"none"``.
        plan: also simulate the planner's plan per batch size (see NOTE [ Planner hook ]).
            Default: ``False``.
        blocks: which modules are blocks (as for :func:`remat.apply`). Default: detected.
        loss_fn: ``loss_fn(output, batch) -> scalar``. Default: ``output.loss``.
        batch_fn: ``batch_fn(batch_size, seq_len) -> batch``. Default: random token ids
            and labels from ``model.config.vocab_size``.
        on_row: called with each row as soon as it is simulated (progress bars).

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
    from remat.strategies import apply, parse_strategy, remove

    started = time.perf_counter()
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"{_API}: seq_len must be a positive int, got {seq_len!r}")
    sizes = _check_ints(_API, "batch_sizes", batch_sizes)
    if sharding not in SHARDINGS:
        raise ValueError(f"{_API}: unknown sharding {sharding!r}; use one of "
                         f"{', '.join(SHARDINGS)}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{_API}: world_size must be an int >= 1, got {world_size!r}")
    if sharding == "none" and world_size != 1:
        raise ValueError(f"{_API}: world_size={world_size} needs sharding='fsdp' or 'ddp' "
                         "(data parallelism without sharding is 'ddp')")
    labels = [str(parse_strategy(s)) for s in strategies]
    if len(set(labels)) != len(labels) or not labels and not plan:
        raise ValueError(f"{_API}: strategies must be non-empty and distinct, got "
                         f"{list(strategies)}")
    precision = get_precision(dtype)
    spec = get_device(device)

    inner, name = _build_model(model, seq_len)
    inner.to(precision.param_dtype)
    inner.train()
    wrapped = precision.autocast_dtype is not None
    run_model = _Autocast(inner, precision.autocast_dtype) if wrapped else inner  # type: ignore[arg-type]
    run_blocks = _adapt_blocks(blocks, wrapped)
    trainable = [p for p in dict.fromkeys(inner.parameters()) if p.requires_grad]
    setup = _Setup(
        model=run_model, inner=inner, optimizer=make_optimizer(optimizer, trainable),
        precision=precision, device=spec, world_size=world_size, sharding=sharding,
        layout=_layout(run_model, run_blocks), blocks=run_blocks, loss_fn=loss_fn,
        batch_fn=batch_fn or (lambda b, s: default_batch(inner, b, s)),
    )

    rows: list[SimulationRow] = []
    with ExitStack() as stack:
        if batch_fn is None and is_hf_model(inner):
            stack.enter_context(unpacked_sequences())  # NOTE [ HF masks under FakeTensorMode ]
        stack.callback(remove, run_model)
        for label in labels:
            apply(run_model, label, blocks=run_blocks)
            for batch_size in sizes:
                row = _point(setup, label, batch_size, seq_len)
                rows.append(row)
                if on_row is not None:
                    on_row(row)
        if plan:
            fixed = _fixed_bytes(setup, rows, sizes[0], seq_len)
            rows.extend(_plan_rows(setup, sizes, seq_len, fixed, on_row))
            labels.append("plan")

    return SimulationResult(
        model=name,
        n_params=sum(p.numel() for p in dict.fromkeys(inner.parameters())),
        seq_len=seq_len,
        precision=precision.name,
        optimizer=optimizer.lower(),
        device=spec.name,
        device_memory_bytes=spec.memory_bytes,
        world_size=world_size,
        sharding=sharding,
        batch_sizes=sizes,
        strategies=tuple(labels),
        rows=tuple(rows),
        elapsed_s=time.perf_counter() - started,
    )


def _fixed_bytes(setup: _Setup, rows: Sequence[SimulationRow], batch_size: int,
                 seq_len: int) -> tuple[int, int, int]:
    """One-device parameter, gradient and optimizer bytes (from a row, else one profile)."""
    if rows and setup.sharding != "fsdp":  # rows hold whole (unsharded) figures then
        return rows[0].param_bytes, rows[0].grad_bytes, rows[0].optimizer_bytes
    prof = _profile(setup, setup.batch_fn(batch_size, seq_len), setup.optimizer)
    return int(prof.param_bytes), int(prof.grad_bytes), int(prof.optimizer_bytes)
