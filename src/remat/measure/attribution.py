"""Which block an op belongs to, in forward, backward and recompute.

NOTE [ Block attribution ]
    Forward pre/post hooks on the blocks keep a stack of block names; an op is
    attributed to the innermost block on the stack. In backward no block
    forward runs (remat's checkpoint regions recompute *inside* the block's
    forward, below its hooks), so each block's output gets a gradient hook that
    makes it the backward block, and its first input a hook that ends it.
    Backward and recompute ops are attributed to that block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from remat.measure.ledger import first_tensor
from remat.recompute import is_recomputing


class BlockAttribution:
    """Hooks on ``blocks`` that say which block runs now (see NOTE [ Block attribution ]).

    Args:
        blocks: ``(qualified_name, module)`` pairs.
        in_forward: whether the step is in its forward phase (hooks on tensors are only
            registered then).
    """

    def __init__(self, blocks: Sequence[tuple[str, nn.Module]],
                 in_forward: Callable[[], bool]) -> None:
        self._blocks = list(blocks)
        self._in_forward = in_forward
        self._forward_stack: list[str] = []
        self.backward_block: str | None = None
        self._handles: list[RemovableHandle] = []

    @property
    def current(self) -> str | None:
        """The innermost block running forward, else the block in backward, else None."""
        return self._forward_stack[-1] if self._forward_stack else self.backward_block

    def install(self) -> None:
        for name, module in self._blocks:
            self._handles.append(
                module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True)
            )
            self._handles.append(
                module.register_forward_hook(self._post_hook(name), with_kwargs=True,
                                             always_call=True)
            )

    def remove(self) -> None:
        for handle in self._handles:
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
