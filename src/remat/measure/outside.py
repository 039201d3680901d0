"""Tensors a training step creates outside the dispatcher, made visible to the tracker.

NOTE [ RNG states saved by checkpoint ]
    ``torch.utils.checkpoint`` with ``preserve_rng_state=True`` (remat's default:
    dropout must draw the same masks on recompute) stashes
    ``torch.get_rng_state()`` for every checkpointed call, and its recompute
    forks the RNG (``torch.random.fork_rng``), which takes one more copy.
    ``get_rng_state`` builds its tensor in C++ without an aten op, so no
    dispatch mode sees it, yet it is a real allocation of the step: the CPU
    generator's state is a 5056-byte uint8 tensor (mt19937: 624 x 8-byte words
    plus bookkeeping), alive from the region's forward until its backward. With
    ``L`` checkpointed blocks that is ``L x 5056`` bytes at the end of forward:
    the 5-41 KB by which the tracker read below the CPU allocator under
    checkpointing, enough to put a plan over a tight budget.
    :func:`watch_rng_states` wraps both public entry points while a tracker is
    active and hands each state tensor to the tracker, which counts it as
    created by the current phase and block. CUDA generator states are CPU
    tensors (16 bytes) and do not count towards a CUDA device's bytes; they
    are reported like the CPU one for a tracker without a device filter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.random
from torch import Tensor


@functools.cache
def cpu_rng_state_bytes() -> int:
    """Bytes of one CPU RNG state, what each checkpointed region keeps on CPU (5056).

    See NOTE [ RNG states saved by checkpoint ].
    """
    return int(torch.default_generator.get_state().nbytes)


@contextmanager
def watch_rng_states(on_tensor: Callable[[Tensor], None]) -> Iterator[None]:
    """While active, pass every tensor ``torch.get_rng_state()`` returns to ``on_tensor``.

    See NOTE [ RNG states saved by checkpoint ]. Nesting is safe: each level restores
    what it replaced.
    """
    original_torch = torch.get_rng_state
    original_random = torch.random.get_rng_state

    def get_rng_state(*args: Any, **kwargs: Any) -> Tensor:
        state = original_random(*args, **kwargs)
        on_tensor(state)
        return state

    torch.get_rng_state = get_rng_state
    torch.random.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original_torch
        torch.random.get_rng_state = original_random
