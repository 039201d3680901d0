"""FLOPs and bytes moved by one aten op, for the tracker and the roofline.

The tracker stores them per op as a :class:`remat.core.op_record.OpRecord`.

FLOPs come from ``torch.utils.flop_counter.flop_registry`` (the formulas behind
``FlopCounterMode``: matmuls, convolutions, attention), called the way
``FlopCounterMode`` calls them (``formula(*args, **kwargs, out_val=out)``). Ops
without a formula (pointwise, reductions, copies) count 0 FLOPs; their cost is
the bytes they move, which :mod:`remat.measure.roofline` charges to bandwidth.

NOTE [ CPU attention ]
    ``F.scaled_dot_product_attention`` on CPU runs
    ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its ``_backward``),
    which PyTorch's registry has no formula for. They take ``query, key, value``
    (after ``grad_out`` in backward) first, like the CUDA flash kernels, so
    PyTorch's formulas apply unchanged: forward is two batched matmuls,
    2 x 2·(b·h)·s_q·s_k·d (``sdpa_flop_count``); backward five
    (``sdpa_backward_flop_count``: the scores are recomputed). Causal masking is
    not discounted, as in PyTorch ("We aren't accounting for causal attention"). We add
    them to a private table instead of registering them globally, so importing
    remat never changes ``FlopCounterMode``'s results.

NOTE [ Grouped-query attention ]
    PyTorch's attention formulas before 2.13 assert that key and value have as
    many heads as the query (``sdpa_flop_count: query/key/value shapes are
    incompatible``), so a grouped-query model (``enable_gqa=True``, e.g. Llama
    with fewer KV heads) failed to profile on torch 2.6-2.12. The kernels
    broadcast the KV heads to the query's, and torch 2.13's formula counts
    exactly that, so on an ``AssertionError`` we call the formula again with
    every ``(b, h, s, d)`` argument whose ``h`` divides the largest head count
    widened to it (shapes only: the formulas read shapes, and a ``torch.Size``
    passes through their ``get_shape`` unchanged). On torch 2.13 the retry never
    runs.

NOTE [ Bytes moved ]
    ``read_bytes`` is the sum of ``nbytes`` of the op's tensor inputs and
    ``write_bytes`` of its tensor outputs, except that ops which move no data
    count 0 for both: views and other ops whose outputs all alias an input
    without mutating it (``aten.view``, ``aten.t``, ``aten.detach``, ``aten.expand``
    ...), allocations left uninitialised (``aten.empty*``), and the ops that lift a
    constant made in the forward (``aten.lift_fresh``, ``aten.lift``): they return their
    input on a real tensor, while a fake mode answers them with a fake copy, which would
    give a fake step traffic its real twin never has. Counting an
    ``expand`` as its broadcast size would make the roofline charge bandwidth
    that is never used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from remat.measure.fake_mode import PLAIN_VALUES

_aten = torch.ops.aten

# See NOTE [ CPU attention ].
_EXTRA_FORMULAS: dict[Any, Callable[..., int]] = {}
for _cpu, _cuda in (
    ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention"),
    ("_scaled_dot_product_flash_attention_for_cpu_backward",
     "_scaled_dot_product_flash_attention_backward"),
):
    _cpu_op = getattr(_aten, _cpu, None)
    _cuda_op = getattr(_aten, _cuda, None)
    if _cpu_op is not None and _cuda_op in flop_registry and _cpu_op not in flop_registry:
        _EXTRA_FORMULAS[_cpu_op] = flop_registry[_cuda_op]

# See NOTE [ Bytes moved ].
UNINITIALISED_OPS: frozenset[Any] = frozenset(
    op for op in (
        _aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty,
        _aten.new_empty_strided,
    )
)


def flop_formula(packet: Any) -> Callable[..., int] | None:
    """The FLOP formula for an op overload packet (e.g. ``torch.ops.aten.mm``), or None."""
    formula = flop_registry.get(packet)
    if formula is None:
        formula = _EXTRA_FORMULAS.get(packet)
    return formula  # type: ignore[no-any-return]

#: Ops whose output is a tensor created from Python data (``torch.tensor(...)``).
FRESH_OPS: frozenset[Any] = frozenset({_aten.lift_fresh, _aten.lift_fresh_copy, _aten.lift})
#: Ops that return their input on a real tensor (``torch.tensor(...)`` in a traced forward):
#: no bytes moved, though a fake mode returns a fake copy of the constant (NOTE [ Bytes
#: moved ]), so a fake and a real step record the same traffic for them.
IDENTITY_OPS: frozenset[Any] = frozenset({_aten.lift_fresh, _aten.lift})
#: Metadata queries that reach modes for tensor subclasses with custom size/stride policies
#: (FakeTensor among them) but never for plain tensors: not ops of the step (the same list
#: as FlopCounterMode's).
METADATA_OPS: frozenset[Any] = frozenset(
    getattr(getattr(ns, name, None), overload, None)
    for ns, name, overload in (
        (_aten, "sym_is_contiguous", "default"), (_aten, "is_contiguous", "default"),
        (_aten, "is_contiguous", "memory_format"), (_aten, "is_strides_like_format", "default"),
        (_aten, "is_non_overlapping_and_dense", "default"), (_aten, "size", "default"),
        (_aten, "sym_size", "default"), (_aten, "stride", "default"),
        (_aten, "sym_stride", "default"), (_aten, "storage_offset", "default"),
        (_aten, "sym_storage_offset", "default"), (_aten, "numel", "default"),
        (_aten, "sym_numel", "default"), (_aten, "dim", "default"),
        (torch.ops.prim, "layout", "default"), (torch.ops.prim, "device", "default"),
    )
) - {None}


def op_traffic(func: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor], *,
               aliases_only: bool) -> tuple[int, int, int]:
    """``(read_bytes, write_bytes, dtype_bytes)`` of one op call (see NOTE [ Bytes moved ]).

    Args:
        func: the op overload.
        inputs: its tensor arguments.
        outputs: its tensor outputs that have a storage.
        aliases_only: every output aliases an input (a view).
    """
    write = sum(t.nbytes for t in outputs)
    if func.overloadpacket in UNINITIALISED_OPS or func.overloadpacket in IDENTITY_OPS \
            or (aliases_only and not func._schema.is_mutable):
        read = write = 0
    else:
        read = sum(t.nbytes for t in inputs)
    dtype_bytes = next((t.element_size() for t in outputs if t.is_floating_point()), 0)
    if not dtype_bytes:
        dtype_bytes = (outputs[0].element_size() if outputs
                       else inputs[0].element_size() if inputs else 0)
    return read, write, dtype_bytes


#: Stands for a tensor in a FLOPs key (its shape follows).
_TENSOR = object()
#: FLOPs per (formula, argument shapes and values); cleared when it reaches the cap.
_FLOPS: dict[Any, int] = {}
_FLOPS_CAP = 100_000


def op_flops(packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """FLOPs of one op call, as ``FlopCounterMode`` counts them (0 when no formula).

    NOTE [ FLOPs by shapes ]
        A formula sees the shapes of its tensors and the other arguments as given (that
        is how ``torch.utils.flop_counter`` wraps each), so its answer is kept per formula
        (a formula registered again is another) and those shapes and values: a step
        repeats the same few hundred calls per block, and PyTorch's wrapper maps every
        argument through pytree on each call (a tenth to a fifth of a tracked step's CPU
        time on a 32-layer Llama). Arguments that cannot be keyed (a symbolic size)
        are computed each time.

    Args:
        packet: the op's overload packet (``func.overloadpacket``).
        args: positional arguments of the call.
        kwargs: keyword arguments of the call.
        out: what the op returned.

    Example:
        >>> a, b = torch.ones(8, 64), torch.ones(64, 32)
        >>> op_flops(torch.ops.aten.mm, (a, b), {}, a @ b)  # 2 * 8 * 64 * 32
        32768
    """
    formula = flop_formula(packet)
    if formula is None:
        return 0
    try:
        key = (formula, _shapes_key(args), _shapes_key(kwargs), _shapes_key(out))
        flops = _FLOPS.get(key)
    except (TypeError, _NoKey):  # a symbolic size, or a value a key cannot hold
        key, flops = None, None
    if flops is None:
        flops = _flops(formula, args, kwargs, out)
        if key is not None:
            if len(_FLOPS) >= _FLOPS_CAP:
                _FLOPS.clear()
            _FLOPS[key] = flops
    return flops


def _flops(formula: Callable[..., int], args: tuple[Any, ...], kwargs: dict[str, Any],
           out: Any) -> int:
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except AssertionError:  # NOTE [ Grouped-query attention ]
        widened = _gqa_widened(args)
        if widened is None:
            raise
        return int(formula(*widened, **kwargs, out_val=out))


class _NoKey(Exception):
    """An argument :func:`_shapes_key` does not turn into a key."""


def _shapes_key(value: Any) -> Any:
    """``value`` as a FLOP formula sees it, hashable: PyTorch's formulas are wrapped to
    receive every tensor's shape in its place and every other value as it is
    (``torch.utils.flop_counter``), so equal keys give equal FLOPs (NOTE [ FLOPs by
    shapes ])."""
    kind = type(value)
    if kind in PLAIN_VALUES:  # keyed with their type: ``True`` and ``1`` differ
        return kind, value
    if isinstance(value, torch.Tensor):
        return _TENSOR, value.shape
    if kind is tuple or kind is list:
        return kind, tuple(_shapes_key(v) for v in value)
    if kind is dict:
        return kind, tuple((k, _shapes_key(v)) for k, v in value.items())
    raise _NoKey



def _gqa_widened(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``args`` with grouped KV heads widened to the query's, as shapes (or None)."""
    shapes = [a.shape for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
    if not shapes:
        return None
    heads = max(int(s[1]) for s in shapes)
    if all(int(s[1]) == heads or heads % int(s[1]) for s in shapes):
        return None  # nothing to widen: the assertion is about something else
    return tuple(
        torch.Size((a.shape[0], heads, *a.shape[2:]))
        if isinstance(a, torch.Tensor) and a.dim() == 4 and heads % int(a.shape[1]) == 0
        else a
        for a in args
    )




#: Per op overload seen: (not an op of the step: a metadata query or a profiler range;
#: makes a fresh tensor from Python data; its overload packet's name). Looked up once per
#: overload instead of on every call (``OpOverload.namespace`` builds a string).
_OP_INFO: dict[Any, tuple[bool, bool, str]] = {}


def op_info(func: Any) -> tuple[bool, bool, str]:
    """(a metadata query or profiler range, makes a fresh tensor from Python data, its
    overload packet's name) of the op overload ``func``, cached.

    Example:
        >>> op_info(torch.ops.aten.mm.default)
        (False, False, 'aten.mm')
    """
    info = _OP_INFO.get(func)
    if info is None:
        info = (func in METADATA_OPS or func.namespace == "profiler",
                func.overloadpacket in FRESH_OPS, str(func.overloadpacket))
        _OP_INFO[func] = info
    return info
