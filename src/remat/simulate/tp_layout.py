"""The DTensor layout of tensor (and sequence) parallelism: module name -> ParallelStyle.

Below the integration (``remat.integrations.tp``, which documents the plan in NOTE [ TP
plan by module names ]) so that the per-rank simulation
(:mod:`remat.simulate.tensor_parallel`) parallelizes its fake copy with the very styles a
real run gets.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from remat.errors import RematError, message
from remat.simulate.tp_roles import Role, attention_modules, tp_roles

HEAD_COUNTS = ("n_head", "n_kv_head", "num_heads", "num_key_value_heads")


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
          gathers_input: bool = False, scattered_later: bool = False) -> Any:
    """The DTensor style of one role (None: nothing to do without sequence parallelism).

    ``gathers_input``: a colwise linear with no ``"gather"`` module above it, which
    all-gathers its own sequence-sharded input under SP. ``scattered_later``: the
    embedding's output stays whole because a ``"scatter"`` block shards the stream.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    shard = Shard(SEQ_DIM)
    seq = shard if sequence_parallel else Replicate()
    if role == "colwise":
        return ColwiseParallel(input_layouts=seq) if gathers_input else ColwiseParallel()
    if role == "rowwise":
        return RowwiseParallel(output_layouts=seq)
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


def build_plan(model: nn.Module, *, sequence_parallel: bool, api: str) -> dict[str, Any]:
    """Module name -> ParallelStyle for ``model`` (see ``remat.integrations.tp.tp_plan``)."""
    modules = dict(model.named_modules())
    roles = tp_roles(model, sequence_parallel=sequence_parallel, api=api)
    scattered = "scatter" in roles.values()
    plan: dict[str, Any] = {}
    for name, role in roles.items():
        gathers = role == "colwise" and roles.get(name.rpartition(".")[0]) != "gather"
        found = style(role, modules[name], sequence_parallel, gathers_input=gathers,
                      scattered_later=scattered)
        if found is not None:
            plan[name] = found
    return plan


def divide_head_counts(model: nn.Module, tp: int, *, api: str) -> None:
    """Divide each attention module's head-count attributes by ``tp`` (their ``view`` uses
    them), refusing a count ``tp`` does not divide."""
    modules = dict(model.named_modules())
    for name in attention_modules(tp_roles(model, api=api)):
        attn = modules[name]
        for attr in HEAD_COUNTS:
            count = getattr(attn, attr, None)
            if isinstance(count, int) and not isinstance(count, bool):
                if count % tp:
                    raise RematError(message(
                        api, f"{name}.{attr}={count} is not divisible by the TP degree {tp}",
                        fix="pick a TP degree dividing the number of (key/value) heads"))
                setattr(attn, attr, count // tp)


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


def _divide_user_head_counts(model: nn.Module, plan: dict[str, Any], tp: int, *,
                             api: str) -> None:
    """Divide the head counts of each module (not the root) holding a colwise linear of
    ``plan``."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    modules = dict(model.named_modules())
    parents = sorted({n.rpartition(".")[0] for n, s in plan.items()
                      if isinstance(s, ColwiseParallel) and n.rpartition(".")[0]})
    for name in parents:
        attn = modules[name]
        for attr in HEAD_COUNTS:
            count = getattr(attn, attr, None)
            if isinstance(count, int) and not isinstance(count, bool):
                if count % tp:
                    raise RematError(message(
                        api, f"{name}.{attr}={count} is not divisible by the TP degree {tp}",
                        fix="pick a TP degree dividing the number of (key/value) heads"))
                setattr(attn, attr, count // tp)


def parallelize(model: nn.Module, mesh: Any, *, sequence_parallel: bool, api: str,
                tp_plan: dict[str, Any] | None = None) -> None:
    """:func:`build_plan` (or the user's ``tp_plan``, :func:`resolve_plan`),
    :func:`divide_head_counts` and ``parallelize_module``, in place."""
    from torch.distributed.tensor.parallel import parallelize_module

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
        _divide_user_head_counts(model, plan, mesh.size(), api=api)
    else:
        plan = build_plan(model, sequence_parallel=sequence_parallel, api=api)
        divide_head_counts(model, mesh.size(), api=api)
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
                "modules (a transposed Conv1D needs its own ParallelStyle)")) from error
