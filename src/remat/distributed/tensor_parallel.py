"""Per-rank bytes under tensor (and sequence) parallelism.

:func:`tp_rank_bytes` simulates one rank's step under a fake process group (NOTE [ One
tensor-parallel rank, simulated ] in tp_step.py); the pipeline rows simulate each
stage's rank the same way (NOTE [ Pipeline rank bytes ] in pipeline.py). Which module TP
splits how (its *role*) comes from :mod:`remat.distributed.tp_roles` (re-exported here).
:func:`rank_param_bytes` is the arithmetic of NOTE [ Tensor-parallel bytes per rank ],
a check on the simulated shards.

NOTE [ Tensor-parallel bytes per rank ]
    Rank 0's parameter bytes from the unparallelized model (rank 0 holds the largest
    shard when a dimension does not divide): colwise linears keep ``ceil(out/t)`` rows
    of the weight (and bias), rowwise linears ``ceil(in/t)`` columns (the bias whole),
    the vocabulary-sharded embedding ``ceil(V/t)`` rows; norms and anything TP leaves
    alone stay whole. Gradients follow their parameter, except the embedding's, which
    DTensor's embedding backward returns replicated (whole). Activations are not split
    arithmetically: what a rank saves depends on DTensor's redistributions (a
    row-parallel linear's local matmul output is the whole ``s x h`` partial sum, the
    colwise linears save their all-gathered inputs under SP), so they are simulated.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from remat.distributed.tp_roles import Role as Role
from remat.distributed.tp_roles import attention_modules as attention_modules
from remat.distributed.tp_roles import tp_roles as tp_roles
from remat.errors import message

if TYPE_CHECKING:
    from remat.strategies.base import Strategy

API = "remat.distributed.tensor_parallel.tp_rank_bytes"


# ---- bytes -------------------------------------------------------------------------------

def _shard(n: int, t: int) -> int:
    return -(-n // t)


def _param_rank_bytes(p: torch.Tensor, role: Role | None, name: str, t: int,
                      gradient: bool = False, out_dim: int = 0) -> int:
    """Rank 0's bytes of parameter ``name`` (``weight`` / ``bias``) of a module of ``role``
    (of its gradient with ``gradient``: the embedding's is whole); ``out_dim``: the
    weight's output dimension (1 for a transposed linear)."""
    size = p.element_size()
    shape = list(p.shape)
    dim = out_dim if len(shape) == 2 else 0
    if role == "embedding" and gradient:
        pass
    elif role in ("colwise", "fused", "head", "embedding") and shape:
        shape[dim] = _shard(shape[dim], t)  # Linear (out, in) rows; Embedding (V, h) rows
    elif role == "rowwise" and name == "weight" and len(shape) == 2:
        shape[1 - dim] = _shard(shape[1 - dim], t)
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
    from remat.distributed.tp_fused import linear_shape

    trainable = gradients
    seen: set[int] = set()
    total = 0
    for mod_name, module in model.named_modules():
        role = roles.get(mod_name)
        shape = linear_shape(module)
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen or (trainable and not p.requires_grad):
                continue
            seen.add(id(p))
            total += _param_rank_bytes(p, role, p_name, t, gradients,
                                       shape[2] if shape is not None else 0)
    return total


@dataclass(frozen=True)
class TPRankBytes:
    """One tensor-parallel rank's bytes for a step (NOTE [ One tensor-parallel rank,
    simulated ] in tp_step.py).

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


def tp_rank_bytes(model: Any, *, seq_len: int, batch_size: int, tp: int,
                  sequence_parallel: bool = False, strategy: str | Strategy = "none",
                  dtype: str = "bf16", optimizer: str = "adamw",
                  tp_plan: dict[str, Any] | None = None) -> TPRankBytes:
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
        tp_plan: your own ``parallelize_module``-style plan, as
            :func:`remat.integrations.tp.apply_tp` takes it (block-relative keys repeat
            under every block; NOTE [ A user's TP plan ]). Default: None (remat's layout).

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
    from remat.distributed.tp_step import simulate_ranks
    from remat.simulate.sim_setup import check_ints

    check_ints(API, "seq_len, batch_size and tp", (seq_len, batch_size, tp))
    points: list[tuple[str | Strategy, int]] = [(strategy, batch_size)]
    rank = simulate_ranks(model, seq_len=seq_len, points=points, tp=tp,
                          sequence_parallel=sequence_parallel, dtype=dtype,
                          optimizer=optimizer, tp_plan=tp_plan)[0]
    device = rank if tp == 1 else simulate_ranks(
        model, seq_len=seq_len, points=points, tp=1, sequence_parallel=False, dtype=dtype,
        optimizer=optimizer)[0]
    return TPRankBytes(
        tp=tp, sequence_parallel=sequence_parallel, param_bytes=rank.param_bytes,
        grad_bytes=rank.grad_bytes, optimizer_bytes=rank.optimizer_bytes,
        activation_bytes=rank.activation_bytes, peak_bytes=rank.peak_bytes,
        device_activation_bytes=device.activation_bytes, device_peak_bytes=device.peak_bytes)
