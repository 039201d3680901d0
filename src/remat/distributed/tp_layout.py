"""The DTensor layout of tensor (and sequence) parallelism: module name -> ParallelStyle.

Below the integration (``remat.integrations.tp``, which documents the plan in NOTE [ TP
plan by module names ]) so that the per-rank simulation
(:mod:`remat.distributed.tensor_parallel`) parallelizes its fake copy with the very styles a
real run gets.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from remat.distributed.tp_roles import Role, attention_modules, tp_roles
from remat.errors import RematError, message

HEAD_COUNTS = ("n_head", "n_kv_head", "num_heads", "num_key_value_heads", "num_kv_heads",
               "n_query_groups", "num_attention_heads")
#: Widths a fused projection's forward splits its output by (GPT-2's, Falcon's).
SPLIT_WIDTHS = ("split_size",)


def _positional_inputs(module: nn.Module) -> int:
    """Required positional inputs of ``module.forward`` (PrepareModuleInput wants them all)."""
    import inspect

    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = inspect.signature(module.forward).parameters.values()
    return max(1, sum(p.kind in kinds and p.default is inspect.Parameter.empty for p in params))


def _called_by_keyword(module: nn.Module) -> bool:
    """Hugging Face decoders call attention by keyword (``self_attn(hidden_states=...)``)."""
    return type(module).__module__.startswith("transformers.") and \
        type(module).__name__.endswith("Attention")


#: The sequence (token) dimension SP shards: second from last, before the hidden size, so
#: a block that flattens batch and sequence into one dimension before its MLP (OPT) stays
#: sharded by tokens (DTensor normalizes the negative dimension per tensor).
SEQ_DIM = -2


def style(role: Role, module: nn.Module, sequence_parallel: bool, *,
          gathers_input: bool = False, scattered_later: bool = False,
          sections: tuple[int, ...] | None = None, in_place_safe: bool = False) -> Any:
    """The DTensor style of one role (None: nothing to do without sequence parallelism).

    ``gathers_input``: a colwise linear with no ``"gather"`` module above it, which
    all-gathers its own sequence-sharded input under SP. ``scattered_later``: the
    embedding's output stays whole because a ``"scatter"`` block shards the stream.
    ``sections``: a fused projection's parts (NOTE [ Fused projections ] in tp_fused.py).
    ``in_place_safe``: a rowwise linear's output may be changed in place (NOTE [ Rowwise
    outputs changed in place ] in tp_fused.py).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    from remat.distributed.tp_fused import ColwiseProjection, RowwiseProjection

    shard = Shard(SEQ_DIM)
    seq = shard if sequence_parallel else Replicate()
    if role in ("colwise", "fused"):
        layouts = seq if gathers_input else None
        if isinstance(module, nn.Linear) and sections is None:
            return ColwiseParallel(input_layouts=layouts)
        return ColwiseProjection(sections=sections, input_layouts=layouts)
    if role == "rowwise":
        plain = isinstance(module, nn.Linear) and not in_place_safe
        return RowwiseParallel(output_layouts=seq) if plain else \
            RowwiseProjection(output_layouts=seq)
    if role == "embedding":
        return RowwiseParallel(input_layouts=Replicate(),
                               output_layouts=Replicate() if scattered_later else seq)
    if role == "head":
        return ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    if not sequence_parallel:
        return None
    if role == "norm":
        return SequenceParallel(sequence_dim=SEQ_DIM)
    if role == "gather" and _called_by_keyword(module):
        return PrepareModuleInput(input_kwarg_layouts={"hidden_states": shard},
                                  desired_input_kwarg_layouts={"hidden_states": Replicate()})
    rest = (None,) * (_positional_inputs(module) - 1)
    if role == "gather":
        return PrepareModuleInput(input_layouts=(shard, *rest),
                                  desired_input_layouts=(Replicate(), *rest))
    if role == "scatter":  # Megatron's scatter_to_sequence_parallel_region
        return PrepareModuleInput(input_layouts=(Replicate(), *rest),
                                  desired_input_layouts=(shard, *rest), use_local_output=True)
    return PrepareModuleInputOutput(  # "replicated": gather in, shard out
        input_layouts=(shard, *rest), desired_input_layouts=(Replicate(), *rest),
        output_layouts=(Replicate(),), desired_output_layouts=(shard,))


def fused_of(model: nn.Module, roles: dict[str, Role], *, api: str,
             sequence_parallel: bool = False) -> dict[str, tuple[tuple[int, ...], int]]:
    """The fused projections among ``roles`` and their layouts (NOTE [ Fused projections ]
    in tp_fused.py): name -> (sections, unit). Refuses sequence parallelism with them:
    their attention modules (GPT-2's, GPT-NeoX's, Falcon's) take the hidden states
    positionally or by keyword in ways remat's gather does not know."""
    from remat.distributed.tp_fused import fused_layouts, linear_shape

    modules = dict(model.named_modules())
    fused: dict[str, int] = {}
    for name, role in roles.items():
        if role == "fused" and sequence_parallel:
            raise RematError(message(
                api, "sequence parallelism with a fused QKV projection is not modelled",
                {"fused": name},
                fix="drop sequence_parallel (--sp), or pass tp_plan= (--tp-plan) with your "
                    "own SequenceParallel / PrepareModuleInput entries"))
        if role == "fused":
            parent = name.rpartition(".")[0]
            row = next(n for n, r in roles.items()
                       if r == "rowwise" and n.rpartition(".")[0] == parent)
            fused[name] = linear_shape(modules[row])[0]  # type: ignore[index]
    return fused_layouts(model, fused, api=api)


def check_degree(model: nn.Module, roles: dict[str, Role],
                 fused: dict[str, tuple[tuple[int, ...], int]], tp: int, *, api: str) -> None:
    """Refuse a degree ``tp`` that cannot give each rank whole heads: of every part of a
    fused projection, and of each colwise linear in a module with a head width (one
    key/value head of 12 cannot be split 2 ways)."""
    from remat.distributed.tp_fused import check_fused, head_width, linear_shape

    check_fused(fused, tp, api=api)
    modules = dict(model.named_modules())
    for name, role in roles.items():
        parent = name.rpartition(".")[0]
        shape = linear_shape(modules[name])
        if role != "colwise" or not parent or shape is None:
            continue
        head = head_width(modules[parent])
        if head is not None and shape[1] % head == 0 and shape[1] % (tp * head):
            raise RematError(message(
                api, f"{name}'s {shape[1] // head} heads cannot be split {tp} ways",
                {"output width": shape[1], "head width": head},
                fix="pick a TP degree dividing the number of (key/value) heads, or pass "
                    "tp_plan= (--tp-plan) leaving this attention whole"))


def build_plan(model: nn.Module, *, sequence_parallel: bool, api: str,
               roles: dict[str, Role] | None = None,
               fused: dict[str, tuple[tuple[int, ...], int]] | None = None) -> dict[str, Any]:
    """Module name -> ParallelStyle for ``model`` (see ``remat.integrations.tp.tp_plan``);
    ``roles`` / ``fused``: already found (default: found here)."""
    modules = dict(model.named_modules())
    if roles is None:
        roles = tp_roles(model, sequence_parallel=sequence_parallel, api=api)
    if fused is None:
        fused = fused_of(model, roles, api=api, sequence_parallel=sequence_parallel)
    scattered = "scatter" in roles.values()
    plan: dict[str, Any] = {}
    for name, role in roles.items():
        gathers = role in ("colwise", "fused") and \
            roles.get(name.rpartition(".")[0]) != "gather"
        found = style(role, modules[name], sequence_parallel, gathers_input=gathers,
                      scattered_later=scattered,
                      sections=fused[name][0] if name in fused else None,
                      in_place_safe=bool(fused))
        if found is not None:
            plan[name] = found
    return plan


def _divide(owner: Any, where: str, attrs: tuple[str, ...], tp: int, api: str) -> None:
    """Divide ``owner``'s int attributes named in ``attrs`` by ``tp``, refusing a count
    ``tp`` does not divide."""
    aliases = getattr(owner, "attribute_map", None) or {}  # a Hugging Face config's
    for attr in attrs:
        if attr in aliases:  # another name of an attribute divided once already
            continue
        count = getattr(owner, attr, None)
        if isinstance(count, int) and not isinstance(count, bool):
            if count % tp:
                raise RematError(message(
                    api, f"{where}.{attr}={count} is not divisible by the TP degree {tp}",
                    fix="pick a TP degree dividing the number of (key/value) heads, or pass "
                        "tp_plan= (--tp-plan) leaving this attention whole"))
            setattr(owner, attr, count // tp)


def divide_head_counts(model: nn.Module, names: list[str], tp: int, *, api: str,
                       fused: tuple[str, ...] = ()) -> None:
    """Divide the head-count attributes of the modules ``names`` by ``tp`` (their ``view``
    uses them), refusing a count ``tp`` does not divide. A module among ``fused`` (one
    holding a fused projection) also gets its split widths divided and its own copy of
    its ``config`` with per-rank head counts (litgpt reads the counts there; the copy
    leaves the rest of the model's config alone)."""
    import copy

    modules = dict(model.named_modules())
    for name in names:
        module = modules[name]
        _divide(module, name, HEAD_COUNTS, tp, api)
        if name not in fused:
            continue
        _divide(module, name, SPLIT_WIDTHS, tp, api)
        config = getattr(module, "config", None)
        if config is not None and any(isinstance(getattr(config, a, None), int)
                                      for a in HEAD_COUNTS):
            config = copy.copy(config)
            _divide(config, f"{name}.config", HEAD_COUNTS, tp, api)
            module.config = config


def resolve_plan(model: nn.Module, tp_plan: dict[str, Any], *, api: str) -> dict[str, Any]:
    """The user's ``parallelize_module``-style plan with every key a qualified name
    (NOTE [ A user's TP plan ] in remat/integrations/tp.py): a key naming a module of the
    root stays; any other key is block-relative and repeats under every block found by
    :func:`remat.find_blocks`, which must each hold it."""
    from remat.blocks import named_blocks

    if not isinstance(tp_plan, dict) or not tp_plan or \
            not all(isinstance(k, str) for k in tp_plan):
        raise RematError(message(
            api, "tp_plan is not a non-empty dict from module names to ParallelStyles",
            {"got": type(tp_plan).__name__},
            fix='pass e.g. {"attn.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}'))
    from torch.distributed.tensor.parallel.style import ParallelStyle

    modules = dict(model.named_modules())
    blocks: list[tuple[str, nn.Module]] | None = None
    plan: dict[str, Any] = {}
    for key, found_style in tp_plan.items():
        if not isinstance(found_style, ParallelStyle):
            raise RematError(message(
                api, f"tp_plan[{key!r}] is not a ParallelStyle",
                {"got": type(found_style).__name__},
                fix="use ColwiseParallel(), RowwiseParallel(), SequenceParallel(), ... from "
                    "torch.distributed.tensor.parallel"))
        if key in modules:
            plan[key] = found_style
            continue
        if blocks is None:
            blocks = named_blocks(model, None, api=api)
        missing = [n for n, b in blocks if key not in dict(b.named_modules())]
        if missing or not blocks:
            raise RematError(message(
                api, f"tp_plan's key {key!r} names no module of the model nor of every block",
                {"blocks": f"{len(blocks)} ({blocks[0][0]}, ...)" if blocks else "none",
                 "blocks without it": ", ".join(missing[:3]) or "-",
                 "a block's modules with weights": ", ".join(_weighted(blocks[0][1]))
                     if blocks else "-"},
                fix="name a module of the root (e.g. 'lm_head') or one every block holds, "
                    "relative to the block (e.g. 'mlp.c_fc')"))
        for name, _ in blocks:
            plan[f"{name}.{key}"] = found_style
    return plan


def _weighted(block: nn.Module) -> list[str]:
    """Names of ``block``'s modules holding parameters themselves (at most 12)."""
    return [n for n, m in block.named_modules()
            if n and next(m.parameters(recurse=False), None) is not None][:12]


def parallelize(model: nn.Module, mesh: Any, *, sequence_parallel: bool, api: str,
                tp_plan: dict[str, Any] | None = None) -> None:
    """:func:`build_plan` (or the user's ``tp_plan``, :func:`resolve_plan`),
    :func:`divide_head_counts` and ``parallelize_module``, in place."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from remat.distributed.tp_fused import check_fused

    if mesh.ndim != 1:
        raise RematError(message(api, f"the mesh has {mesh.ndim} dimensions",
                                 fix="pass the tensor-parallel sub-mesh, e.g. mesh['tp']"))
    if tp_plan is not None:
        if sequence_parallel:
            raise RematError(message(
                api, "sequence_parallel with tp_plan", {"why": "the plan holds its own "
                "sequence-parallel styles (SequenceParallel, PrepareModuleInput)"},
                fix="drop sequence_parallel (put SequenceParallel() entries in tp_plan)"))
        plan = resolve_plan(model, tp_plan, api=api)
        # the modules (not the root) holding a colwise linear of the plan
        parents = sorted({n.rpartition(".")[0] for n, s in plan.items()
                          if isinstance(s, ColwiseParallel) and n.rpartition(".")[0]})
        divide_head_counts(model, parents, mesh.size(), api=api)
    else:
        roles = tp_roles(model, sequence_parallel=sequence_parallel, api=api)
        fused = fused_of(model, roles, api=api, sequence_parallel=sequence_parallel)
        check_fused(fused, mesh.size(), api=api)  # before the counts: its error says more
        plan = build_plan(model, sequence_parallel=sequence_parallel, api=api, roles=roles,
                          fused=fused)
        holders = tuple(sorted({n.rpartition(".")[0] for n in fused}))
        divide_head_counts(model, [*attention_modules(roles), *holders], mesh.size(),
                           api=api, fused=holders)
        check_degree(model, roles, fused, mesh.size(), api=api)
    try:
        parallelize_module(model, mesh, plan)
    except (NotImplementedError, ValueError, TypeError) as error:
        if tp_plan is None:
            raise
        modules = dict(model.named_modules())
        raise RematError(message(
            api, "parallelize_module refuses tp_plan on this model",
            {"error": str(error).strip().splitlines()[-1][:200],
             "planned classes": ", ".join(sorted({type(modules[n]).__name__ for n in plan
                                                  if n in modules}))},
            fix="give ColwiseParallel / RowwiseParallel only nn.Linear and nn.Embedding "
                "modules; a transposed Conv1D (GPT-2's) takes ColwiseProjection / "
                "RowwiseProjection from remat.integrations.tp")) from error
