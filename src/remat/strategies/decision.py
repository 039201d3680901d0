"""The per-block decision: what one block (or one sub-layer) gets.

A :class:`BlockDecision` is the serialisable form of a block-level strategy (see
:mod:`remat.strategies.base`): its ``kind`` is the registered strategy's name and,
for strategies that keep chosen ops (``"ops"``), ``save_ops`` the ops kept. A
whole-model strategy expands to one decision per block; a Plan maps block names
to decisions.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

import torch

from remat.strategies.sac import parse_entry

__all__ = ["BlockDecision", "check_op_name"]

_OP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*")


def check_op_name(name: str) -> None:
    """Refuse a save-set op name that is not ``<namespace>.<op>``, or an unknown aten op.

    A name that matches no op saves nothing: the region silently recomputes
    everything. Only ``aten`` names are looked up (other namespaces may be registered
    later, by importing their library).

    Raises:
        ValueError: the name is malformed or names no aten op; the message suggests
            the closest aten op names.
    """
    if not _OP_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not an op name: write an aten overload packet such as "
                         "'aten.mm' (or 'aten.mm#2' for its third call in the region)")
    namespace, op = name.split(".")
    if namespace == "aten" and not hasattr(torch.ops.aten, op):
        _unknown_aten(name)
    return None


def _unknown_aten(name: str) -> None:
    known = {n.split("::", 1)[1].split(".", 1)[0] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("aten::")}
    close = difflib.get_close_matches(name.split(".", 1)[1], sorted(known), n=3)
    hint = f"; did you mean {', '.join('aten.' + c for c in close)}?" if close else ""
    raise ValueError(f"unknown aten op {name!r}: no region runs it, so saving it would save "
                     f"nothing and recompute everything{hint}")



@dataclass(frozen=True)
class BlockDecision:
    """What one block gets.

    Args:
        kind: the name of a registered block-level strategy: ``"none"`` (keep every
            activation), ``"full"`` (checkpoint the block), ``"attn"`` / ``"mlp"``
            (checkpoint only that sub-layer), ``"ops"`` (op-level selective checkpointing:
            save the outputs of ``save_ops``, recompute the rest), ``"offload"`` (keep
            saved activations in host memory), or a strategy registered with
            :func:`remat.register_strategy`. Checked against the registry when applied.
        save_ops: for strategies that keep chosen ops (``"ops"``): aten overload-packet
            names whose outputs are kept, e.g. ``frozenset({"aten.mm", "aten.addmm"})``,
            or single calls of one (``"aten.mm#2"``: the third ``aten.mm`` of the region's
            forward). ``None`` means the strategy's default set. Default: ``None``.

    Example:
        >>> BlockDecision("ops", frozenset({"aten.mm"})).label()
        'ops[aten.mm]'
    """

    kind: str
    save_ops: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind or ":" in self.kind:
            raise ValueError(
                f"remat.BlockDecision: kind must be a block-level strategy name such as 'full', "
                f"got {self.kind!r}"
            )
        if self.save_ops is not None:
            if isinstance(self.save_ops, str):
                raise ValueError(
                    f"remat.BlockDecision: save_ops must be a set of op names, got the string "
                    f"{self.save_ops!r}; write frozenset({{{self.save_ops!r}}})"
                )
            object.__setattr__(self, "save_ops", frozenset(self.save_ops))
            for entry in self.save_ops:
                try:
                    check_op_name(parse_entry(entry)[0])
                except ValueError as exc:
                    raise ValueError(f"remat.BlockDecision: {exc}") from None

    def label(self) -> str:
        """Short human-readable form, e.g. ``ops[aten.mm,aten.addmm]``."""
        if self.save_ops is not None:
            return f"{self.kind}[" + ",".join(sorted(self.save_ops)) + "]"
        return self.kind
