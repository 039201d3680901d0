"""What :func:`remat.simulate.simulate` returns: one row per strategy and batch size."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from remat.core.cost import CostViews, StepCost
from remat.distributed.sharding import SHARDINGS
from remat.errors import message, one_line

#: The JSON keys of a row, in order: the simulation JSON keeps the cost fields flat, as
#: before ``SimulationRow.cost``, so files written either way read the same.
_ROW_KEYS = ("strategy", "batch_size", "seq_len", "peak_bytes", "reserved_bytes",
             "margin_bytes", "fits", "step_ms",
             "samples_per_s", "tokens_per_s", "single_device_peak_bytes", "activation_bytes",
             "param_bytes", "grad_bytes", "optimizer_bytes", "flops", "recompute_flops",
             "recompute_ms", "peak_phase", "note")
_COST_KEYS = ("peak_bytes", "step_ms", "activation_bytes", "param_bytes", "grad_bytes",
              "optimizer_bytes", "flops", "recompute_flops", "recompute_ms")


@dataclass(frozen=True)
class SimulationRow(CostViews):
    """One strategy at one micro-batch size, simulated.

    Args:
        strategy: the strategy (``"plan"`` for the planner's plan).
        batch_size: sequences per micro-batch per rank.
        seq_len: tokens per sequence.
        cost: one rank's step as a :class:`~remat.core.cost.StepCost`: ``peak_bytes``
            (peak live tensor bytes on one rank, after sharding arithmetic),
            ``step_ms`` (predicted step time, ms, see NOTE [ Step time ]),
            ``activation_bytes`` (bytes saved by forward for backward),
            ``param_bytes``, ``grad_bytes``, ``optimizer_bytes`` (resident, sharded for
            FSDP), ``flops`` (forward + backward + recompute FLOPs; the split is not
            kept), ``recompute_flops`` (0 for op-level checkpointing that recomputes only
            pointwise ops: they cost bandwidth, not FLOPs) and ``recompute_ms`` (roofline
            time of the recomputation, part of ``step_ms``); ``step_ms`` and
            ``recompute_ms`` are always set. The flat names below are read-only views.
        fits: the rank's step fits its card: ``reserved_bytes <= capacity - outside``
            (NOTE [ Fits on the card ] in card_fit.py).
        samples_per_s: sequences per second over all ranks.
        tokens_per_s: tokens per second over all ranks.
        single_device_peak_bytes: the simulated one-device peak (before sharding).
        peak_phase: phase of the one-device peak (``"forward"``, ``"backward"``,
            ``"recompute"`` or ``"optimizer"``).
        note: why a row is missing figures (e.g. the planner found no plan), or that
            ``expandable_segments:True`` is what makes it fit, else ``""``.
        reserved_bytes: the rank's predicted reserved peak under PyTorch's caching
            allocator, library workspaces included (NOTE [ Reserved per rank ] in
            simulate/point.py). Default: 0 (a row written before it was predicted).
        margin_bytes: capacity less outside memory less ``reserved_bytes``: what is left
            on the card (negative: over). Default: 0.
    """

    strategy: str
    batch_size: int
    seq_len: int
    cost: StepCost
    fits: bool
    samples_per_s: float
    tokens_per_s: float
    single_device_peak_bytes: int
    peak_phase: str | None = None
    note: str = ""
    reserved_bytes: int = 0
    margin_bytes: int = 0

    def __post_init__(self) -> None:
        for key in ("batch_size", "seq_len"):
            if getattr(self, key) < 1:
                raise ValueError(message("SimulationRow", f"{key} must be >= 1",
                                         {"found": getattr(self, key)},
                                         fix=f"pass {key} >= 1"))
        cost = self.cost
        if not isinstance(cost, StepCost) or None in (cost.flops, cost.step_ms,
                                                      cost.recompute_ms):
            raise ValueError(message("SimulationRow",
                                     "cost must be a StepCost with flops, step_ms and recompute_ms",
                                     {"found": repr(cost)},
                                     fix="build it with StepCost(peak_bytes=..., flops=..., "
                                         "step_ms=..., recompute_ms=...)"))
        if self.single_device_peak_bytes < 0:
            raise ValueError(message("SimulationRow", "single_device_peak_bytes must be >= 0",
                                     {"found": self.single_device_peak_bytes},
                                     fix="pass single_device_peak_bytes >= 0"))
        for key in ("samples_per_s", "tokens_per_s"):
            if not getattr(self, key) >= 0:
                raise ValueError(message("SimulationRow", f"{key} must be >= 0",
                                         {"found": getattr(self, key)},
                                         fix=f"pass {key} >= 0"))

    # ---- views of cost (read-only; the figures live in ``cost``) -------------------------

    @property
    def step_ms(self) -> float:
        """``cost.step_ms``: predicted step time, ms."""
        return self.cost.step_ms or 0.0

    @property
    def recompute_ms(self) -> float:
        """``cost.recompute_ms``: roofline time of the recomputation, ms."""
        return self.cost.recompute_ms or 0.0

    def to_dict(self) -> dict[str, Any]:
        """The row as JSON-able data, cost fields flat (the simulation JSON's row format)."""
        return {key: getattr(self, key) for key in _ROW_KEYS}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SimulationRow:
        """Rebuild a row written by :meth:`to_dict`."""
        rest = {k: v for k, v in data.items() if k not in _COST_KEYS}
        cost = {k: data[k] for k in _COST_KEYS if k in data}
        return cls(**rest, cost=StepCost(**cost))


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
        device_memory_bytes: its capacity as PyTorch reports it.
        world_size: data-parallel ranks.
        sharding: ``"none"``, ``"fsdp"`` or ``"ddp"``.
        batch_sizes: micro-batch sizes simulated, ascending.
        strategies: strategies simulated, in order (``"plan"`` last when planned).
        rows: one row per strategy and batch size, strategies in order, batches ascending.
        elapsed_s: wall time of the simulation, seconds.
        outside_bytes: what a rank holds outside PyTorch's allocator (CUDA context, NCCL
            buffers; NOTE [ Fits on the card ] in card_fit.py). Default: 0.
        workspace_bytes: library workspaces a rank allocates through it (cuBLAS,
            cuBLASLt, cuDNN), included in each row's ``reserved_bytes``. Default: 0.
        accumulating: the rows are gradient-accumulation micro-steps, each starting with
            the gradients held (``simulate(accumulating=True)``). Default: ``False``.

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
    outside_bytes: int = 0
    workspace_bytes: int = 0
    accumulating: bool = False

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ValueError(message("SimulationResult", "unknown sharding",
                                     {"found": repr(self.sharding)},
                                     fix=f"pass one of {SHARDINGS}"))
        unknown = sorted({r.strategy for r in self.rows} - set(self.strategies))
        if unknown:
            raise ValueError(message("SimulationResult",
                                     f"rows name strategies {unknown} that are not in strategies",
                                     {"strategies": self.strategies},
                                     fix="list every row's strategy in strategies"))

    def rows_for(self, strategy: str) -> tuple[SimulationRow, ...]:
        """The rows of one strategy, batch sizes ascending."""
        if strategy not in self.strategies:
            raise KeyError(one_line(message("SimulationResult", f"no strategy {strategy!r}",
                                            {"simulated": ", ".join(self.strategies)},
                                            fix="ask for a simulated strategy")))
        return tuple(sorted((r for r in self.rows if r.strategy == strategy),
                            key=lambda r: r.batch_size))

    def row(self, strategy: str, batch_size: int) -> SimulationRow:
        """The row of one strategy and batch size (KeyError if not simulated)."""
        for r in self.rows_for(strategy):
            if r.batch_size == batch_size:
                return r
        raise KeyError(one_line(message(
            "SimulationResult", f"batch size {batch_size} was not simulated for {strategy!r}",
            {"batch sizes": list(self.batch_sizes)}, fix="ask for a simulated batch size")))

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
            "rows": [r.to_dict() for r in self.rows],
            "largest_batch": self.largest_batches,
            "best": best.to_dict() if best is not None else None,
        }

    def to_json(self, **kwargs: Any) -> str:
        """:meth:`to_dict` as a JSON string (``kwargs`` go to :func:`json.dumps`)."""
        kwargs.setdefault("indent", 2)
        return json.dumps(self.to_dict(), **kwargs)
