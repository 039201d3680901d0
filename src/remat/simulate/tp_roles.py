"""Which module tensor parallelism splits how: its *role*, found by module names.

Below the integration that turns roles into DTensor styles (``remat.integrations.tp``,
through :mod:`remat.simulate.tp_layout`), so the simulation and the real run read the same
plan (NOTE [ TP plan by module names ] there).
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from remat.errors import RematError, message

API = "remat.simulate.tp_rank_bytes"

Role = Literal["colwise", "rowwise", "embedding", "head", "norm", "gather", "replicated",
               "scatter"]

_ATTN = ("attn", "self_attn", "attention")
_MLP = ("mlp", "feed_forward")
COLWISE_ATTN = ("q_proj", "k_proj", "v_proj", "wq", "wk", "wv")
_ROWWISE_ATTN = ("o_proj", "wo", "out_proj")
_COLWISE_MLP = ("gate_proj", "up_proj", "w1", "w3", "fc", "c_fc", "fc1")
_ROWWISE_MLP = ("down_proj", "w2", "proj", "c_proj", "fc2")
_NORMS = ("attn_norm", "mlp_norm", "input_layernorm", "post_attention_layernorm",
          "attention_norm", "ffn_norm", "ln_1", "ln_2", "self_attn_layer_norm",
          "final_layer_norm")
_EMBEDDINGS = ("tok_emb", "embed_tokens", "tok_embeddings", "wte")
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
    return [n for n in names if isinstance(getattr(module, n, None), nn.Linear)]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _block_roles(prefix: str, block: nn.Module) -> dict[str, Role]:
    roles: dict[str, Role] = {}
    mlp = _child(block, _MLP)
    if mlp is None and _linears(block, _COLWISE_MLP) and len(_linears(block, _ROWWISE_MLP)) == 1:
        mlp = ("", block)  # the MLP's linears on the block itself (OPT's fc1 / fc2)
    for found, colwise, rowwise in ((_child(block, _ATTN), COLWISE_ATTN, _ROWWISE_ATTN),
                                    (mlp, _COLWISE_MLP, _ROWWISE_MLP)):
        if found is None:
            continue
        name, module = found
        cols, rows = _linears(module, colwise), _linears(module, rowwise)
        if not name:  # no module between the linears: the colwise ones gather the input
            roles.update({_join(prefix, c): "colwise" for c in cols})
            roles[_join(prefix, rows[0])] = "rowwise"
            continue
        if not cols or len(rows) != 1:  # fused qkv (GPT) or an unknown layout
            roles[_join(prefix, name)] = "replicated"
            continue
        for col in cols:
            roles[_join(prefix, f"{name}.{col}")] = "colwise"
        roles[_join(prefix, f"{name}.{rows[0]}")] = "rowwise"
        roles[_join(prefix, name)] = "gather"
    for norm in _NORMS:
        if isinstance(getattr(block, norm, None), nn.Module):
            roles[_join(prefix, norm)] = "norm"
    return roles


def tp_roles(model: nn.Module, *, sequence_parallel: bool = False,
             api: str = API) -> dict[str, Role]:
    """Each module tensor parallelism touches, by qualified name, and how.

    ``"colwise"`` / ``"rowwise"``: a linear split by output / input features;
    ``"embedding"``: the vocabulary-sharded token embedding; ``"head"``: the LM head
    (colwise, logits gathered); ``"norm"``: a norm (sequence-sharded with SP, else
    untouched); ``"gather"``: an attention or MLP module between its colwise and
    rowwise linears, whose input SP all-gathers; ``"replicated"``: a sub-layer left
    whole (GPT's fused-qkv attention), whose input SP gathers and whose output it
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
        api: the public call named in errors. Default: ``"remat.simulate.tp_rank_bytes"``.

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
    if "colwise" not in roles.values():
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
    head = _child(modules[parent], _HEADS)
    head_prefix = parent
    if head is None and parent:
        head, head_prefix = _child(model, _HEADS), ""
    tied = emb is not None and head is not None and \
        getattr(emb[1], "weight", None) is getattr(head[1], "weight", object())
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
