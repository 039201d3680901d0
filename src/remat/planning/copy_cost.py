"""Which copy of a CPU model is cheaper to measure on: a fake one, or a real one.

A fake copy (FakeTensorMode) computes nothing but pays Python dispatch on every op; a
real copy pays the op's arithmetic. On small CPU models the arithmetic is far cheaper
than the dispatch, so the planner measures on a real copy there (NOTE [ A real copy
standing in for the fake one ] in context.py) and the closed loop on the real model
(NOTE [ Closed loop on the real model ] in loop.py). Both decide from the work of the
step, never from the clock: op counts and FLOPs, priced by the constants below.

NOTE [ Pricing a fake and a real copy ]
    A tracked op on a fake copy costs ``FAKE_OP_S``; an untracked real CPU op costs
    ``REAL_OP_S`` plus its FLOPs at ``CPU_FLOPS_PER_THREAD`` per torch intra-op thread.
    The constants are medians measured on 1-thread CPU steps of Hugging Face decoders (d
    32 to 1024). They only decide speed: both copies measure the same bytes.
"""

from __future__ import annotations

import torch

#: Seconds per op of a tracked fake step (NOTE [ Pricing a fake and a real copy ]).
FAKE_OP_S = 250e-6
#: Seconds per op of an untracked real CPU step, arithmetic aside.
REAL_OP_S = 15e-6
#: One CPU thread's FLOP rate, FLOP/s.
CPU_FLOPS_PER_THREAD = 40e9


def fake_seconds(ops: int) -> float:
    """Seconds ``ops`` tracked ops take on a fake copy."""
    return ops * FAKE_OP_S


def real_seconds(ops: int, flops: int, *, threads: int | None = None) -> float:
    """Seconds ``ops`` untracked ops of ``flops`` FLOPs in all take on a real CPU copy, on
    ``threads`` intra-op threads (default: torch's count)."""
    threads = torch.get_num_threads() if threads is None else threads
    return ops * REAL_OP_S + flops / (CPU_FLOPS_PER_THREAD * max(1, threads))


def in_process_group() -> bool:
    """Whether this process is one rank of several: its real steps would run collectives,
    which every rank must run alike, so it measures on fake copies only."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
