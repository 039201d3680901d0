"""Snapshot and restore what a measured step changes: parameters, grads, buffers,
optimizer state and RNG."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn


def _host_copy(t: Tensor) -> Tensor:
    return t.detach().to("cpu", copy=True)


@contextmanager
def preserved_state(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    device: torch.device) -> Iterator[None]:
    """Restore parameters, gradients, buffers, optimizer state and RNG on exit.

    Parameters and optimizer state are copied to host memory only when an optimizer
    is given (only an update changes them); gradients are put back as the same tensors.
    """
    params = list(dict.fromkeys(model.parameters()))
    grads = [(p, p.grad) for p in params]
    values = [(p, _host_copy(p)) for p in params] if optimizer is not None else []
    buffers = [(b, _host_copy(b)) for b in model.buffers()]
    state: list[tuple[Any, dict[str, Any], list[tuple[str, Any, Any]]]] = []
    groups: list[dict[str, Any]] = []
    if optimizer is not None:
        for p, entries in optimizer.state.items():
            saved = [(k, v, _host_copy(v) if isinstance(v, Tensor) else copy.deepcopy(v))
                     for k, v in entries.items()]
            state.append((p, entries, saved))
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                  for g in optimizer.param_groups]
    devices = [device.index or 0] if device.type == "cuda" else []
    with ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=devices))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, v in values:
                    p.copy_(v)
                for b, v in buffers:
                    b.copy_(v)
            for p, g in grads:
                p.grad = g
            if optimizer is not None:
                optimizer.state.clear()
                for p, entries, saved in state:
                    entries.clear()
                    for k, original, value in saved:
                        if isinstance(original, Tensor):
                            with torch.no_grad():
                                original.copy_(value)
                            entries[k] = original
                        else:
                            entries[k] = value
                    optimizer.state[p] = entries
                for group, saved_group in zip(optimizer.param_groups, groups, strict=True):
                    group.update(saved_group)
