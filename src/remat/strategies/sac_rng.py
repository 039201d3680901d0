"""Random ops that selective checkpointing keeps: replay the RNG they consumed.

NOTE [ Kept random ops and the RNG ]
    Non-reentrant checkpointing restores the RNG states the region's forward started
    from before it recomputes, so a random op recomputed draws what it drew in the
    forward. A random op whose output SAC keeps is not run again, so the generator is
    not advanced past it, and every random op recomputed after it draws from an earlier
    point of the stream than in the forward: a different dropout mask, wrong gradients
    (a CPU reproduction: ``rand_like`` kept, a later ``rand_like`` recomputed; tests/
    strategies/test_sac_rng.py). Every fused attention kernel is such an op (tagged
    ``nondeterministic_seeded``: its dropout draws from the generator), and the default
    ``ops`` save set keeps attention, so on CUDA, where SDPA with ``dropout_p > 0`` runs
    the efficient-attention kernel, ``ops`` on a model with attention dropout gave
    gradient errors of order 1 (seen on an H100, torch 2.11; the same code path in 2.13),
    as does hand-written SAC with the same save set.

    When a region's save set names a random op, :func:`rng_replay` adds a dispatch mode on
    top of SAC's two: in the forward it records the state of the op's device generator after
    each random op the policy keeps; in the recompute it sets that state after the same
    (k-th) random op, so whatever follows draws what it drew in the forward. A random op
    re-run needs nothing: the generator is right before it, so after it too. Fake tensors
    (the planner's measurements) have no generator to follow and are passed through, as are
    real ones inside :func:`generators_unfollowed` (a real copy the planner measures as it
    would a fake one). The CPU state is a 5056-byte tensor taken through
    ``torch.get_rng_state``, so the tracker counts it (NOTE [ RNG states saved by checkpoint
    ] in measure/outside.py). The mode stays only where it matters: a region whose first
    forward kept no random op, or whose first recompute found every kept one had left its
    generator where it was (attention without dropout), gets SAC's contexts alone from then
    on, like NOTE [ Skipping only where it pays ] in sac.py.

    A kept random op that left its generator where it found it (attention without
    dropout: every fused attention kernel is tagged random, whatever its ``dropout_p``)
    gets no state: skipping it in the recompute leaves the generator right, as in the
    forward. The forward compares the states before and after the op, so a model without
    dropout holds no state past the op, not one per kept attention call: the first step
    after apply then holds what later steps hold (NOTE [ The first step ] in
    measure/profile.py), instead of one CPU state per region call until its backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy

from remat.core.switch import Switch
from remat.measure.dispatch_modes import direct_dispatch

_SEEDED = torch.Tag.nondeterministic_seeded
_KEPT = CheckpointPolicy.MUST_SAVE


def names_random_op(names: Iterable[str]) -> bool:
    """Whether any of these op names (``"aten.mm"``) has an overload tagged random."""
    for name in names:
        namespace, _, op = name.partition(".")
        packet = getattr(getattr(torch.ops, namespace, None), op, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            if _SEEDED in getattr(packet, overload).tags:
                return True
    return False


_followed = Switch()


def generators_unfollowed() -> contextlib.AbstractContextManager[None]:
    """Inside, random ops on real tensors pass through as fake ones do: no generator state
    is recorded (NOTE [ Kept random ops and the RNG ]).

    Example:
        >>> with generators_unfollowed():
        ...     pass
    """
    return _followed.turned_off()


def _device_of(args: Any, kwargs: Any, out: Any) -> torch.device | None:
    if not _followed.on:
        return None
    for t in tree_leaves((out, args, kwargs)):
        if isinstance(t, torch.Tensor):
            return None if isinstance(t, FakeTensor) else t.device
    return None


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    module = torch.get_device_module(device.type)
    return module.get_rng_state(device)  # type: ignore[no-any-return]


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


@dataclass
class RngLog:
    """One region call: the generator state after each random op the policy kept."""

    states: dict[int, tuple[torch.device, torch.Tensor]] = field(default_factory=dict)
    forward_done: bool = False
    recompute_done: bool = False
    matters: bool = False  # in the recompute, a kept random op had moved its generator

    def settled_without_replay(self) -> bool:
        """The region's random ops need no replay: none kept, or none of those moved."""
        if self.forward_done and not self.states:
            return True
        return self.recompute_done and not self.matters


@direct_dispatch
class _Record(TorchDispatchMode):
    def __init__(self, log: RngLog, policy: Any) -> None:
        super().__init__()
        self.log = log
        self.policy = policy
        self.index = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if _SEEDED not in func.tags:
            return func(*args, **kwargs)
        # The generator before the op, where its inputs say which one it draws from: a
        # kept op that leaves it where it was needs no state (NOTE [ Kept random ops
        # and the RNG ], last paragraph).
        before_device = _device_of(args, kwargs, None)
        before = _get_state(before_device) if before_device is not None else None
        out = func(*args, **kwargs)
        k, self.index = self.index, self.index + 1
        device = _device_of(args, kwargs, out)
        if device is not None and getattr(self.policy, "last", None) == _KEPT:
            after = _get_state(device)
            if before is None or before_device != device or not _same(before, after):
                self.log.states[k] = (device, after)
        return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two generator states equal, compared outside the region's modes (not its op)."""
    with _disable_current_modes():
        return bool(torch.equal(a, b))


@direct_dispatch
class _Replay(TorchDispatchMode):
    def __init__(self, log: RngLog) -> None:
        super().__init__()
        self.log = log
        self.index = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if _SEEDED in func.tags:
            k, self.index = self.index, self.index + 1
            entry = self.log.states.get(k)
            if entry is not None:  # kept: the generator is where the op found it
                device, state = entry
                with _disable_current_modes():  # not an op of the region
                    self.log.matters |= not torch.equal(_get_state(device), state)
                _set_state(device, state)
        return out


class _Stacked:
    """``inner`` with ``mode`` on top (it sees each op first, SAC runs it); ``log.attr``
    set when it exits. Re-enterable, as SAC's contexts are (a second backward through a
    retained graph enters the recompute context again)."""

    def __init__(self, inner: Any, mode: TorchDispatchMode, log: RngLog, attr: str) -> None:
        self.inner, self.mode, self.log, self.attr = inner, mode, log, attr
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        with contextlib.ExitStack() as undo:
            undo.push(stack)
            stack.callback(setattr, self.log, self.attr, True)  # runs last, even on raise
            stack.enter_context(self.inner)
            stack.enter_context(self.mode)
            undo.pop_all()
        self._stacks.append(stack)

    def __exit__(self, *exc: Any) -> bool:
        # A recompute stops early by raising once backward has what it needs.
        return bool(self._stacks.pop().__exit__(*exc))


def rng_replay(forward_ctx: Any, recompute_ctx: Any, policy: Any) -> tuple[Any, Any, RngLog]:
    """SAC's two contexts with NOTE [ Kept random ops and the RNG ]'s modes on top.

    Args:
        forward_ctx: SAC's forward context (its caching mode).
        recompute_ctx: SAC's recompute context.
        policy: the region call's policy; its ``last`` decision says whether SAC keeps
            the op that just ran.

    Returns:
        The forward context, the recompute context and the region call's log (whose
        ``settled_without_replay()`` says whether later calls can do without it).

    Example:
        >>> fwd, rec, log = rng_replay(*create_selective_checkpoint_contexts(policy), policy)
    """
    log = RngLog()
    return (_Stacked(forward_ctx, _Record(log, policy), log, "forward_done"),
            _Stacked(recompute_ctx, _Replay(log), log, "recompute_done"), log)
