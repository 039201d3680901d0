"""Sharded models as the tracker sees them: DTensor shards and FSDP2's all-gathered parameters.

NOTE [ Sharded models in the tracker ]
    FSDP2 (``fully_shard``) keeps each parameter as a ``DTensor`` holding this
    rank's shard and, per shard group, all-gathers the whole parameters for the
    group's forward and backward. Four things make that exact for the tracker:

    1. A ``DTensor`` is a wrapper without memory of its own: its
       ``untyped_storage()`` is a placeholder sized like the *global* tensor. The
       bytes on the rank are those of its ``_local_tensor``;
       :func:`~remat.measure.ledger.storage_of` counts that one (so parameters,
       gradients and optimizer state count their local shards, padding included:
       FSDP2 pads dim 0 to a multiple of the world size). A dispatch mode meets an op
       on DTensors before DTensor runs it on the shards, with the global shapes; the
       tracker prices it (FLOPs, bytes moved) from the local tensors, as the rank
       runs it.
    2. The unsharded parameters are views into per-parameter all-gather outputs
       that FSDP2 allocates once and then frees and re-allocates by resizing
       their storage (``tensor.untyped_storage().resize_(0)`` after forward and
       backward, ``resize_(n)`` before): direct ``UntypedStorage.resize_`` calls,
       not aten ops, so no dispatch mode sees them. :func:`watch_storage_resizes`
       wraps ``UntypedStorage.resize_`` while a tracker is active and reports
       every resize.
    3. :func:`unsharded_param_tensors` lists those all-gather outputs, so the
       tracker registers them as parameters (0 bytes while resharded) and each
       later resize counts as parameter bytes, not as an activation.
    4. The rest are ordinary aten ops of the phase that runs them: the flat
       all-gather output of each group (``torch.empty``), the reduce-scatter input
       (a copy of the group's unsharded gradients) and output (the group's new
       sharded gradients, viewed per parameter; they become kind ``"grads"``
       through the post-accumulate-grad hooks FSDP2 calls).

    5. A collective backend's own tensors: gloo's reduce-scatter on CPU copies
       its input into a buffer of the input's size on gloo's worker thread (no
       dispatch mode runs there) and splits it into the output in ``work.wait()``
       on the caller's thread, where the tracker first meets it as an op input.
       An unknown input met while a collective runs (:func:`watch_collectives`)
       is counted as created then, not as memory that predates the step (NOTE
       [ What the tracker cannot see ], 2. in measure/tracker.py). NCCL keeps its
       buffers outside PyTorch's allocator; they are not counted on GPUs.
    6. Functional collectives (DTensor's redistributions) return, outside tracing,
       an ``AsyncCollectiveTensor``: a wrapper subclass around the collective's
       output, made by the custom op ``_c10d_functional._wrap_tensor_autograd`` (and
       again by views of it), whose own storage is a placeholder of the full size.
       The bytes are the wrapped tensor's, so :func:`local_tensor` unwraps it as it
       unwraps a ``DTensor``. Under fake tensors the collectives wait at once and
       return plain tensors (``_are_we_tracing``), so a simulated step never meets
       the wrapper.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

#: Tensor types that are neither a ``DTensor`` nor an ``AsyncCollectiveTensor``, nor
#: subclass either: every tensor of a step is asked, and a type's bases do not change (a
#: type that subclasses either exists only once its module is imported).
_PLAIN_TYPES: set[type] = {Tensor, nn.Parameter}


def local_tensor(t: Tensor) -> Tensor:
    """``t``'s local shard when ``t`` is a ``DTensor``, the tensor an
    ``AsyncCollectiveTensor`` wraps, else ``t`` (NOTE [ Sharded models in the tracker ],
    1. and 6.). Never imports ``torch.distributed``."""
    kind = type(t)
    if kind in _PLAIN_TYPES:
        return t
    if is_dtensor(t):
        local: Tensor = t._local_tensor  # type: ignore[attr-defined]
        return local_tensor(local)
    funcol = sys.modules.get("torch.distributed._functional_collectives")
    wrapper = getattr(funcol, "AsyncCollectiveTensor", None)
    if wrapper is not None and isinstance(t, wrapper):
        elem: Tensor = t.elem  # type: ignore[attr-defined]
        return local_tensor(elem)
    _PLAIN_TYPES.add(kind)
    return t


def is_dtensor(t: Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` (never imports ``torch.distributed``)."""
    if type(t) in _PLAIN_TYPES:
        return False
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(t, dtensor)


def unsharded_param_tensors(model: nn.Module) -> list[Tensor]:
    """The tensors FSDP2 all-gathers ``model``'s parameters into (NOTE [ Sharded models in
    the tracker ], 3.); empty for a model without ``fully_shard`` or before its first
    forward (FSDP2 creates them lazily)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    if fsdp_module is None:
        return []
    from torch.distributed.fsdp import fully_shard

    found: list[Tensor] = []
    for module in model.modules():
        if not isinstance(module, fsdp_module):
            continue
        state: Any = fully_shard.state(module)  # type: ignore[attr-defined]
        group = getattr(state, "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            found.extend(fsdp_param.all_gather_outputs)
    return found


#: The torch.distributed collectives FSDP2 and DDP call (NOTE [ Sharded models in the
#: tracker ], 5.).
COLLECTIVES: tuple[str, ...] = ("all_gather_single", "all_gather_into_tensor",
                                "reduce_scatter_single", "reduce_scatter_tensor", "all_reduce")


@contextmanager
def watch_collectives(depth: list[int]) -> Iterator[None]:
    """While active, ``depth[0]`` counts the torch.distributed collectives running
    (NOTE [ Sharded models in the tracker ], 5.). Does nothing when torch.distributed
    was never imported. Nesting is safe."""
    dist = sys.modules.get("torch.distributed")
    originals = {name: getattr(dist, name) for name in COLLECTIVES
                 if dist is not None and callable(getattr(dist, name, None))}

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def collective(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return collective

    for name, fn in originals.items():
        setattr(dist, name, wrap(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


@contextmanager
def watch_storage_resizes(
    on_resize: Callable[[torch.UntypedStorage], None],
) -> Iterator[None]:
    """While active, call ``on_resize(storage)`` after every ``UntypedStorage.resize_``.

    See NOTE [ Sharded models in the tracker ], 2. Nesting is safe: each level restores
    what it replaced.
    """
    cls: Any = torch.UntypedStorage
    original = cls.resize_

    def resize_(self: torch.UntypedStorage, size: int) -> Any:
        out = original(self, size)
        on_resize(self)
        return out

    cls.resize_ = resize_
    try:
        yield
    finally:
        cls.resize_ = original
