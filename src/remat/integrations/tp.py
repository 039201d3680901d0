"""Tensor and sequence parallelism (DTensor) for transformer blocks, with remat on top.

Example::

    >>> import torch.distributed as dist
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from remat.integrations.tp import apply_tp
    >>> dist.init_process_group("gloo")                    # torchrun sets the rest
    >>> mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    >>> model = apply_tp(build_model("llama-small"), mesh, sequence_parallel=True)
    >>> remat.apply(model, "full")                          # TP first, then remat

NOTE [ TP plan by module names ]
    :func:`tp_plan` follows torchtitan's ``apply_tp`` for Llama 3 (Megatron-LM's
    layout, Shoeybi et al. 2019): in every block the q/k/v and gate/up projections
    are ``ColwiseParallel`` (each rank keeps ``n_head / t`` heads and ``d_ff / t``
    MLP columns), o and down are ``RowwiseParallel`` (their partial sums are
    all-reduced, or reduce-scattered over the sequence with sequence parallelism).
    The token embedding is ``RowwiseParallel`` (vocabulary-sharded) and the LM head
    ``ColwiseParallel`` with replicated logits, unless they share one weight. With
    ``sequence_parallel=True`` (Korthikanti et al. 2022) the norms are
    ``SequenceParallel``, the residual stream between them is sharded on the
    sequence dimension (dim 1), and the attention and MLP inputs are all-gathered by
    ``PrepareModuleInput``. Modules are found by name, so the same plan covers
    remat's Llama (``attn.q_proj``, ``mlp.gate_proj``, ``attn_norm``), Hugging
    Face Llama-style decoders (``self_attn.q_proj``, ``input_layernorm``) and
    torchtitan's names (``attention.wq``, ``feed_forward.w1``, ``attention_norm``) and
    GPT-3-style names (Hugging Face OPT: ``self_attn.out_proj``, ``fc1`` / ``fc2`` on the
    block itself, ``self_attn_layer_norm``): a colwise linear with no attention or MLP
    module above it gathers its own sequence-sharded input. Sequence parallelism shards
    the token dimension, the second from last (OPT flattens batch and sequence before
    its MLP). A model that adds learned position embeddings after the token embedding
    (OPT's ``embed_positions``) keeps the embedding's output whole under SP and
    shards the first block's input instead (Megatron-LM does the same).
    Where the names are unknown, a sub-layer's linears are told apart by their widths:
    the last one mapping back to the block's width is rowwise, the others colwise. A
    single colwise linear wider than the rowwise one's input is a fused projection
    (GPT-2's ``c_attn``, GPT-NeoX's and Falcon's ``query_key_value``, litgpt's ``qkv``,
    remat's GPT's ``qkv``): each rank keeps whole heads of q, k and v (NOTE [ Fused
    projections ] in remat/distributed/tp_fused.py), and a fused weight's DTensor is in
    rank-major order (:func:`natural_order` puts a ``full_tensor()`` back). GPT-2's
    transposed ``Conv1D`` takes :class:`ColwiseProjection` / :class:`RowwiseProjection`.
    Attention modules keep a head count their ``forward`` uses in ``view``:
    :func:`apply_tp` divides their head-count attributes (``n_head``, ``num_heads``,
    ``num_key_value_heads``, ``num_kv_heads``, ...) by ``t`` (Hugging Face's
    ``view(..., -1, head_dim)`` needs no change); a module holding a fused projection
    also gets its ``split_size`` divided and its own copy of its ``config`` with per-rank
    head counts (litgpt reads them there).

NOTE [ A user's TP plan ]
    ``apply_tp(model, mesh, tp_plan=...)`` (and ``tp_rank_bytes(..., tp_plan=)``,
    ``remat simulate --tp T --tp-plan file.py:NAME``) take the layout the user already
    has instead of remat's guess: a dict from module name to ``ParallelStyle``, as
    ``parallelize_module`` takes it. torchtitan writes one plan for the root
    (``tok_embeddings``, ``norm``, ``output``) and one applied to each block
    (``attention.wq``, ...); remat takes both in one dict and tells them apart by
    name: a key naming a module of the root (``model.get_submodule(key)`` exists) is
    a root entry; any other key is relative to a block and repeats under every block
    :func:`remat.find_blocks` finds, each of which must hold it (else RematError
    naming the key). Modules holding a ``ColwiseParallel`` linear get their
    head-count attributes divided by ``t`` as in remat's own layout. Sequence
    parallelism is the plan's own (``SequenceParallel``, ``PrepareModuleInput``
    entries), so ``sequence_parallel=True`` with a plan is refused. remat does not
    check that the plan computes the same function: ``remat.validate`` after
    ``apply_tp`` does.

NOTE [ Order: tensor parallel, then checkpoint ]
    ``parallelize_module`` replaces parameters with DTensors and installs forward
    pre/post hooks on the linears, norms and attention/MLP modules (redistributing
    inputs and outputs). remat installs a checkpoint region by replacing a block's
    *instance* ``forward`` (NOTE [ Instance forward ] in regions.py), below the
    block's ``__call__``: the sub-modules' TP hooks then run inside the region, so
    recomputation replays the same collectives (all-gather, all-reduce) in the same
    order on every rank, and the saved block input is the rank's own (local or
    sequence-shard) tensor. ``apply_tp`` first, ``remat.apply`` second is the
    documented order; the reverse works too (TP hooks go on sub-modules, remat's
    region on the block itself, and neither replaces the other), and both orders
    give the same gradients (tests/integrations/test_tp.py). What does not work is
    ``remat.apply`` before ``apply_tp`` with a ``sqrt`` segment spanning blocks whose
    inputs TP changes; nothing in remat's built-in plans does that.
"""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn

from remat.distributed.tp_fused import ColwiseProjection, RowwiseProjection, natural_order
from remat.distributed.tp_layout import build_plan, parallelize

__all__ = ["ColwiseProjection", "RowwiseProjection", "apply_tp", "natural_order", "tp_plan"]

M = TypeVar("M", bound=nn.Module)
API = "remat.integrations.tp.apply_tp"


def tp_plan(model: nn.Module, *, sequence_parallel: bool = False) -> dict[str, Any]:
    """The ``parallelize_module`` plan for ``model``: module name -> ParallelStyle.

    Every block found by :func:`remat.find_blocks` gets the llama-style layout of
    NOTE [ TP plan by module names ]; the root gets torchtitan's embedding, final
    norm and head styles (roles from :func:`remat.distributed.tensor_parallel.tp_roles`,
    which the per-rank simulation reads too). Inspect or edit the dict, then pass it
    to ``torch.distributed.tensor.parallel.parallelize_module`` (or use :func:`apply_tp`).
    A model with a fused projection (GPT-2's ``c_attn``, ``query_key_value``, litgpt's
    ``qkv``) is run once on a fake copy to read how its forward splits the output
    (NOTE [ Fused projections ] in remat/distributed/tp_fused.py); its style is a
    :class:`ColwiseProjection` with the output's sections.

    Args:
        model: the model, not yet parallelized.
        sequence_parallel: shard the norms and the residual stream on the sequence
            dimension (less activation memory, an all-gather and a reduce-scatter per
            sub-layer instead of an all-reduce). Default: ``False``.

    Returns:
        A dict from qualified module name to a ``ParallelStyle``.

    Raises:
        RematError: no block has projections the plan recognises, sequence
            parallelism with an embedding tied to the head, or a fused projection whose
            layout the fake forward does not show.

    Example:
        >>> plan = tp_plan(build_model("llama-tiny"))
        >>> type(plan["blocks.0.attn.q_proj"]).__name__
        'ColwiseParallel'
    """
    return build_plan(model, sequence_parallel=sequence_parallel,
                      api="remat.integrations.tp.tp_plan")


def apply_tp(model: M, mesh: Any, *, sequence_parallel: bool = False,
             tp_plan: dict[str, Any] | None = None) -> M:
    """Tensor-parallelize ``model`` over a 1-D ``mesh`` with :func:`tp_plan`, in place.

    Trades communication for memory: each rank keeps ``1/t`` of the projection
    weights (and their gradients and optimizer state) and of the activations
    between the column- and row-parallel linears; every sub-layer costs an
    all-reduce (or, with ``sequence_parallel``, an all-gather plus a
    reduce-scatter that also shards the norms' activations). Run it before
    ``remat.apply`` (NOTE [ Order: tensor parallel, then checkpoint ]).

    Args:
        model: the model on the mesh's device type, not yet parallelized.
        mesh: a 1-D ``DeviceMesh`` of the tensor-parallel ranks.
        sequence_parallel: see :func:`tp_plan`. Default: ``False``.
        tp_plan: your own ``parallelize_module``-style plan instead of remat's layout:
            root entries (``"lm_head"``) and block-relative ones (``"mlp.c_fc"``,
            repeated under every block), NOTE [ A user's TP plan ]. Default: None.

    Returns:
        ``model``, modified in place (parameters become DTensors; attention head
        counts become per-rank counts).

    Raises:
        RematError: the mesh is not 1-D, a head count is not divisible by the mesh
            size (one key/value head included), no block matches the plan, a fused
            projection's layout is unknown, or a ``tp_plan`` key names no module.

    Example:
        >>> mesh = init_device_mesh("cpu", (2,))
        >>> model = apply_tp(build_model("llama-tiny"), mesh)
        >>> remat.apply(model, "attn")
        >>> model(**batch).loss.backward()
    """
    parallelize(model, mesh, sequence_parallel=sequence_parallel, api=API, tp_plan=tp_plan)
    return model
