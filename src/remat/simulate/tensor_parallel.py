"""Per-rank bytes under tensor (and sequence) parallelism.

:func:`tp_rank_bytes` simulates one rank's step under a fake process group (NOTE [ One
tensor-parallel rank, simulated ] in tp_step.py). Which module TP splits how (its *role*)
comes from :mod:`remat.simulate.tp_roles` (re-exported here). The arithmetic split below
(NOTE [ Tensor-parallel bytes per rank ]) remains for estimates that start from a
one-device step's saved bytes per module (pipeline parallelism's per-chunk figures).

NOTE [ Tensor-parallel bytes per rank ]
    An estimate of rank 0's bytes from one device's step (all bytes of one rank; rank
    0 holds the largest shard when a dimension does not divide):

    * Parameters, gradients, optimizer state: colwise linears keep ``ceil(out/t)``
      rows of the weight (and bias), rowwise linears ``ceil(in/t)`` columns (the bias
      whole), the vocabulary-sharded embedding ``ceil(V/t)`` rows; norms and anything
      TP leaves alone stay whole. Gradients and optimizer state follow their parameter.
    * Activations (what is saved for backward), by the role of the innermost module
      that created each saved byte: between the column- and row-parallel linears
      ``/ t`` (each rank holds ``n_head / t`` heads and ``d_ff / t`` columns); the
      residual stream (block-level ops, a checkpointed block's saved input, the
      rowwise outputs, the norms, the embedding's output) whole without sequence
      parallelism, ``/ t`` with it, except each norm's output, which the colwise
      linears save all-gathered (whole); the rest (the head's gathered logits, RoPE
      tables, the loss) whole. This is Korthikanti et al. 2022's split (TP:
      ``sbh(10 + 24/t + 5as/(ht))``, TP+SP: ``sbh/t (34 + 5as/h)``) applied to what
      remat counts for the actual layer; PyTorch's SP saves the gathered input that
      Megatron re-gathers in backward (``2 sbh`` per layer at 16 bits more).
    The split leaves out what DTensor allocates on a rank (redistribution copies,
    the embedding's input mask); :func:`tp_rank_bytes` simulates the rank instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from remat.errors import message
from remat.simulate.tp_roles import Role as Role
from remat.simulate.tp_roles import attention_modules as attention_modules
from remat.simulate.tp_roles import tp_roles as tp_roles

if TYPE_CHECKING:
    from remat.strategies.base import Strategy

API = "remat.simulate.tp_rank_bytes"


# ---- bytes -------------------------------------------------------------------------------

def _shard(n: int, t: int) -> int:
    return -(-n // t)


def _param_rank_bytes(p: torch.Tensor, role: Role | None, name: str, t: int,
                      gradient: bool = False) -> int:
    """Rank 0's bytes of parameter ``name`` (``weight`` / ``bias``) of a module of ``role``
    (of its gradient with ``gradient``: the embedding's is whole)."""
    size = p.element_size()
    shape = list(p.shape)
    if role == "embedding" and gradient:
        pass
    elif role in ("colwise", "head", "embedding") and shape:
        shape[0] = _shard(shape[0], t)  # Linear (out, in) rows; Embedding (V, h) rows
    elif role == "rowwise" and name == "weight" and len(shape) == 2:
        shape[1] = _shard(shape[1], t)
    return size * int(torch.Size(shape).numel())


def rank_param_bytes(model: nn.Module, roles: dict[str, Role], t: int, *,
                     gradients: bool = False) -> int:
    """Rank 0's parameter (or gradient) bytes under ``roles`` at degree ``t`` (tied once).

    Args:
        model: the unparallelized model (meta is fine).
        roles: from :func:`tp_roles`.
        t: tensor-parallel degree, >= 1.
        gradients: the gradients' bytes instead: trainable parameters only, and the
            vocabulary-sharded embedding's gradient whole (DTensor's embedding backward
            returns it replicated). Default: ``False``.
    """
    trainable = gradients
    seen: set[int] = set()
    total = 0
    for mod_name, module in model.named_modules():
        role = roles.get(mod_name)
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen or (trainable and not p.requires_grad):
                continue
            seen.add(id(p))
            total += _param_rank_bytes(p, role, p_name, t, gradients)
    return total


@dataclass(frozen=True)
class TPRankBytes:
    """One tensor-parallel rank's bytes for a step (NOTE [ Tensor-parallel bytes per rank ]).

    Args:
        tp: tensor-parallel degree ``t``.
        sequence_parallel: whether norms and the residual stream are sequence-sharded.
        param_bytes, grad_bytes, optimizer_bytes: this rank's shards, bytes.
        activation_bytes: saved for backward when backward starts, bytes.
        peak_bytes: estimated peak, bytes.
        device_activation_bytes, device_peak_bytes: the one-device step's, bytes.
    """

    tp: int
    sequence_parallel: bool
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    peak_bytes: int
    device_activation_bytes: int
    device_peak_bytes: int

    def __post_init__(self) -> None:
        sizes = (self.param_bytes, self.grad_bytes, self.optimizer_bytes,
                 self.activation_bytes, self.peak_bytes, self.device_activation_bytes,
                 self.device_peak_bytes)
        if self.tp < 1 or min(sizes) < 0:
            raise ValueError(message("TPRankBytes", "tp must be >= 1 and sizes >= 0",
                                     {"tp": self.tp, "sizes": sizes},
                                     fix="pass the figures of one rank"))

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


def _divisor(role: Role | None, sequence_parallel: bool, t: int) -> int:
    if role in ("colwise", "gather"):
        return t
    if role in ("rowwise", "norm", "embedding", "scatter", None):  # block-level: residual
        return t if sequence_parallel else 1
    return 1  # head (logits gathered), replicated sub-layers


def split_activations(saved_by_unit: dict[str, int], roles: dict[str, Role],
                      block_names: Iterable[str], norm_out_bytes: dict[str, int], *,
                      total_bytes: int, t: int, sequence_parallel: bool) -> int:
    """Per-rank activation bytes from one device's saved bytes per attribution unit.

    Args:
        saved_by_unit: saved bytes per innermost module (blocks and the role modules).
        roles: from :func:`tp_roles`.
        block_names: the blocks (their own bytes are the residual stream's).
        norm_out_bytes: each norm's output bytes (whole under SP: the gathered input).
        total_bytes: the one-device activation bytes (what no unit holds is whole).
        t: tensor-parallel degree.
        sequence_parallel: as in :func:`tp_roles`.

    Returns:
        Bytes, rounded up per unit.
    """
    blocks = set(block_names)
    rank = 0
    for unit, nbytes in saved_by_unit.items():
        role = roles.get(unit)
        if role is None and unit not in blocks:
            rank += nbytes  # a module no role covers: whole
            continue
        if sequence_parallel and role == "norm":
            out = min(norm_out_bytes.get(unit, 0), nbytes)
            rank += out + _shard(nbytes - out, t)
            continue
        rank += _shard(nbytes, _divisor(role, sequence_parallel, t))
    return rank + total_bytes - sum(saved_by_unit.values())


def tp_rank_bytes(model: Any, *, seq_len: int, batch_size: int, tp: int,
                  sequence_parallel: bool = False, strategy: str | Strategy = "none",
                  dtype: str = "bf16", optimizer: str = "adamw") -> TPRankBytes:
    """One tensor-parallel rank's parameter, gradient, optimizer, activation and peak bytes.

    Simulates what rank 0 of ``tp`` runs: a fake process group of ``tp`` ranks, the
    model parallelized on the meta device exactly as
    :func:`remat.integrations.tp.apply_tp` does it, and one tracked fake step (NOTE
    [ One tensor-parallel rank, simulated ] in tp_step.py); nothing is allocated and
    no other process runs. The trade-off: two simulated steps (the rank's and one
    device's, for the ``device_*`` fields), each a warm-up plus a tracked step, where
    an arithmetic split of one step would be cheaper and wrong by DTensor's own
    copies. Collective backends' buffers are not counted. When ``torch.distributed``
    is already initialized in this process the rank runs in a subprocess instead (the
    caller's group is left alone).

    Args:
        model: a preset name, a factory (called on the meta device) or a module (copied
            to the meta device; never changed).
        seq_len: tokens per sequence.
        batch_size: sequences per micro-batch (every TP rank runs the whole micro-batch).
        tp: tensor-parallel degree, >= 1.
        sequence_parallel: sequence-shard norms and the residual stream. Default: ``False``.
        strategy: remat strategy applied to the blocks: a name (``remat.STRATEGIES``) or
            a :class:`~remat.strategies.base.Strategy` config. Default: ``"none"``.
        dtype: precision (see :data:`remat.simulate.PRECISIONS`). Default: ``"bf16"``.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"`` or ``"none"``. Default: ``"adamw"``.

    Returns:
        A :class:`TPRankBytes`.

    Raises:
        ValueError: ``tp`` or the sizes are not positive ints.
        RematError: the model has no block the tensor-parallel plan recognises, a head
            count ``tp`` does not divide, or (with ``torch.distributed`` initialized) a
            model the subprocess cannot receive.

    Example:
        >>> r = tp_rank_bytes("llama-7b", seq_len=4096, batch_size=1, tp=8,
        ...                   sequence_parallel=True)  # doctest: +SKIP
        >>> r.activation_bytes < r.device_activation_bytes  # doctest: +SKIP
        True
    """
    from remat.simulate._setup import check_ints
    from remat.simulate.tp_step import simulate_ranks

    check_ints(API, "seq_len, batch_size and tp", (seq_len, batch_size, tp))
    points: list[tuple[str | Strategy, int]] = [(strategy, batch_size)]
    rank = simulate_ranks(model, seq_len=seq_len, points=points, tp=tp,
                          sequence_parallel=sequence_parallel, dtype=dtype,
                          optimizer=optimizer)[0]
    device = rank if tp == 1 else simulate_ranks(
        model, seq_len=seq_len, points=points, tp=1, sequence_parallel=False, dtype=dtype,
        optimizer=optimizer)[0]
    return TPRankBytes(
        tp=tp, sequence_parallel=sequence_parallel, param_bytes=rank.param_bytes,
        grad_bytes=rank.grad_bytes, optimizer_bytes=rank.optimizer_bytes,
        activation_bytes=rank.activation_bytes, peak_bytes=rank.peak_bytes,
        device_activation_bytes=device.activation_bytes, device_peak_bytes=device.peak_bytes)
