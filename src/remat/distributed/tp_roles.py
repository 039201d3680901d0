"""Which module tensor parallelism splits how: its *role*, found by module names.

Below the integration that turns roles into DTensor styles (``remat.integrations.tp``,
through :mod:`remat.distributed.tp_layout`), so the simulation and the real run read the same
plan (NOTE [ TP plan by module names ] there).
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from remat.errors import RematError, message

API = "remat.distributed.tensor_parallel.tp_rank_bytes"

Role = Literal["colwise", "fused", "rowwise", "embedding", "head", "norm", "gather",
               "replicated", "scatter"]

_ATTN = ("attn", "self_attn", "attention")
_MLP = ("mlp", "feed_forward")
COLWISE_ATTN = ("q_proj", "k_proj", "v_proj", "wq", "wk", "wv")
_ROWWISE_ATTN = ("o_proj", "wo", "out_proj")
_COLWISE_MLP = ("gate_proj", "up_proj", "w1", "w3", "fc", "c_fc", "fc1")
_ROWWISE_MLP = ("down_proj", "w2", "proj", "c_proj", "fc2")
_NORMS = ("attn_norm", "mlp_norm", "input_layernorm", "post_attention_layernorm",
          "attention_norm", "ffn_norm", "ln_1", "ln_2", "self_attn_layer_norm",
          "final_layer_norm")
_EMBEDDINGS = ("tok_emb", "embed_tokens", "tok_embeddings", "wte", "embed_in")
_FINAL_NORMS = ("norm", "ln_f", "final_layer_norm")
#: Learned position embeddings added to the token embedding's output (OPT).
_POSITIONS = ("embed_positions",)
_HEADS = ("lm_head", "output")


def _child(module: nn.Module, names: tuple[str, ...]) -> tuple[str, nn.Module] | None:
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, nn.Module):
            return name, child
    return None


def _linears(module: nn.Module, names: tuple[str, ...]) -> list[str]:
    from remat.distributed.tp_fused import linear_shape

    return [n for n in names if isinstance(getattr(module, n, None), nn.Module)
            and linear_shape(getattr(module, n)) is not None]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _hidden(block: nn.Module) -> int | None:
    """The block's width: the input width most of its linears share."""
    from collections import Counter

    from remat.distributed.tp_fused import linear_shape

    widths = Counter(s[0] for m in block.modules() if (s := linear_shape(m)) is not None)
    return widths.most_common(1)[0][0] if widths else None


def _by_shape(module: nn.Module, hidden: int | None) -> tuple[list[str], str] | None:
    """A sub-layer's colwise and rowwise linears found by their widths (NOTE [ TP plan by
    module names ] in remat/integrations/tp.py): the rowwise one is the last registered
    linear mapping back to the block's width; every other linear must read the block's
    width."""
    from remat.distributed.tp_fused import linear_shape

    shapes = {n: s for n, m in module.named_children() if (s := linear_shape(m)) is not None}
    rows = [n for n, s in shapes.items() if s[1] == hidden]
    if hidden is None or not rows:
        return None
    cols = [n for n in shapes if n != rows[-1]]
    if not cols or any(shapes[c][0] != hidden for c in cols):
        return None
    return cols, rows[-1]


def _block_roles(prefix: str, block: nn.Module) -> dict[str, Role]:
    from remat.distributed.tp_fused import linear_shape

    roles: dict[str, Role] = {}
    hidden = _hidden(block)
    mlp = _child(block, _MLP)
    if mlp is None and _linears(block, _COLWISE_MLP) and len(_linears(block, _ROWWISE_MLP)) == 1:
        mlp = ("", block)  # the MLP's linears on the block itself (OPT's fc1 / fc2)
    named = [(_child(block, _ATTN), COLWISE_ATTN, _ROWWISE_ATTN),
             (mlp, _COLWISE_MLP, _ROWWISE_MLP)]
    taken = {found[0] for found, _, _ in named if found is not None}
    named += [((n, m), (), ()) for n, m in block.named_children()  # other sub-layers
              if n not in taken and _by_shape(m, hidden) is not None]
    for found, colwise, rowwise in named:
        if found is None:
            continue
        name, module = found
        cols, rows = _linears(module, colwise), _linears(module, rowwise)
        if not name:  # no module between the linears: the colwise ones gather the input
            roles.update({_join(prefix, c): "colwise" for c in cols})
            roles[_join(prefix, rows[0])] = "rowwise"
            continue
        if not cols or len(rows) != 1:
            shaped = _by_shape(module, hidden)
            if shaped is None:  # an unknown layout: left whole
                roles[_join(prefix, name)] = "replicated"
                continue
            cols, rows = shaped[0], [shaped[1]]
        row_in = linear_shape(getattr(module, rows[0]))[0]  # type: ignore[index]
        fused = len(cols) == 1 and linear_shape(getattr(module, cols[0]))[1] > row_in  # type: ignore[index]
        for col in cols:
            roles[_join(prefix, f"{name}.{col}")] = "fused" if fused else "colwise"
        roles[_join(prefix, f"{name}.{rows[0]}")] = "rowwise"
        roles[_join(prefix, name)] = "gather"
    for norm in _NORMS:
        if isinstance(getattr(block, norm, None), nn.Module):
            roles[_join(prefix, norm)] = "norm"
    return roles


def tp_roles(model: nn.Module, *, sequence_parallel: bool = False,
             api: str = API) -> dict[str, Role]:
    """Each module tensor parallelism touches, by qualified name, and how.

    ``"colwise"`` / ``"rowwise"``: a linear (or a transposed one, Hugging Face's
    ``Conv1D``) split by output / input features; ``"fused"``: a colwise linear whose
    output holds several parts the forward splits (q, k and v), split by heads of each
    (NOTE [ Fused projections ] in tp_fused.py); ``"embedding"``: the
    vocabulary-sharded token embedding; ``"head"``: the LM head (colwise, logits
    gathered); ``"norm"``: a norm (sequence-sharded with SP, else
    untouched); ``"gather"``: an attention or MLP module between its colwise and
    rowwise linears, whose input SP all-gathers; ``"replicated"``: a sub-layer left
    whole (its linears' widths fit no layout), whose input SP gathers and whose output it
    re-shards; ``"scatter"``: with SP, the first block of a model that adds learned
    position embeddings to the token embedding's output (OPT), whose input SP
    shards on the sequence (the embedding's output stays whole). A colwise linear
    with no ``"gather"`` module above it (OPT's ``fc1``, on the block itself)
    gathers its own input. ``sequence_parallel`` decides whether an embedding tied
    to the head is an error and whether there is a ``"scatter"``. See NOTE [ TP plan
    by module names ] in remat/integrations/tp.py.

    Args:
        model: the model (any device, meta included), not yet parallelized.
        sequence_parallel: include the sequence-parallel roles. Default: ``False``.
        api: the public call named in errors.
            Default: ``"remat.distributed.tensor_parallel.tp_rank_bytes"``.

    Raises:
        RematError: no block has projections the plan recognises, or sequence
            parallelism without a shardable embedding.

    Example:
        >>> tp_roles(build_model("llama-tiny"))["blocks.0.mlp.down_proj"]
        'rowwise'
    """
    from remat.blocks import named_blocks

    blocks = [(n, b) for n, b in named_blocks(model, None, api=api) if isinstance(b, nn.Module)]
    roles: dict[str, Role] = {}
    for name, block in blocks:
        roles.update(_block_roles(name, block))
    if not {"colwise", "fused"} & set(roles.values()):
        raise RematError(message(
            api, "no block has projections the tensor-parallel plan knows",
            {"block class": type(blocks[0][1]).__name__ if blocks else "no blocks",
             "looked for": f"{_ATTN} with {COLWISE_ATTN[:3]}, {_MLP} with "
                           f"{_COLWISE_MLP[:2]}"},
            fix="pass your own plan: tp_plan={'mlp.fc_in': ColwiseParallel(), "
                "'mlp.fc_out': RowwiseParallel(), ...} (keys relative to a block, your "
                "linears' names) to apply_tp / tp_rank_bytes, or --tp-plan file.py:NAME "
                "to remat simulate"))
    modules = dict(model.named_modules())
    parent = blocks[0][0].rsplit(".", 2)[0] if blocks[0][0].count(".") >= 2 else ""
    emb = _child(modules[parent], _EMBEDDINGS)
    head, head_prefix = None, parent
    while head is None:  # the stack's parent, or the nearest module above it
        head = _child(modules[head_prefix], _HEADS)
        if head is None and not head_prefix:
            break
        if head is None:
            head_prefix = head_prefix.rpartition(".")[0]
    if emb is None:  # by structure: the stack's parent's one embedding
        embeddings = [(n, m) for n, m in modules[parent].named_children()
                      if isinstance(m, nn.Embedding)]
        emb = embeddings[0] if len(embeddings) == 1 else None
    # tied: the head's weight is another module's too (an embedding of any name)
    head_weight = getattr(head[1], "weight", None) if head is not None else None
    tied = head_weight is not None and any(
        p is head_weight for m in model.modules() if m is not head[1]  # type: ignore[index]
        for p in m.parameters(recurse=False))
    if emb is not None and isinstance(emb[1], nn.Embedding) and not tied:
        roles[_join(parent, emb[0])] = "embedding"
    elif sequence_parallel:
        raise RematError(message(
            api, "sequence parallelism needs a token embedding it can shard",
            {"embedding": type(emb[1]).__name__ if emb is not None else "not found",
             "tied to the head": tied},
            fix="untie the embedding and the head (tie_weights=False), or drop sequence "
                "parallelism"))
    if sequence_parallel and _child(modules[parent], _POSITIONS) is not None:
        roles[blocks[0][0]] = "scatter"
    norm = _child(modules[parent], _FINAL_NORMS)
    if norm is not None:
        roles[_join(parent, norm[0])] = "norm"
    if head is not None and isinstance(head[1], nn.Linear) and not tied:
        roles[_join(head_prefix, head[0])] = "head"
    return roles


def attention_modules(roles: dict[str, Role]) -> list[str]:
    """Names of the attention modules whose q projection is colwise (once each)."""
    return sorted({n.rpartition(".")[0] for n, r in roles.items()
                   if r == "colwise" and n.rpartition(".")[2] in ("q_proj", "wq")})
