"""Plan for hardware you don't have: fake-tensor simulation, device specs, analytic formulas.

Example::

    >>> from remat.simulate import simulate
    >>> result = simulate("llama-7b", seq_len=2048, batch_sizes=[1, 2, 4, 8],
    ...                   strategies=["none", "full"], device="h100-80gb")  # doctest: +SKIP
    >>> result.largest_batch("full")  # doctest: +SKIP

Modules: :mod:`~remat.simulate.run` (``simulate``) and
:mod:`~remat.simulate.result` (its rows), :mod:`~remat.simulate.estimate`
and :mod:`~remat.simulate.formulas` (closed-form activation memory),
:mod:`~remat.simulate.precision` (bf16 / AMP / fp32 and optimizers),
:mod:`~remat.distributed.sharding` (FSDP / DDP per-rank arithmetic),
:mod:`~remat.simulate.hf` (Hugging Face models from config classes, no weights),
:mod:`~remat.devices` (GPU table), :mod:`~remat.simulate.plot` (the chart).
"""

from __future__ import annotations

from typing import Any

from remat.devices import DEVICES, DeviceSpec, get_device, register_device
from remat.distributed.sharding import ShardedPeak, shard_peak
from remat.simulate.estimate import EstimateRow, EstimateTable, FormulaEstimate, estimate
from remat.simulate.formulas import (
    full_checkpoint_bytes,
    korthikanti_bytes,
    korthikanti_flash_bytes,
    rule_of_thumb_bytes,
)
from remat.simulate.hf import (
    hf_config_from_file,
    hf_config_from_name,
    hf_model_from_config,
    hf_model_from_config_file,
    hf_model_from_name,
)
from remat.simulate.plot import plot_simulation
from remat.simulate.precision import PRECISIONS, Precision, get_precision, make_optimizer
from remat.simulate.result import SimulationResult, SimulationRow
from remat.simulate.run import simulate

__all__ = [
    "DEFAULT_STRATEGIES",
    "DEVICES",
    "PRECISIONS",
    "DeviceSpec",
    "EstimateRow",
    "EstimateTable",
    "FormulaEstimate",
    "Precision",
    "ShardedPeak",
    "SimulationResult",
    "SimulationRow",
    "estimate",
    "full_checkpoint_bytes",
    "get_device",
    "get_precision",
    "hf_config_from_file",
    "hf_config_from_name",
    "hf_model_from_config",
    "hf_model_from_config_file",
    "hf_model_from_name",
    "korthikanti_bytes",
    "korthikanti_flash_bytes",
    "make_optimizer",
    "plot_simulation",
    "register_device",
    "rule_of_thumb_bytes",
    "shard_peak",
    "simulate",
]


def __getattr__(name: str) -> Any:
    # DEFAULT_STRATEGIES: kept for compatibility, read live from the strategy registry
    # (see remat.simulate.run); prefer remat.strategies.default_strategies("simulate").
    if name == "DEFAULT_STRATEGIES":
        from remat.simulate import run

        return run.DEFAULT_STRATEGIES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
