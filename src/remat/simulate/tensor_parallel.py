"""Per-rank bytes under tensor (and sequence) parallelism, from a one-device simulation.

Which module TP splits how (its *role*) is found by module names here, below the
integration that turns roles into DTensor styles (``remat.integrations.tp``), so the
simulation and the real run read the same plan (NOTE [ TP plan by module names ] there).

NOTE [ Tensor-parallel bytes per rank ]
    With ``t`` tensor-parallel ranks (all bytes of one rank; rank 0, which holds the
    largest shard when a dimension does not divide):

    * Parameters, gradients, optimizer state: colwise linears keep ``ceil(out/t)``
      rows of the weight (and bias), rowwise linears ``ceil(in/t)`` columns (the bias
      whole), the vocabulary-sharded embedding ``ceil(V/t)`` rows; norms and anything
      TP leaves alone stay whole. Gradients and optimizer state follow their parameter.
    * Activations (what is saved for backward): the one-device simulated step is
      tracked with every module of the plan as an attribution unit, so each saved
      byte belongs to the innermost module that created it, and is split by role:

      - between the column- and row-parallel linears (the colwise linears' outputs,
        and what the attention / MLP module itself computes on them: RoPE, SDPA,
        SiLU x up): ``/ t``, since each rank holds ``n_head / t`` heads and
        ``d_ff / t`` columns;
      - the residual stream (block-level ops, a checkpointed block's saved input,
        the rowwise outputs, the norms, the embedding's output): whole without
        sequence parallelism (each rank holds the replicated tensor), ``/ t`` with it;
      - with sequence parallelism each gathered input (attention, MLP, head) is
        saved *whole* by the colwise linears that read it (PyTorch's
        ``PrepareModuleInput`` all-gathers and autograd keeps the result), where one
        device saved the norm's output: a norm's output is counted whole instead
        of ``/ t``;
      - the rest (the head's logits, which ``ColwiseParallel(output_layouts=
        Replicate())`` all-gathers, RoPE tables, the loss): whole.

      This is Korthikanti et al. 2022's split (TP: ``sbh(10 + 24/t + 5as/(ht))``,
      TP+SP: ``sbh/t (34 + 5as/h)``) applied to what remat's simulation counts for the
      actual layer, with one difference: Megatron re-gathers the sequence-parallel
      input in backward instead of saving it, PyTorch's SP saves it (``2 sbh`` per
      layer at 16 bits on top of their TP+SP figure).
    * Recomputed tensors alive at the peak are split like what the blocks' forwards
      save without checkpointing (one more simulated step, with ``"none"``):
      recomputation re-runs a block's forward. The rest of the peak (backward
      temporaries) is scaled by the activations' ratio (per-rank / one-device).
    Not modelled: the embedding's per-rank input mask (``b s`` bytes of bool and
    the shifted ids), gloo/NCCL buffers, DTensor's transient redistribution copies.
    tests/integrations/test_tp.py compares these figures with the tracker and the CPU
    allocator on 2 gloo ranks.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import nn

from remat.errors import RematError, RematWarning, message

Role = Literal["colwise", "rowwise", "embedding", "head", "norm", "gather", "replicated"]

_ATTN = ("attn", "self_attn", "attention")
_MLP = ("mlp", "feed_forward")
COLWISE_ATTN = ("q_proj", "k_proj", "v_proj", "wq", "wk", "wv")
_ROWWISE_ATTN = ("o_proj", "wo")
_COLWISE_MLP = ("gate_proj", "up_proj", "w1", "w3", "fc", "c_fc")
_ROWWISE_MLP = ("down_proj", "w2", "proj", "c_proj")
_NORMS = ("attn_norm", "mlp_norm", "input_layernorm", "post_attention_layernorm",
          "attention_norm", "ffn_norm", "ln_1", "ln_2")
_EMBEDDINGS = ("tok_emb", "embed_tokens", "tok_embeddings", "wte")
_FINAL_NORMS = ("norm", "ln_f")
_HEADS = ("lm_head", "output")
API = "remat.simulate.tp_rank_bytes"


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
    for found, colwise, rowwise in ((_child(block, _ATTN), COLWISE_ATTN, _ROWWISE_ATTN),
                                    (_child(block, _MLP), _COLWISE_MLP, _ROWWISE_MLP)):
        if found is None:
            continue
        name, module = found
        cols, rows = _linears(module, colwise), _linears(module, rowwise)
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
    re-shards. ``sequence_parallel`` only decides whether an embedding tied to the
    head is an error. See NOTE [ TP plan by module
    names ] in remat/integrations/tp.py.

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
            fix="build a plan yourself (ColwiseParallel / RowwiseParallel per linear) and "
                "call torch.distributed.tensor.parallel.parallelize_module"))
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
    if role in ("rowwise", "norm", "embedding", None):  # None: block-level (residual)
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


def _saved_by_unit(setup: Any, strategy: str, batch_size: int, seq_len: int,
                   roles: dict[str, Role]) -> tuple[Any, dict[str, int], Any]:
    """One simulated step with every role module as an attribution unit; the tracker and
    each norm's output bytes, and the warmed-up (fake) optimizer."""
    from remat.blocks import named_blocks
    from remat.measure.profile import WarmFake
    from remat.measure.step import Step, clear_grads
    from remat.measure.tracked_step import tracked_step
    from remat.simulate._setup import Autocast
    from remat.strategies import apply, remove

    batch = setup.batch_fn(batch_size, seq_len)
    warm = WarmFake(Step(setup.model, batch, loss_fn=setup.loss_fn,
                         optimizer=setup.optimizer, blocks=setup.blocks), batch, prepare=remove)
    inner = warm.model.model if isinstance(warm.model, Autocast) else warm.model
    apply(inner, strategy)
    modules = dict(inner.named_modules())
    blocks = [n for n, _ in named_blocks(inner, None, api=API)]
    units = [(n, modules[n]) for n in sorted(set(roles) | set(blocks), key=len)]
    norm_out: dict[str, int] = {}

    def record(name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(_module: nn.Module, _args: Any, out: Any) -> None:
            norm_out.setdefault(name, out.untyped_storage().nbytes())
        return hook

    handles = [modules[n].register_forward_hook(record(n))
               for n, r in roles.items() if r == "norm"]
    try:
        fstep = warm._step(batch)
        with warm.mode, warnings.catch_warnings():
            # the attribution hooks inside checkpointed regions fire again in recompute
            # by design (the tracker attributes recompute to the block in backward)
            warnings.simplefilter("ignore", RematWarning)
            clear_grads(warm.model)
            tracked = tracked_step(fstep, units)
    finally:
        for h in handles:
            h.remove()
    return tracked, norm_out, warm.optimizer


def _recompute_split(setup: Any, strategy: str, batch_size: int, seq_len: int,
                     roles: dict[str, Role], blocks: list[str], tp: int,
                     sequence_parallel: bool) -> tuple[int, int]:
    """``(per-rank, one-device)`` bytes that the blocks' forwards save without
    checkpointing: recomputation re-runs a block's forward, so what it saves splits like
    that (NOTE [ Tensor-parallel bytes per rank ], recomputed tensors)."""
    tracked, norm_out, _ = _saved_by_unit(setup, "none", batch_size, seq_len, roles)
    inside = {unit: nbytes for unit, nbytes in tracked.tracker.block_saved_bytes.items()
              if any(unit == b or unit.startswith(b + ".") for b in blocks)}
    whole = sum(inside.values())
    return split_activations(inside, roles, blocks, norm_out, total_bytes=whole, t=tp,
                             sequence_parallel=sequence_parallel), whole


def _moment_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the optimizer's per-element state (not the scalar step counters)."""
    if optimizer is None:
        return 0
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def tp_rank_bytes(model: Any, *, seq_len: int, batch_size: int, tp: int,
                  sequence_parallel: bool = False, strategy: str = "none",
                  dtype: str = "bf16", optimizer: str = "adamw") -> TPRankBytes:
    """One tensor-parallel rank's parameter, gradient, optimizer, activation and peak bytes.

    Simulates the step once on one device (fake tensors, nothing allocated) and
    splits its bytes by what tensor parallelism shards (NOTE [ Tensor-parallel bytes
    per rank ]): cheap (one step whatever ``tp``), but an arithmetic model of the
    parallel step, not a simulation of it (collective buffers are not counted).

    Args:
        model: a preset name, a factory (called on the meta device) or a module.
        seq_len: tokens per sequence.
        batch_size: sequences per micro-batch (every TP rank runs the whole micro-batch).
        tp: tensor-parallel degree, >= 1.
        sequence_parallel: sequence-shard norms and the residual stream. Default: ``False``.
        strategy: remat strategy applied to the blocks. Default: ``"none"``.
        dtype: precision (see :data:`remat.simulate.PRECISIONS`). Default: ``"bf16"``.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"`` or ``"none"``. Default: ``"adamw"``.

    Returns:
        A :class:`TPRankBytes`.

    Raises:
        ValueError: ``tp`` or the sizes are not positive ints.
        RematError: the model has no block the tensor-parallel plan recognises.

    Example:
        >>> r = tp_rank_bytes("llama-7b", seq_len=4096, batch_size=1, tp=8,
        ...                   sequence_parallel=True)  # doctest: +SKIP
        >>> r.activation_bytes < r.device_activation_bytes  # doctest: +SKIP
        True
    """
    from remat.devices import get_device
    from remat.simulate._setup import build_model, check_ints, make_setup
    from remat.simulate.precision import get_precision

    check_ints(API, "seq_len, batch_size and tp", (seq_len, batch_size, tp))
    inner, _ = build_model(model, seq_len)
    setup = make_setup(inner, precision=get_precision(dtype), optimizer=optimizer,
                       device=get_device("h100-80gb"), world_size=1, sharding="none",
                       blocks=None, loss_fn=None, batch_fn=None)
    roles = tp_roles(inner, sequence_parallel=sequence_parallel)
    tracked, norm_out, fake_optimizer = _saved_by_unit(setup, strategy, batch_size, seq_len, roles)
    tracker = tracked.tracker
    from remat.blocks import named_blocks

    blocks = [n for n, _ in named_blocks(inner, None, api=API)]
    activations = tracker.activation_bytes
    rank_act = split_activations(tracker.block_saved_bytes, roles, blocks, norm_out,
                                 total_bytes=activations, t=tp,
                                 sequence_parallel=sequence_parallel)
    grads = rank_param_bytes(inner, roles, 1, gradients=True)
    rank_params = rank_param_bytes(inner, roles, tp)
    rank_grads = rank_param_bytes(inner, roles, tp, gradients=True)
    state = tracked.static.get("optimizer_state", 0)
    # SGD's momentum is a clone of the gradient (its layout); Adam's moments are
    # zeros_like(param) (the parameter's layout); step counters are whole.
    like = rank_grads if optimizer.lower() == "sgd" else rank_params
    moments = _moment_bytes(fake_optimizer)
    rank_state = state - moments + (_shard(moments * like, grads) if grads else 0)
    at_peak = tracker.peak_breakdown
    by_grads = ("grads", "optimizer_state", "optimizer")  # follow the parameter shards
    by_acts = ("forward", "backward", "recompute")  # follow the activation split
    rank_peak = rank_params + sum(v for k, v in at_peak.items()
                                  if k not in by_grads + by_acts + ("params",))
    for kind in by_grads:
        rank_peak += _shard(at_peak.get(kind, 0) * rank_grads, grads) if grads else 0
    recompute_ratio = _recompute_split(setup, strategy, batch_size, seq_len, roles, blocks,
                                       tp, sequence_parallel) if at_peak.get("recompute") \
        else None
    for kind in by_acts:
        value = at_peak.get(kind, 0)
        if kind == "recompute" and recompute_ratio is not None and recompute_ratio[1]:
            rank_peak += _shard(value * recompute_ratio[0], recompute_ratio[1])
            continue
        rank_peak += _shard(value * rank_act, activations) if activations else value
    return TPRankBytes(
        tp=tp, sequence_parallel=sequence_parallel, param_bytes=rank_params,
        grad_bytes=rank_grads, optimizer_bytes=rank_state, activation_bytes=rank_act,
        peak_bytes=rank_peak, device_activation_bytes=activations,
        device_peak_bytes=tracker.peak_bytes)
