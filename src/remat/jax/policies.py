"""``jax.checkpoint`` policies and the whole-model strategies that pick one per block.

NOTE [ Strategies ]
    ``none``; ``full`` (every block ``nothing_saveable``); ``every:N`` (blocks 0, N,
    2N, ... ``nothing_saveable``); ``sqrt``: segments of ceil(sqrt(L)) blocks where
    every block but a segment's last is ``nothing_saveable`` (with one block, that
    block is ``nothing_saveable``; a per-block wrapper
    cannot fuse blocks into one checkpoint region without owning the model's loop,
    so this is the per-block reading of Chen et al. 2016); and any policy applied
    to every block: ``nothing_saveable``, ``dots_saveable``,
    ``dots_with_no_batch_dims_saveable``, ``save_only_these_names:a,b`` (names
    tagged with ``jax.ad_checkpoint.checkpoint_name``) and ``offload:a,b`` (save
    those names in host memory, recompute the rest).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import jax

from remat.errors import StrategyError, current_call, message

PolicyKind = Literal["none", "nothing_saveable", "dots_saveable",
                     "dots_with_no_batch_dims_saveable", "save_only_these_names", "offload"]

#: Policy kinds; the last two take names (``save_only_these_names:qkv,mlp_up``).
POLICIES: tuple[str, ...] = ("none", "nothing_saveable", "dots_saveable",
                             "dots_with_no_batch_dims_saveable", "save_only_these_names",
                             "offload")
#: Strategy strings :func:`apply` accepts (see NOTE [ Strategies ]).
STRATEGIES: tuple[str, ...] = ("none", "full", "every:N", "sqrt", "nothing_saveable",
                               "dots_saveable", "dots_with_no_batch_dims_saveable",
                               "save_only_these_names:NAMES", "offload:NAMES")
_NAMED = ("save_only_these_names", "offload")


@dataclass(frozen=True)
class Policy:
    """One block's ``jax.checkpoint`` policy (hashable: it is static NNX graph data).

    Args:
        kind: one of :data:`POLICIES`; ``"none"`` runs the block without checkpoint.
        names: for ``save_only_these_names`` / ``offload``, the ``checkpoint_name`` tags
            to save (offload: to save in host memory). Default: ``()``.

    Example:
        >>> Policy("save_only_these_names", ("qkv",)).label()
        'save_only_these_names:qkv'
    """

    kind: PolicyKind
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise StrategyError(message(current_call("remat.jax.apply"),
                                        f"unknown policy {self.kind!r}",
                                        {"policies": ", ".join(POLICIES)},
                                        fix="pass one of the policies"))
        object.__setattr__(self, "names", tuple(sorted(set(self.names))))
        if self.kind in _NAMED and not self.names:
            raise StrategyError(message(current_call("remat.jax.apply"),
                                        f"policy {self.kind!r} needs names",
                                        fix=f"name the tensors, e.g. '{self.kind}:qkv,mlp_up'"))
        if self.kind not in _NAMED and self.names:
            raise StrategyError(message(current_call("remat.jax.apply"),
                                        f"policy {self.kind!r} takes no names",
                                        {"names": list(self.names)},
                                        fix=f"write {self.kind!r} alone"))

    @property
    def is_none(self) -> bool:
        """True when the block runs without checkpoint."""
        return self.kind == "none"

    def label(self) -> str:
        """``"none"``, ``"dots_saveable"``, ``"save_only_these_names:a,b"``, ..."""
        return f"{self.kind}:{','.join(self.names)}" if self.names else self.kind

    def jax_policy(self) -> Callable[..., Any] | None:
        """The ``jax.checkpoint_policies`` function (None for ``"nothing_saveable"`` and none)."""
        cp = jax.checkpoint_policies
        if self.kind == "dots_saveable":
            return cp.dots_saveable  # type: ignore[no-any-return]
        if self.kind == "dots_with_no_batch_dims_saveable":
            return cp.dots_with_no_batch_dims_saveable  # type: ignore[no-any-return]
        if self.kind == "save_only_these_names":
            return cp.save_only_these_names(*self.names)  # type: ignore[no-any-return]
        if self.kind == "offload":
            return cp.save_and_offload_only_these_names(  # type: ignore[no-any-return]
                names_which_can_be_saved=[], names_which_can_be_offloaded=list(self.names),
                offload_src="device", offload_dst="pinned_host")
        return cp.nothing_saveable  # type: ignore[no-any-return]


#: The policy of a block that runs without checkpoint.
NONE = Policy("none")


def parse_policy(text: str | Policy) -> Policy:
    """Read ``"dots_saveable"``, ``"save_only_these_names:qkv,mlp_up"``, ``"full"``, ...

    Raises:
        StrategyError: unknown kind or missing names; the message lists the valid ones.
    """
    if isinstance(text, Policy):
        return text
    if not isinstance(text, str):
        raise StrategyError(message(current_call("remat.jax.apply"),
                                    "a policy is a string or a Policy",
                                    {"found": type(text).__name__},
                                    fix="pass a policy name such as 'dots_saveable'"))
    kind, sep, rest = text.strip().partition(":")
    kind = {"full": "nothing_saveable", "names": "save_only_these_names"}.get(kind, kind)
    names = tuple(n.strip() for n in rest.split(",") if n.strip()) if sep else ()
    if kind not in POLICIES:
        raise StrategyError(message(current_call("remat.jax.apply"), f"unknown policy {text!r}",
                                    {"policies": ", ".join(POLICIES) + " (and 'full')"},
                                    fix="pass one of the policies"))
    return Policy(kind, names)  # type: ignore[arg-type]


def strategy_policies(strategy: str, num_blocks: int) -> list[Policy]:
    """Per-block policies of a whole-model strategy (see NOTE [ Strategies ]).

    Raises:
        StrategyError: unknown strategy or a bad ``every:N``.

    Example:
        >>> [p.label() for p in strategy_policies("every:2", 3)]
        ['nothing_saveable', 'none', 'nothing_saveable']
    """
    if not isinstance(strategy, str):
        raise StrategyError(message(current_call("remat.jax.apply"),
                                    "a strategy is a string, a Plan or a mapping",
                                    {"found": type(strategy).__name__},
                                    fix=f"pass one of {', '.join(STRATEGIES)}, or a Plan"))
    text = strategy.strip()
    full = Policy("nothing_saveable")
    if text == "every" or text.startswith("every:"):
        _, _, count = text.partition(":")
        if not count.strip().isdigit() or int(count) < 1:
            raise StrategyError(message(current_call("remat.jax.apply"),
                                        f"cannot read {strategy!r}",
                                        fix="write every:N with an integer N >= 1, e.g. every:2 "
                                            "checkpoints blocks 0, 2, ..."))
        n = int(count)
        return [full if i % n == 0 else NONE for i in range(num_blocks)]
    if text == "sqrt":
        size = max(1, math.ceil(math.sqrt(num_blocks)))
        if size == 1:  # one-block segments: every block is its own checkpoint
            return [full] * num_blocks
        return [NONE if (i + 1) % size == 0 or i == num_blocks - 1 else full
                for i in range(num_blocks)]
    try:
        policy = parse_policy(text)
    except StrategyError:
        raise StrategyError(message(current_call("remat.jax.apply"),
                                    f"unknown strategy {strategy!r}",
                                    {"strategies": ", ".join(STRATEGIES)},
                                    fix="pass one of the strategies")) from None
    return [policy] * num_blocks

