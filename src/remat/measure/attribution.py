"""Which block an op belongs to, in forward, backward and recompute.

NOTE [ Block attribution ]
    Forward pre/post hooks on the blocks keep a stack of block names; an op is
    attributed to the innermost block on the stack. In backward no block
    forward runs (remat's checkpoint regions recompute *inside* the block's
    forward, below its hooks), so each block's output gets a gradient hook that
    makes it the backward block, and its first input a hook that ends it.
    Backward and recompute ops are attributed to that block.

    A sub-layer written as a method (NOTE [ Method sub-layers ] in remat/blocks.py) has
    no hooks of its own: :func:`hook_calls` puts a wrapper on the instance for as long
    as the attribution is installed, which calls the same pre/post hooks around the
    method (NOTE [ Method regions ] in remat/strategies/regions.py: the same instance
    attribute a region uses; a region already there is wrapped and put back).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from remat.blocks import BlockMethod, Sublayer
from remat.measure.ledger import first_tensor
from remat.recompute import is_recomputing

PreHook = Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]
PostHook = Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], None]


class _MethodCallHooks:
    """Calls ``pre`` and ``post`` around every call of ``method`` on its owner instance."""

    def __init__(self, method: BlockMethod, pre: PreHook, post: PostHook) -> None:
        self.owner, self.name = method.owner, method.name
        self.previous = self.owner.__dict__.get(self.name)
        self.pre, self.post = pre, post
        self.owner.__dict__[self.name] = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inner = self.previous if self.previous is not None else \
            getattr(type(self.owner), self.name).__get__(self.owner)
        self.pre(self.owner, args, kwargs)
        output = None
        try:
            output = inner(*args, **kwargs)
        finally:
            self.post(self.owner, args, kwargs, output)
        return output

    def remove(self) -> None:
        if self.owner.__dict__.get(self.name) is not self:
            return
        if self.previous is None:
            del self.owner.__dict__[self.name]
        else:
            self.owner.__dict__[self.name] = self.previous


def hook_calls(target: Sublayer, pre: PreHook, post: PostHook
               ) -> list[RemovableHandle | _MethodCallHooks]:
    """Call ``pre(module, args, kwargs)`` before and ``post(module, args, kwargs, output)``
    after each call of ``target``, a module (forward hooks) or a method sub-layer (an
    instance wrapper, see NOTE [ Block attribution ]); ``remove()`` each handle to stop.

    Example::

        >>> handles = hook_calls(BlockMethod(block, "_ffn"), pre, post)
        >>> for h in handles: h.remove()
    """
    if isinstance(target, BlockMethod):
        return [_MethodCallHooks(target, pre, post)]
    return [target.register_forward_pre_hook(pre, with_kwargs=True),
            target.register_forward_hook(post, with_kwargs=True, always_call=True)]


class BlockAttribution:
    """Hooks on ``blocks`` that say which block runs now (see NOTE [ Block attribution ]).

    Args:
        blocks: ``(qualified_name, module)`` pairs; a method sub-layer
            (:class:`~remat.blocks.BlockMethod`) may stand for a module.
        in_forward: whether the step is in its forward phase (hooks on tensors are only
            registered then).
    """

    def __init__(self, blocks: Sequence[tuple[str, Sublayer]],
                 in_forward: Callable[[], bool]) -> None:
        self._blocks = list(blocks)
        self._in_forward = in_forward
        self._forward_stack: list[str] = []
        self.backward_block: str | None = None
        self._handles: list[RemovableHandle | _MethodCallHooks] = []

    @property
    def current(self) -> str | None:
        """The innermost block running forward, else the block in backward, else None."""
        return self._forward_stack[-1] if self._forward_stack else self.backward_block

    def install(self) -> None:
        for name, target in self._blocks:
            self._handles += hook_calls(target, self._pre_hook(name), self._post_hook(name))

    def remove(self) -> None:
        for handle in reversed(self._handles):
            handle.remove()
        self._handles.clear()
        self._forward_stack.clear()

    def _tracing_forward(self) -> bool:
        return self._in_forward() and torch.is_grad_enabled() and not is_recomputing()

    def _pre_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._forward_stack.append(name)
            if self._tracing_forward():
                x = first_tensor(args)
                if x is None:
                    x = first_tensor(kwargs)
                if x is not None and x.requires_grad:
                    x.register_hook(self._end_backward_block(name))
        return hook

    def _post_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 output: Any) -> None:
            if self._forward_stack and self._forward_stack[-1] == name:
                self._forward_stack.pop()
            if self._tracing_forward():
                y = first_tensor(output)
                if y is not None and y.requires_grad:
                    y.register_hook(self._start_backward_block(name))
        return hook

    def _start_backward_block(self, name: str) -> Any:
        def hook(grad: Tensor) -> None:
            self.backward_block = name
        return hook

    def _end_backward_block(self, name: str) -> Any:
        def hook(grad: Tensor) -> None:
            if self.backward_block == name:
                self.backward_block = None
        return hook
