"""Find the repeated blocks of a Flax NNX model.

# NOTE [ JAX block detection ]
Mirrors ``remat.blocks`` (NOTE [ Default block detection ] there): candidates are
groups of >= 2 modules of the same class held by one list-like container
(``nnx.List``, a list or tuple attribute), or the single module of a one-element
list; each candidate's size is the number of parameter elements its members hold;
the largest wins (outer container first on ties). Blocks come back in container
order, the forward order of a plain ``for block in self.blocks`` loop. A path is
the dotted NNX path, e.g. ``"blocks.3"``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import jax
from flax import nnx

from remat.errors import BlocksNotFound, current_call, message

BlocksSpec: TypeAlias = (
    type[nnx.Module] | Sequence[str] | Callable[[str, nnx.Module], bool] | None
)
"""What ``blocks=`` accepts: a block class, block paths (``["blocks.0", ...]``), a
predicate ``(path, module) -> bool``, or None for automatic detection."""


def _path(parts: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in parts)


def _modules(model: nnx.Module) -> list[tuple[str, nnx.Module]]:
    return [(_path(path), node) for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Module)]


def _param_elements(module: nnx.Module) -> int:
    state = nnx.state(module, nnx.Param)
    return sum(int(getattr(leaf, "size", 0)) for leaf in jax.tree.leaves(state))


def _base_class(module: nnx.Module) -> type:
    """The module's class, seen through remat's wrapper subclass (strategies.py)."""
    return getattr(type(module), "_remat_original", None) or type(module)


def _is_list(node: Any) -> bool:
    return isinstance(node, (nnx.List, list, tuple))


def _auto(model: nnx.Module) -> list[tuple[str, nnx.Module]]:
    best: tuple[int, int, list[tuple[str, nnx.Module]]] | None = None
    searched: list[str] = []
    for depth, (path, node) in enumerate(
        (_path(p), n) for p, n in nnx.iter_graph(model) if _is_list(n)
    ):
        members = [m for m in node if isinstance(m, nnx.Module)]
        if not members or len(members) != len(node):
            continue
        searched.append(f"{path or '(root)'} ({len(members)} x "
                        f"{_base_class(members[0]).__name__})")
        if len({_base_class(m) for m in members}) != 1:
            continue
        size = sum(_param_elements(m) for m in members)
        if size == 0:
            continue
        named = [(f"{path}.{i}" if path else str(i), m) for i, m in enumerate(members)]
        if best is None or size > best[0]:
            best = (size, depth, named)
    if best is None:
        raise BlocksNotFound(message(
            current_call("remat.jax.apply"), f"no repeated blocks found in {type(model).__name__}",
            {"searched list containers": ", ".join(searched) or "none"},
            fix="keep the blocks in an nnx.List of one module class, or pass blocks=BlockClass, "
                "blocks=['blocks.0', ...] or blocks=lambda path, module: ..."))
    return best[2]


def named_blocks(model: nnx.Module, blocks: BlocksSpec = None) -> list[tuple[str, nnx.Module]]:
    """The blocks of ``model`` as ``(path, module)`` pairs, in forward order.

    Args:
        model: a Flax NNX module.
        blocks: see :data:`BlocksSpec`. Default: automatic (NOTE [ JAX block detection ]).

    Raises:
        BlocksNotFound: nothing matched; the message lists what was searched.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(message(current_call("remat.jax.apply"),
                                "the model must be a flax.nnx.Module",
                                {"found": type(model).__name__},
                                fix="pass a Flax NNX module (flax.nnx.Module)"))
    if blocks is None:
        return _auto(model)
    modules = [(p, m) for p, m in _modules(model) if p]
    if isinstance(blocks, type):
        found = [(p, m) for p, m in modules if isinstance(m, blocks)]
        # Outermost only: a block class nested in itself counts once.
        found = [(p, m) for p, m in found
                 if not any(p.startswith(q + ".") for q, _ in found)]
    elif callable(blocks):
        found = [(p, m) for p, m in modules if blocks(p, m)]
    else:
        wanted = [str(b) for b in blocks]
        by_path = dict(modules)
        missing = [w for w in wanted if w not in by_path]
        if missing:
            raise BlocksNotFound(message(
                current_call("remat.jax.apply"),
                f"blocks {missing} are not modules of {type(model).__name__}",
                {"modules include": ", ".join(p for p, _ in modules[:8])},
                fix="name modules by their paths"))
        found = [(w, by_path[w]) for w in wanted]
    if not found:
        raise BlocksNotFound(message(current_call("remat.jax.apply"),
                                     f"blocks={blocks!r} matched no module of "
                                     f"{type(model).__name__}",
                                     fix="pass a class, paths or a predicate that matches "
                                         "the repeated modules"))
    return found


def find_blocks(model: nnx.Module, blocks: BlocksSpec = None) -> list[str]:
    """Paths of the blocks remat.jax checkpoints, e.g. ``["blocks.0", "blocks.1"]``.

    Example:
        >>> find_blocks(build_model("gpt-tiny"))
        ['blocks.0', 'blocks.1']
    """
    return [p for p, _ in named_blocks(model, blocks)]
