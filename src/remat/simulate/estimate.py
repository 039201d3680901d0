"""Closed-form activation estimates next to the exact simulated figure, with their errors.

For each sequence length and batch size, the per-layer activation bytes of a
simulated training step (without and with full checkpointing) are set against the
formulas of :mod:`remat.simulate.formulas`: the ``12·s·b·h`` rule of thumb and
Korthikanti et al. 2022 Eq. 1 (``s·b·h·(34 + 5·a·s/h)``) and its fused-attention
variant (``34·s·b·h``) for the un-checkpointed step; ``2·s·b·h`` for full
checkpointing.

NOTE [ Per-layer simulated bytes ]
The simulated figure is the first block's ``saved_bytes``: the bytes it created in
forward that are still alive when backward starts. Its input is the embedding's
output (not counted), and its output is kept for the next block, which is the
steady state of every layer but the last (the last one's output is consumed by the
final norm, which under checkpointing keeps its own copy). Per-layer bytes do not
depend on depth, so presets and Hugging Face models are simulated with
``layers`` blocks (2 by default) to make the 30-point table take seconds.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from remat.errors import message
from remat.simulate.formulas import (
    full_checkpoint_bytes,
    korthikanti_bytes,
    korthikanti_flash_bytes,
    rule_of_thumb_bytes,
)
from remat.simulate.hf import is_hf_model, unpacked_sequences
from remat.simulate.precision import Precision, get_precision

_API = "remat.simulate.estimate"

#: Formula names as displayed, in column order.
FORMULAS: tuple[str, ...] = ("12sbh", "korthikanti", "korthikanti-flash", "2sbh")


@dataclass(frozen=True)
class FormulaEstimate:
    """One formula's per-layer estimate and its error against the simulation.

    Args:
        name: ``"12sbh"``, ``"korthikanti"``, ``"korthikanti-flash"`` or ``"2sbh"``.
        bytes: the estimate, bytes per layer.
        rel_error: ``(estimate - simulated) / simulated`` (``0.25`` = 25 % too high).
    """

    name: str
    bytes: int
    rel_error: float


@dataclass(frozen=True)
class EstimateRow:
    """Per-layer activation bytes at one sequence length, batch size and checkpointing.

    Args:
        seq_len, batch_size: the shape.
        checkpointing: ``"none"`` or ``"full"``.
        simulated_bytes: exact simulated bytes per layer (NOTE [ Per-layer simulated bytes ]).
        estimates: the formulas that apply (three without checkpointing, ``2sbh`` with).
    """

    seq_len: int
    batch_size: int
    checkpointing: str
    simulated_bytes: int
    estimates: tuple[FormulaEstimate, ...]

    def estimate(self, name: str) -> FormulaEstimate | None:
        """The estimate of formula ``name``, or ``None`` if it does not apply to this row."""
        return next((e for e in self.estimates if e.name == name), None)


@dataclass(frozen=True)
class EstimateTable:
    """Formula estimates against simulation for one model.

    Args:
        model: model name.
        hidden_size, n_heads, n_layers: the shape the formulas use (``n_layers`` of the
            full model; the simulation used fewer, see NOTE [ Per-layer simulated bytes ]).
        precision: training precision of the simulation.
        bytes_per_element: activation element size the formulas were scaled to.
        rows: one per sequence length, batch size and checkpointing.
    """

    model: str
    hidden_size: int
    n_heads: int
    n_layers: int
    precision: str
    bytes_per_element: int
    rows: tuple[EstimateRow, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data."""
        return asdict(self)

    def to_json(self, **kwargs: Any) -> str:
        """:meth:`to_dict` as JSON (``kwargs`` go to :func:`json.dumps`)."""
        kwargs.setdefault("indent", 2)
        return json.dumps(self.to_dict(), **kwargs)


def model_dims(model: nn.Module) -> tuple[int, int, int]:
    """``(hidden_size, n_heads, n_layers)`` from a built-in or Hugging Face model's config.

    Raises:
        ValueError: the config has none of the known field names.
    """
    config = getattr(model, "config", None)
    names = (("d_model", "hidden_size", "n_embd"), ("n_head", "num_attention_heads"),
             ("n_layer", "num_hidden_layers"))
    dims: list[int] = []
    for candidates in names:
        value = next((getattr(config, n) for n in candidates
                      if isinstance(getattr(config, n, None), int)), None)
        if value is None:
            raise ValueError(message(
                _API, f"cannot read {'/'.join(candidates)} from {type(model).__name__}'s config",
                {"needs": "hidden size, heads and layers (for the formulas)"},
                fix="use a built-in preset or a Hugging Face model"))
        dims.append(value)
    return dims[0], dims[1], dims[2]


def _formulas(seq_len: int, batch_size: int, hidden: int, heads: int, checkpointing: str,
              bpe: int) -> list[tuple[str, int]]:
    shape = {"seq_len": seq_len, "batch_size": batch_size, "hidden_size": hidden,
             "bytes_per_element": bpe}
    if checkpointing == "full":
        return [("2sbh", full_checkpoint_bytes(**shape))]
    return [
        ("12sbh", rule_of_thumb_bytes(**shape)),
        ("korthikanti", korthikanti_bytes(**shape, n_heads=heads)),
        ("korthikanti-flash", korthikanti_flash_bytes(**shape)),
    ]


def _preset_builder(name: str, layers: int | None,
                    max_seq: int) -> tuple[Callable[[], nn.Module], int]:
    from remat.models import PRESETS, build_model

    if name not in PRESETS:
        raise ValueError(message(_API, f"unknown preset {name!r}",
                                 {"presets": ", ".join(PRESETS)}, fix="pass one of the presets"))
    config = PRESETS[name]
    overrides: dict[str, Any] = {"max_seq_len": max(max_seq, config.max_seq_len)}
    if layers is not None:
        overrides["n_layer"] = min(layers, config.n_layer)
    return (lambda: build_model(name, **overrides)), config.n_layer


def estimate(
    model: str | Callable[[], nn.Module],
    *,
    seq_lens: Sequence[int] = (512, 1024, 2048, 4096, 8192),
    batch_sizes: Sequence[int] = (1, 4, 8),
    dtype: str | Precision = "bf16",
    layers: int | None = 2,
    n_layers: int | None = None,
    blocks: Any = None,
    batch_fn: Callable[[int, int], Any] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    on_row: Callable[[EstimateRow], None] | None = None,
) -> EstimateTable:
    """Closed-form activation estimates next to the exact simulated bytes, per layer.

    The formulas cost nothing but ignore the model's details (SwiGLU's third matrix,
    fp32 norm statistics, dropout masks or their absence); the simulation is exact
    for this model, precision and kernel choice. The table shows by how much each
    formula is off, over the shapes practitioners tabulate.

    Args:
        model: a preset name, or a factory ``() -> nn.Module`` called under
            ``torch.device("meta")`` (build it with few layers: simulation is per layer).
        seq_lens: sequence lengths. Default: ``(512, 1024, 2048, 4096, 8192)``.
        batch_sizes: micro-batch sizes. Default: ``(1, 4, 8)``.
        dtype: training precision (activations are 2 bytes in bf16 and amp-bf16).
            Default: ``"bf16"``.
        layers: blocks to simulate a preset with. Default: ``2``; ``None`` for all.
        n_layers: layers of the full model (reported only). Default: read from the config.
        blocks: which modules are blocks (as for :func:`remat.apply`).
        batch_fn: ``batch_fn(batch_size, seq_len) -> batch``. Default: random token ids
            and labels from ``model.config.vocab_size``.
        loss_fn: ``loss_fn(output, batch) -> scalar``. Default: ``output.loss``, as in
            :func:`remat.measure.profile`.
        on_row: called with each row as it is simulated (progress bars).

    Returns:
        An :class:`EstimateTable`; rows ordered by sequence length, batch size, then
        checkpointing ``"none"`` before ``"full"``.

    Example:
        >>> table = estimate("llama-7b", seq_lens=[2048], batch_sizes=[1])  # doctest: +SKIP
        >>> table.rows[0].estimate("korthikanti-flash").rel_error  # doctest: +SKIP
        -0.253...
    """
    from remat.measure import profile
    from remat.measure.outside import cpu_rng_state_bytes
    from remat.simulate.sim_setup import check_ints, default_batch
    from remat.strategies import apply, remove

    seqs = check_ints(_API, "seq_lens", seq_lens)
    sizes = check_ints(_API, "batch_sizes", batch_sizes)
    precision = get_precision(dtype)
    if isinstance(model, str):
        factory, full_layers = _preset_builder(model, layers, max(seqs))
        name = model
    elif callable(model):
        factory, full_layers, name = model, 0, ""
    else:
        raise TypeError(message(_API, "model must be a preset name or a factory",
                                {"found": type(model).__name__},
                                fix="pass a preset name or a function returning the model"))
    with torch.device("meta"):
        net = factory()
    net.to(precision.param_dtype)
    net.train()
    hidden, heads, depth = model_dims(net)
    name = name or type(net).__name__
    bpe = precision.activation_bytes_per_element
    run: nn.Module = net
    if precision.autocast_dtype is not None:
        from remat.simulate.sim_setup import Autocast

        run = Autocast(net, precision.autocast_dtype)
    rows: list[EstimateRow] = []
    with ExitStack() as stack:
        if is_hf_model(net):
            stack.enter_context(unpacked_sequences())  # NOTE [ HF masks under FakeTensorMode ]
        stack.callback(remove, run)
        for seq in seqs:
            for batch_size in sizes:
                batch = (batch_fn or partial(default_batch, net))(batch_size, seq)
                for checkpointing in ("none", "full"):
                    apply(run, checkpointing, blocks=blocks)
                    prof = profile(run, batch, simulate=True, blocks=blocks, loss_fn=loss_fn)
                    if not prof.blocks:
                        raise ValueError(message(_API, f"no blocks found in {name}",
                                                 fix="pass blocks="))
                    simulated = int(prof.blocks[0].saved_bytes)
                    if checkpointing == "full" and prof.device == "cpu":
                        # NOTE [ RNG states saved by checkpoint ] (measure/outside.py): not an
                        # activation, and on GPUs it lives in host memory.
                        simulated -= cpu_rng_state_bytes()
                    estimates = tuple(
                        FormulaEstimate(f, b, (b - simulated) / simulated if simulated else 0.0)
                        for f, b in _formulas(seq, batch_size, hidden, heads, checkpointing, bpe)
                    )
                    row = EstimateRow(seq, batch_size, checkpointing, simulated, estimates)
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
    return EstimateTable(
        model=name, hidden_size=hidden, n_heads=heads,
        n_layers=n_layers or full_layers or depth, precision=precision.name,
        bytes_per_element=bpe, rows=tuple(rows),
    )
