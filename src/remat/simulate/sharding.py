"""Per-rank peak memory under data parallelism, as arithmetic on a one-device profile.

A simulated single-device step gives exact parameter, gradient and optimizer bytes.
Data parallelism changes only those (and adds communication buffers): every rank
still runs the same micro-batch, so activations, the batch, buffers and
temporaries are the same per rank as on one device.

NOTE [ Sharding arithmetic ]
Write the one-device peak as ``peak = P + G + O + R``: parameters, gradients,
optimizer state, and the rest (activations, batch, buffers, temporaries). Then,
per rank with ``W`` ranks:

* ``"none"``: ``peak``.
* ``"ddp"`` (``DistributedDataParallel``): parameters, gradients and optimizer state
  stay whole. DDP allocates flat gradient buckets covering every trainable
  parameter when it is constructed; with the default
  ``gradient_as_bucket_view=False`` the ``.grad`` tensors are separate, so the
  buckets add ``G_total`` bytes. With ``gradient_as_bucket_view=True`` the grads are
  views into the buckets and nothing is added.
* ``"fsdp"`` (FSDP2 ``fully_shard`` per block plus the root, or ZeRO-3):
  ``R + ceil(P/W) + ceil(G/W) + ceil(O/W) + U``, where ``U`` is what is unsharded
  at once: the largest block's parameters (all-gathered for its forward/backward)
  and its gradients before reduce-scatter, plus the root module's own parameters
  and gradients (embeddings, final norm, output head: FSDP2 does not reshard the
  root after forward, and reduce-scatters its gradients at the end of backward).
  Prefetching the next block (FSDP's default overlap) can hold a second block's
  parameters; pass ``prefetch_blocks=1`` to count it.

Caveats: ``G`` should be the gradient bytes alive at the peak. A profile reports
the gradient total; using it assumes all gradients are alive at the peak, which
holds when the peak is at the optimizer step or gradients persist across steps
(``zero_grad(set_to_none=False)``, gradient accumulation), and overstates ``G``'s
share (so slightly understates the sharded peak) when the peak is early in
backward. Communication time and NCCL's own buffers (tens to hundreds of MiB,
set by ``NCCL_BUFFSIZE`` and the number of channels) are not modelled.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from remat.errors import message

Sharding = Literal["none", "fsdp", "ddp"]
SHARDINGS: tuple[str, ...] = ("none", "fsdp", "ddp")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ShardedPeak:
    """One rank's peak, split by category (all bytes, per rank).

    Args:
        peak_bytes: the rank's peak.
        sharding: ``"none"``, ``"fsdp"`` or ``"ddp"``.
        world_size: number of data-parallel ranks.
        param_bytes, grad_bytes: resident (sharded for FSDP) bytes.
        optimizer_bytes: optimizer state; under FSDP its shard plus the shard of the
            step's temporaries (which are part of ``rest_bytes`` otherwise).
        unsharded_bytes: FSDP's all-gathered block and root parameters and gradients;
            DDP's gradient buckets; 0 otherwise.
        rest_bytes: activations, batch, buffers, temporaries (same on every rank).
    """

    peak_bytes: int
    sharding: str
    world_size: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    unsharded_bytes: int
    rest_bytes: int

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ValueError(message("ShardedPeak", "unknown sharding",
                                     {"found": repr(self.sharding)},
                                     fix=f"pass one of {SHARDINGS}"))
        parts = (self.param_bytes, self.grad_bytes, self.optimizer_bytes,
                 self.unsharded_bytes, self.rest_bytes)
        if min(parts) < 0 or sum(parts) != self.peak_bytes:
            raise ValueError(message("ShardedPeak", "parts must be >= 0 and sum to peak_bytes",
                                     {"parts": parts, "peak_bytes": self.peak_bytes},
                                     fix="pass the parts of that same peak"))

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


def shard_peak(
    *,
    peak_bytes: int,
    param_bytes: int,
    grad_bytes: int,
    optimizer_bytes: int,
    sharding: str = "none",
    world_size: int = 1,
    block_param_bytes: int = 0,
    block_grad_bytes: int = 0,
    root_param_bytes: int = 0,
    root_grad_bytes: int = 0,
    prefetch_blocks: int = 0,
    optimizer_temp_bytes: int = 0,
    total_grad_bytes: int | None = None,
    gradient_as_bucket_view: bool = False,
) -> ShardedPeak:
    """One rank's peak under data parallelism, from a single-device peak's parts.

    See NOTE [ Sharding arithmetic ] for the model and its caveats. In short: FSDP
    divides parameter, gradient and optimizer bytes by ``world_size`` and adds the
    largest all-gathered block (and the root's parameters); DDP keeps them whole and
    adds its gradient buckets.

    Args:
        peak_bytes: single-device peak.
        param_bytes, grad_bytes, optimizer_bytes: single-device bytes of each
            (included in ``peak_bytes``).
        sharding: ``"none"``, ``"fsdp"`` or ``"ddp"``. Default: ``"none"``.
        world_size: data-parallel ranks, >= 1. Default: ``1``.
        block_param_bytes, block_grad_bytes: the largest block's parameter and
            gradient bytes (FSDP only).
        root_param_bytes, root_grad_bytes: parameters outside every block and their
            gradients (FSDP only).
        prefetch_blocks: extra blocks whose parameters are gathered ahead (FSDP).
            Default: ``0``.
        optimizer_temp_bytes: temporaries of ``optimizer.step()`` alive at the peak
            (part of ``peak_bytes``, e.g. foreach AdamW's ``sqrt(exp_avg_sq)``); FSDP
            steps a shard, so they are divided like the state. Default: ``0``.
        total_grad_bytes: gradient bytes of every trainable parameter, the size of
            DDP's buckets. Default: ``grad_bytes``.
        gradient_as_bucket_view: DDP's option; ``False`` (its default) adds
            ``total_grad_bytes`` of buckets.

    Returns:
        A :class:`ShardedPeak`.

    Raises:
        ValueError: negative sizes, parts larger than the peak, or bad options.

    Example:
        >>> shard_peak(peak_bytes=100, param_bytes=40, grad_bytes=20, optimizer_bytes=20,
        ...            sharding="fsdp", world_size=4, block_param_bytes=4,
        ...            block_grad_bytes=4).peak_bytes
        48
    """
    api = "remat.simulate.shard_peak"
    values = {"peak_bytes": peak_bytes, "param_bytes": param_bytes, "grad_bytes": grad_bytes,
              "optimizer_bytes": optimizer_bytes, "block_param_bytes": block_param_bytes,
              "block_grad_bytes": block_grad_bytes, "root_param_bytes": root_param_bytes,
              "root_grad_bytes": root_grad_bytes, "prefetch_blocks": prefetch_blocks,
              "optimizer_temp_bytes": optimizer_temp_bytes,
              "total_grad_bytes": grad_bytes if total_grad_bytes is None else total_grad_bytes}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(message(api, f"{name} must be an int >= 0", {"found": repr(value)},
                                     fix=f"pass {name} as an int >= 0"))
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(message(api, "world_size must be an int >= 1",
                                 {"found": repr(world_size)}, fix="pass world_size >= 1"))
    if sharding not in SHARDINGS:
        raise ValueError(message(api, f"unknown sharding {sharding!r}",
                                 fix=f"use one of {', '.join(SHARDINGS)}"))
    rest = peak_bytes - param_bytes - grad_bytes - optimizer_bytes - optimizer_temp_bytes
    if rest < 0:
        raise ValueError(message(
            api, "param_bytes + grad_bytes + optimizer_bytes + optimizer_temp_bytes exceeds "
            "peak_bytes", {"parts": peak_bytes - rest, "peak_bytes": peak_bytes},
            fix="pass the parts of that same peak"))
    if sharding == "none":
        if world_size != 1:
            raise ValueError(message(api, f"world_size={world_size} needs sharding",
                                     fix="pass sharding='fsdp' or 'ddp'"))
        return ShardedPeak(peak_bytes, "none", 1, param_bytes, grad_bytes, optimizer_bytes,
                           0, rest + optimizer_temp_bytes)
    if sharding == "ddp":
        buckets = 0 if gradient_as_bucket_view else values["total_grad_bytes"]
        return ShardedPeak(peak_bytes + buckets, "ddp", world_size, param_bytes, grad_bytes,
                           optimizer_bytes, buckets, rest + optimizer_temp_bytes)
    params = _ceil_div(param_bytes, world_size)
    grads = _ceil_div(grad_bytes, world_size)
    states = _ceil_div(optimizer_bytes + optimizer_temp_bytes, world_size)
    unsharded = ((1 + prefetch_blocks) * block_param_bytes + block_grad_bytes
                 + root_param_bytes + root_grad_bytes)
    return ShardedPeak(rest + params + grads + states + unsharded, "fsdp", world_size,
                       params, grads, states, unsharded, rest)
