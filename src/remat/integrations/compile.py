"""Per-block ``torch.compile`` after ``remat.apply``: the order torchtitan uses.

Example::

    >>> remat.apply(model, "ops")
    >>> compile_blocks(model)          # each block compiled in place
    >>> model(**batch).loss.backward()

NOTE [ Compiling checkpointed blocks ]
    Each block is compiled in place with ``nn.Module.compile`` (its
    ``_call_impl`` is compiled; ``state_dict()`` keys get no ``_orig_mod.``
    prefix), so remat's instance ``forward`` is traced: Dynamo turns the
    non-reentrant ``torch.utils.checkpoint`` call into its checkpoint
    higher-order op, and for op-level plans (``"ops"``) the SAC policy tags every
    node of the joint graph with ``MUST_SAVE`` / ``PREFER_RECOMPUTE``, which the
    partitioner obeys: the compiled forward saves exactly the outputs of the
    plan's ops. ``sqrt`` segments cannot be compiled per block (they are one
    region spread over several blocks' calls); :func:`compile_blocks` refuses them.
    FSDP2 ``fully_shard`` comes after compilation (see ``fsdp2.py``).
"""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn

from remat.blocks import BlocksSpec, named_blocks
from remat.compiled.install import check_compilable

__all__ = ["check_compilable", "compile_blocks"]

M = TypeVar("M", bound=nn.Module)


def compile_blocks(model: M, *, blocks: BlocksSpec = None,
                   api: str = "remat.integrations.compile.compile_blocks",
                   **compile_kwargs: Any) -> M:
    """``torch.compile`` each block of ``model`` in place, after ``remat.apply``.

    Compiling per block (not the whole model) reuses one compiled graph for every
    identical block and keeps graph breaks out of the embedding and head; the
    checkpoint regions and op-level save/recompute tags are compiled with the block
    (NOTE [ Compiling checkpointed blocks ]). First calls pay the compile time.

    Args:
        model: the model, with its strategy applied.
        blocks: which modules are blocks (see :func:`remat.find_blocks`). Default: automatic.
        api: public API named in errors. Default: this function.
        **compile_kwargs: passed to ``torch.compile`` (``backend=``, ``fullgraph=``,
            ``dynamic=``, ``mode=``). Default: torch's defaults (inductor).

    Returns:
        ``model``, with each block compiled in place.

    Raises:
        StrategyError: the model has ``sqrt`` segments.

    Example:
        >>> compile_blocks(remat.apply(model, "ops"), backend="inductor")
    """
    check_compilable(model, api=api)
    for _, block in named_blocks(model, blocks, api=api):
        block.compile(**compile_kwargs)
    return model
