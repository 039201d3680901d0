"""Op-level selective activation checkpointing (SAC) policies.

Selective checkpointing keeps the outputs of chosen ops and recomputes the rest
of a region in backward. Compute-heavy ops (matmuls, attention kernels,
convolutions) cost many FLOPs to redo but their outputs are a small share of a
block's saved bytes; pointwise ops and norms are cheap to redo and often
dominate the bytes. Saving the former and recomputing the latter buys most of
full checkpointing's memory for a fraction of its recompute time.

See ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["COMPUTE_HEAVY_OPS", "default_save_ops", "make_policy", "sac_context_fn"]

#: aten overload packets that do the heavy math, as seen by the dispatcher
#: (``nn.Linear`` and ``matmul`` decompose into mm/addmm/bmm before dispatch).
COMPUTE_HEAVY_OPS: frozenset[str] = frozenset(
    {
        "aten.mm",
        "aten.addmm",
        "aten.bmm",
        "aten.baddbmm",
        "aten._scaled_mm",
        "aten.convolution",
        "aten._convolution",
        "aten._scaled_dot_product_flash_attention",
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._scaled_dot_product_efficient_attention",
        "aten._scaled_dot_product_cudnn_attention",
        "aten._scaled_dot_product_fused_attention_overrideable",
        "aten._flash_attention_forward",
        "aten._efficient_attention_forward",
    }
)


def default_save_ops() -> frozenset[str]:
    """The op set the ``"ops"`` strategy saves: :data:`COMPUTE_HEAVY_OPS`."""
    return COMPUTE_HEAVY_OPS


def op_name(func: Any) -> str:
    """``"aten.mm"`` for ``torch.ops.aten.mm.default`` (the overload packet's name)."""
    packet = getattr(func, "overloadpacket", func)
    return str(packet)


def _policy(save_ops: frozenset[str], ctx: Any, func: Any, *args: Any,
            **kwargs: Any) -> CheckpointPolicy:
    if op_name(func) in save_ops:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def make_policy(save_ops: Iterable[str]) -> Callable[..., CheckpointPolicy]:
    """A SAC policy function that saves the outputs of ``save_ops`` and recomputes the rest."""
    return partial(_policy, frozenset(save_ops))


def sac_context_fn(save_ops: Iterable[str]) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint`` implementing the policy.

    Example:
        >>> fn = sac_context_fn({"aten.mm"})
        >>> fwd_ctx, recompute_ctx = fn()
    """
    policy = make_policy(save_ops)
    return partial(create_selective_checkpoint_contexts, policy)
