"""Fused projections and transposed linears under tensor parallelism.

NOTE [ Fused projections ]
    A sub-layer whose colwise side is one linear wider than its rowwise linear's input
    is *fused*: the one matmul computes q, k and v (GPT-2's ``c_attn``, GPT-NeoX's and
    Falcon's ``query_key_value``, litgpt's ``qkv``) or gate and up (``gate_up_proj``),
    and the forward splits its output. A plain column shard of a fused ``[q|k|v]``
    weight is wrong (rank 0 would get all of q): each rank must get whole heads of
    every part, and where the parts sit in the output decides the shard. Shapes alone
    do not tell (GPT-2 and GPT-NeoX have the same ``(3h, h)`` weight, ``[q|k|v]`` in one
    and ``[q k v]`` per head in the other), so :func:`fused_layouts` reads it from the
    model: one forward of a fake copy on a one-sequence batch, watching the first op
    on each fused projection's output (stopped once every one is seen):

    - a split of the last dimension into sizes ``(a, b, c)``, or a slice of its first
      ``q`` columns (the rowwise input's width; Phi-3): *sections*, each split ``t``
      ways, rank ``r`` keeping the ``r``-th part of every section;
    - a view of the last dimension into ``(A, *rest)`` with ``rest`` one head: ``A``
      lists heads, ``[q heads | k heads | v heads]``: sections by head counts (Falcon's
      multi-query layout);
    - a view into ``(A, *rest)`` with ``rest`` more than one head: ``A`` lists groups,
      each holding its own q, k and v heads (GPT-NeoX, Falcon's grouped layout): a plain
      contiguous shard over the groups.

    Anything else, or a part with fewer heads than ``t`` (one key/value head), is
    refused with the fix (``tp_plan=``). :class:`ColwiseProjection` shards a sectioned
    weight with DTensor by reordering its output rows rank-major (``[q_0 k_0 v_0 | q_1
    k_1 v_1]``) before ``Shard``: each rank's local output is ``[q_r | k_r | v_r]``, which
    the forward's split reads once its width attributes are per-rank
    (:func:`remat.distributed.tp_layout.divide_head_counts`). The DTensor's global view is
    in that order: ``full_tensor()`` of the weight or its gradient is the reordered
    weight; :func:`natural_order` puts it back.

NOTE [ Transposed linears ]
    Hugging Face's ``Conv1D`` (GPT-2) is a linear whose weight is ``(in, out)``:
    :func:`linear_shape` finds it by its ``nf`` (output features) matching the weight's
    second dimension, and :class:`ColwiseProjection` / :class:`RowwiseProjection` shard
    its output / input dimension where ``ColwiseParallel`` / ``RowwiseParallel`` refuse
    anything but ``nn.Linear``. Its ``addmm`` then runs on DTensors as a linear does.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils._python_dispatch import TorchDispatchMode

from remat.errors import RematError, message
from remat.measure.dispatch_modes import direct_dispatch

#: Attributes holding a head's width, on an attention module or its ``config``.
HEAD_WIDTHS = ("head_dim", "head_size")


def linear_shape(module: nn.Module) -> tuple[int, int, int] | None:
    """``(in_features, out_features, output dimension of the weight)`` of a linear
    (``nn.Linear``: 0) or a transposed linear (Hugging Face's ``Conv1D``: 1, NOTE
    [ Transposed linears ]); None for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, 0
    weight = getattr(module, "weight", None)
    nf = getattr(module, "nf", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and nf == weight.shape[1]:
        return int(weight.shape[0]), int(weight.shape[1]), 1
    return None


def _parts(size: int, sections: Sequence[int], t: int) -> list[int]:
    """Widths of the pieces in rank-major order: every section's ``r``-th ``1/t``, then the
    next rank's."""
    return [s // t for _ in range(t) for s in sections]


def rank_major(tensor: torch.Tensor, dim: int, sections: Sequence[int], t: int) -> torch.Tensor:
    """``tensor`` with its ``dim`` reordered so that ``Shard(dim)`` over ``t`` ranks gives
    rank ``r`` the ``r``-th ``1/t`` of every section, in order (NOTE [ Fused projections ])."""
    pieces = [s.chunk(t, dim) for s in tensor.split(list(sections), dim)]
    return torch.cat([p[r] for r in range(t) for p in pieces], dim)


def natural_order(tensor: torch.Tensor, dim: int, sections: Sequence[int],
                  t: int) -> torch.Tensor:
    """The inverse of :func:`rank_major`: a fused weight's (or gradient's) ``full_tensor()``
    back in the model's own order.

    Example:
        >>> w = torch.arange(12.).view(12, 1)
        >>> bool((natural_order(rank_major(w, 0, (4, 4, 4), 2), 0, (4, 4, 4), 2) == w).all())
        True
    """
    pieces = tensor.split(_parts(tensor.shape[dim], sections, t), dim)
    n = len(sections)
    return torch.cat([pieces[r * n + i] for i in range(n) for r in range(t)], dim)


class ColwiseProjection(ColwiseParallel):
    """``ColwiseParallel`` for a linear or a transposed linear (NOTE [ Transposed linears ]),
    whose output may be a fused projection's sections (NOTE [ Fused projections ]).

    Args:
        sections: widths of the output's contiguous parts (e.g. ``(q, k, v)``), each
            split ``t`` ways; None: one part (a plain column shard). Default: None.
        input_layouts, output_layouts, use_local_output: as for ``ColwiseParallel``.
    """

    def __init__(self, *, sections: Sequence[int] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sections = tuple(sections) if sections is not None else None

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        shape = linear_shape(module)
        out_dim = shape[2] if shape is not None else 0
        t = device_mesh.size()
        for pname, param in list(module.named_parameters(recurse=False)):
            dim = out_dim if param.dim() == 2 else 0
            data = param if self.sections is None else \
                rank_major(param.detach(), dim, self.sections, t)
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(data, device_mesh, [Shard(dim)],
                                  src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if linear_shape(module) is None:
            return super()._apply(module, device_mesh)
        return distribute_module(  # type: ignore[no-any-return]
            module, device_mesh, self._partition_linear_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class _Fresh(torch.autograd.Function):
    """The same storage as a tensor that is not a view (NOTE [ Rowwise outputs changed in
    place ])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        if isinstance(x, AsyncCollectiveTensor):
            x = x.wait()
        return x.detach()  # an alias that autograd does not take for a view

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


# NOTE [ Rowwise outputs changed in place ]
#     DTensor's ``to_local()`` returns a view made inside a custom autograd Function, which
#     autograd forbids changing in place; Falcon's parallel block does exactly that to its
#     MLP's output (``mlp_output += attention_output``). :class:`RowwiseProjection` hands
#     back the all-reduced output as a tensor over the same storage that is not a view
#     (no copy, no extra bytes): nothing else holds that storage, so the in-place add is
#     safe. remat's layouts use it for the rowwise linears of models with a fused
#     projection (the Falcon family); llama-style models keep ``RowwiseParallel``.


class RowwiseProjection(RowwiseParallel):
    """``RowwiseParallel`` for a linear or a transposed linear (NOTE [ Transposed linears ]),
    whose local output may be changed in place (NOTE [ Rowwise outputs changed in place ]);
    arguments as for ``RowwiseParallel``."""

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module,
                           outputs: Any, device_mesh: Any) -> Any:
        out = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod,
                                                 outputs, device_mesh)
        return _Fresh.apply(out) if use_local_output else out

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        shape = linear_shape(module)
        in_dim = 1 - shape[2] if shape is not None else 1
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = Shard(in_dim) if param.dim() == 2 else Replicate()
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param, device_mesh, [placement],
                                  src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if linear_shape(module) is None:
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(  # type: ignore[no-any-return]
            module, device_mesh, self._partition_linear_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


# ---- the probe ---------------------------------------------------------------------------

class _AllSeen(Exception):
    """Every fused projection's first consumer is seen: the probe's forward stops."""


@direct_dispatch
class _FirstConsumer(TorchDispatchMode):
    """Records the first op whose first argument is a watched projection output."""

    def __init__(self, watched: dict[int, str], want: int) -> None:
        super().__init__()
        self.watched = watched
        self.want = want
        self.seen: dict[str, tuple[Any, tuple[Any, ...], torch.Size]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        first = args[0] if args else None
        name = self.watched.get(id(first)) if isinstance(first, torch.Tensor) else None
        metadata = getattr(func, "namespace", "") == "prim" or \
            str(getattr(func, "__name__", "")).startswith(("sym_", "is_", "dim"))
        if name is not None and name not in self.seen and not metadata:
            rest = (*args[1:], *(kwargs or {}).values())
            self.seen[name] = (func, rest, first.shape)  # type: ignore[union-attr]
            if len(self.seen) >= self.want:
                raise _AllSeen
        return func(*args, **(kwargs or {}))


def _first_consumers(model: nn.Module, names: Sequence[str], api: str
                     ) -> dict[str, tuple[Any, tuple[Any, ...], torch.Size]]:
    """The first op on each named module's output, from one forward of a fake copy."""
    from remat.measure.fake import fake_batch, fake_copy
    from remat.measure.fake_mode import new_fake_mode
    from remat.simulate.sim_setup import default_batch

    mode = new_fake_mode()
    fake = fake_copy(model, mode)
    modules = dict(fake.named_modules())
    watched: dict[int, str] = {}
    kept: list[torch.Tensor] = []  # the outputs stay alive: their ids stay theirs

    def hook(name: str, _m: nn.Module, _i: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            watched[id(out)] = name
            kept.append(out)

    for name in names:
        modules[name].register_forward_hook(partial(hook, name))
    watcher = _FirstConsumer(watched, len(names))
    try:
        batch = fake_batch(default_batch(model, 1, 8), mode)
    except ValueError as error:
        raise RematError(message(
            api, "cannot run the model once to see how it splits its fused projections",
            {"fused": ", ".join(names[:3]), "why": str(error).splitlines()[0]},
            fix="pass tp_plan= (NOTE [ A user's TP plan ]) naming the linears to shard")) \
            from error
    with mode, torch.no_grad():
        for call in (lambda: fake(**batch), lambda: fake(batch["input_ids"])):
            try:
                with watcher:
                    call()
            except _AllSeen:
                break
            except (TypeError, ValueError, RuntimeError):
                continue
            else:
                break
    return watcher.seen


def head_width(module: nn.Module) -> int | None:
    """A head's width, from ``module``'s attributes or its ``config``'s (None: not found)."""
    for owner in (module, getattr(module, "config", None)):
        for attr in HEAD_WIDTHS:
            value = getattr(owner, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _sections(consumer: tuple[Any, tuple[Any, ...], torch.Size] | None, q_width: int,
              head: int | None) -> tuple[tuple[int, ...], int] | None:
    """A fused projection's sections and the width each rank's share of a section must be
    a multiple of (a head, or a group of heads), from the first op on its output (NOTE
    [ Fused projections ]): ``((width,), group)`` for groups; None when the op is not
    understood."""
    if consumer is None:
        return None
    func, args, shape = consumer
    width, ndim = int(shape[-1]), len(shape)
    op = getattr(func, "__name__", str(func)).split(".")[0]
    if op in ("split", "split_with_sizes") and len(args) >= 1:
        dim = args[1] if len(args) > 1 else 0
        if dim % ndim != ndim - 1:
            return None
        if isinstance(args[0], int):
            return tuple(min(args[0], width - i) for i in range(0, width, args[0])), head or 1
        return tuple(int(s) for s in args[0]), head or 1
    if op == "slice" and len(args) >= 3 and args[0] % ndim == ndim - 1 and \
            not args[1] and args[2] == q_width and width > q_width:  # qkv[..., :q]
        kv = (width - q_width) // 2
        return ((q_width, kv, kv) if 2 * kv + q_width == width else
                (q_width, width - q_width)), head or 1
    if op in ("view", "_unsafe_view", "reshape") and args:
        new = [int(s) for s in args[0]]
        lead = list(shape[:-1])
        if new[:len(lead)] != lead:
            return None
        trailing = new[len(lead):]
        if -1 in trailing:
            rest = -int(torch.Size(trailing).numel())
            trailing[trailing.index(-1)] = width // rest
        if len(trailing) < 2 or int(torch.Size(trailing).numel()) != width:
            return None
        unit = int(torch.Size(trailing[1:]).numel())
        one_head = unit == head if head is not None else \
            (len(trailing) == 2 and q_width % unit == 0 and (width - q_width) % (2 * unit) == 0)
        if one_head:  # [q heads | k heads | v heads]
            kv = (width - q_width) // 2
            return ((q_width, kv, kv) if kv > 0 else (q_width,)), unit
        return (width,), unit
    return None


def fused_layouts(model: nn.Module, fused: dict[str, int], *,
                  api: str) -> dict[str, tuple[tuple[int, ...], int]]:
    """Each fused projection's output sections (NOTE [ Fused projections ]).

    Args:
        model: the model, not yet parallelized (any device).
        fused: the fused projections' qualified names -> the width of their sub-layer's
            rowwise input (q's width; for a fused MLP, one part's).
        api: the public call named in errors.

    Returns:
        Name -> (sections, unit): ``sections`` the output's parts (``(width,)`` for a plain
        shard over groups of heads), ``unit`` the width a rank's share of each part must
        be a multiple of (a head's or a group's; :func:`check_fused`).

    Raises:
        RematError: a layout the probe does not understand.
    """
    if not fused:
        return {}
    names = sorted(fused)
    consumers = _first_consumers(model, names, api)
    modules = dict(model.named_modules())
    out: dict[str, tuple[tuple[int, ...], int]] = {}
    for name in names:
        parent = modules[name.rpartition(".")[0]] if "." in name else model
        op = consumers.get(name)
        found = _sections(op, fused[name], head_width(parent))
        if found is None:
            raise RematError(message(
                api, f"remat cannot tell how {name}'s fused output is split into heads",
                {"first op on its output": getattr(op[0], "__name__", "none seen")
                    if op else "none seen", "rowwise input width": fused[name]},
                fix="pass tp_plan= (--tp-plan) with your own layout, e.g. only the MLP's "
                    "linears: {'mlp.c_fc': ColwiseParallel(), 'mlp.c_proj': "
                    "RowwiseParallel()}"))
        out[name] = found
    return out


def check_fused(layouts: dict[str, tuple[tuple[int, ...], int]], tp: int, *,
                api: str) -> None:
    """Refuse a degree ``tp`` that cannot give each rank whole heads of every part."""
    for name, (sections, unit) in layouts.items():
        bad = [s for s in sections if s % (tp * unit)]
        if bad:
            raise RematError(message(
                api, f"{name}'s fused output cannot give each of {tp} ranks whole heads",
                {"parts (widths)": sections, "a head's (or group's) width": unit,
                 "parts tp does not divide": bad},
                fix="pick a TP degree dividing every part's heads (one key/value head "
                    "cannot be split), or pass tp_plan= (--tp-plan) leaving this attention "
                    "whole, e.g. only the MLP's linears"))
