"""What a plan was made for: each block's class and parameters, checked when it is applied.

A plan names blocks (``"model.layers.3"``) and decides on each; applied to another
model it would checkpoint whatever modules carry those names, silently. A
:class:`BlockPrint` per block records its class and a digest of its parameter names,
shapes and dtypes; :func:`check_fingerprint` compares them with a model and says
what differs.

NOTE [ Plan fingerprint ]
    Rule 1: every block of the plan must exist in the model with the same class and
            the same parameters (names, shapes, dtypes; values do not matter).
    Rule 2: each planned block's parent must hold as many modules of the block's class
            as when the plan was made: a 2-layer plan on a 6-layer model names blocks
            0 and 1, which exist and match, but 4 more stand beside them.
    A plan without a fingerprint (files written before fingerprints existed) is not
    checked.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from remat.errors import StrategyError, message


@dataclass(frozen=True)
class BlockPrint:
    """One block of the model a plan was made for.

    Args:
        name: the block's qualified name, e.g. ``"model.layers.0"``.
        cls: its class name, e.g. ``"LlamaDecoderLayer"``.
        params: a digest of its parameters' names, shapes and dtypes (16 hex digits).
        siblings: how many modules of its class its parent holds, itself included.
    """

    name: str
    cls: str
    params: str
    siblings: int = 1

    def __post_init__(self) -> None:
        for field_name in ("name", "cls", "params"):
            value = getattr(self, field_name)
            if not isinstance(value, str) or not value:
                raise ValueError(message("BlockPrint", f"{field_name} must be a non-empty "
                                         "string", {"found": repr(value)},
                                         fix=f"pass {field_name} as a non-empty string"))
        if isinstance(self.siblings, bool) or not isinstance(self.siblings, int) \
                or self.siblings < 1:
            raise ValueError(message("BlockPrint", "siblings must be an int >= 1",
                                     {"found": repr(self.siblings)},
                                     fix="pass siblings >= 1"))


def _digest(module: nn.Module) -> str:
    text = "\n".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in module.named_parameters())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _siblings(model: nn.Module, name: str, block: nn.Module) -> int:
    parent_name = name.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    return sum(1 for child in parent.children() if type(child) is type(block))


def fingerprint_of(model: nn.Module, block_names: Sequence[str]) -> tuple[BlockPrint, ...]:
    """The :class:`BlockPrint` of each of ``model``'s blocks named ``block_names``."""
    return tuple(
        BlockPrint(name, type(block).__name__, _digest(block), _siblings(model, name, block))
        for name in block_names for block in (model.get_submodule(name),)
    )


def _differences(prints: Sequence[BlockPrint], model: nn.Module) -> list[str]:
    """What differs, one phrase each (NOTE [ Plan fingerprint ])."""
    modules = dict(model.named_modules())
    found: list[str] = []
    parents: set[str] = set()
    for p in prints:
        block = modules.get(p.name)
        if block is None:  # Rule 1
            found.append(f"it has no module {p.name!r}")
        elif type(block).__name__ != p.cls:
            found.append(f"{p.name!r} is a {type(block).__name__}, the plan's is a {p.cls}")
        elif _digest(block) != p.params:
            found.append(f"{p.name!r} ({p.cls}) has other parameters (names, shapes or dtypes)")
        elif (count := _siblings(model, p.name, block)) != p.siblings:  # Rule 2
            parent = p.name.rpartition(".")[0] or "the model"
            if parent not in parents:
                parents.add(parent)
                found.append(f"{parent!r} holds {count} {p.cls} modules, the plan's model held "
                             f"{p.siblings}")
    return found


def check_fingerprint(prints: Sequence[BlockPrint], model: nn.Module, *,
                      api: str = "remat.apply") -> None:
    """Refuse ``model`` when it is not the model ``prints`` describe.

    Raises:
        StrategyError: the model's blocks differ; the message says how.
    """
    found = _differences(prints, model)
    if found:
        shown = "; ".join(found[:5]) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")
        raise StrategyError(message(
            api, f"this plan was made for another model than {type(model).__name__}",
            {"plan's blocks": f"{len(prints)}, e.g. {prints[0].name!r} ({prints[0].cls})",
             "differences": shown},
            fix="make a plan for this model with remat.plan(model, batch, budget=...)"))
