"""What the dead-op ledger does with each aten op (NOTE [ Dead ops in recompute ], items 3
and 5, in ``remat.strategies.dead_ops``): decided once per overload from its schema."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint as _checkpoint

IGNORED: frozenset[Any] = frozenset(getattr(_checkpoint, "SAC_IGNORED_OPS", ()))
DETACH = torch.ops.aten.detach.default
_RANDOM_ARGS = frozenset({"dropout", "dropout_p", "dropout_state", "seed", "offset",
                          "philox_seed", "philox_offset"})
_KINDS: dict[int, int] = {}


def _skippable_kind(func: Any) -> bool:
    """Item 3 of NOTE [ Dead ops in recompute ], once per overload."""
    schema = getattr(func, "_schema", None)
    if (schema is None or getattr(func, "namespace", None) != "aten" or schema.is_mutable
            or func in IGNORED or torch.Tag.nondeterministic_seeded in func.tags
            or not schema.returns):
        return False
    if any(r.alias_info is not None or str(r.type) != "Tensor" for r in schema.returns):
        return False
    return not any(a.alias_info is not None or a.name in _RANDOM_ARGS
                   or "Generator" in str(a.type) for a in schema.arguments)


def _view_kind(func: Any) -> bool:
    """A pure view (item 5 of NOTE [ Dead ops in recompute ]): every output aliases an
    input (``split`` and ``unbind`` return lists of them), nothing is written, nothing
    random."""
    schema = func._schema
    if (getattr(func, "namespace", None) != "aten" or schema.is_mutable or not schema.returns
            or torch.Tag.nondeterministic_seeded in func.tags):
        return False
    return all(r.alias_info is not None and not r.alias_info.is_write
               and str(r.type) in ("Tensor", "List[Tensor]") for r in schema.returns)


#: What the forward's ledger does with an op (by ``id`` of the overload: hashing an
#: OpOverload runs Python code).
LIVE, SKIPPABLE, METADATA, UNKNOWN, VIEW = 0, 1, 2, 3, 4


def op_kind(func: Any) -> int:
    """``func``'s kind (one of the constants above), cached per overload."""
    kind = _KINDS.get(id(func))
    if kind is None:
        if func in IGNORED:
            kind = LIVE if func is DETACH else METADATA
        elif not isinstance(func, torch._ops.OpOverload):
            kind = UNKNOWN  # a higher-order op: SAC keys it differently
        else:
            kind = (SKIPPABLE if _skippable_kind(func)
                    else VIEW if _view_kind(func) else LIVE)
        _KINDS[id(func)] = kind
    return kind


def classify(func: Any) -> str:
    """How the forward's ledger treats ``func``: ``"skippable"``, ``"view"`` (runs, but
    needs its input only if its own output is needed), ``"live"`` (never skipped),
    ``"metadata"`` (not recorded) or ``"unknown"`` (turns skipping off)."""
    return ("live", "skippable", "metadata", "unknown", "view")[op_kind(func)]
