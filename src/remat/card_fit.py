"""Whether one rank's training step fits its card: reserved memory and what lives outside it.

NOTE [ Fits on the card ]
    A CUDA job runs out of memory when PyTorch's caching allocator cannot reserve a new
    segment: the card's capacity (``total_memory``, what PyTorch reports, below the
    marketed size: NOTE [ Capacity PyTorch reports ] in devices.py) is shared by

    * what lives **outside** the allocator: the CUDA context with its loaded kernels and
      NCCL's buffers per communicator (NOTE [ CUDA context ], NOTE [ NCCL buffers ] in
      device_memory.py);
    * what the allocator **reserves**: its segments, which hold the step's tensors (the
      *allocated* bytes remat's tracker counts, each rounded up to 512 B), the library
      workspaces that go through it (cuBLAS / cuBLASLt per handle and stream, cuDNN;
      NOTE [ cuBLAS workspaces ]) and the free space inside segments that a request of
      another size or stream cannot use (NOTE [ CUDA caching allocator model ] in
      core/caching_allocator.py).

    So a step fits when its predicted reserved peak, workspaces included, is at most the
    capacity less the outside bytes: ``reserved + workspaces <= capacity - outside``.
    :attr:`CardFit.margin_bytes` is what is left (negative: over). Where the default
    segments are over and ``expandable_segments:True`` (segments that grow in place, so
    little is stranded between them) is under, the fit says so: that setting is what
    makes the row fit.

    The reserved peak is the higher of the first step's and a steady step's (NOTE [ The
    first step ] in measure/profile.py): the first step starts from an empty cache and
    lays segments out for its own order of requests, later steps reuse them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from remat.device_memory import (
    OutsideMemory,
    Term,
    Workspaces,
    outside_terms,
    workspace_terms,
)
from remat.devices import DeviceSpec, get_device
from remat.errors import message
from remat.units import format_bytes

__all__ = ["CardBudget", "CardFit", "card_budget"]


@dataclass(frozen=True)
class CardFit:
    """One step against its card (NOTE [ Fits on the card ]).

    Args:
        allocated_bytes: the step's allocated peak, tensors and workspaces, bytes.
        reserved_bytes: its predicted reserved peak, workspaces included, bytes.
        limit_bytes: capacity less the outside bytes: what ``reserved_bytes`` may reach.
        expandable_reserved_bytes: the reserved peak with ``expandable_segments:True``,
            bytes; None where not predicted.

    Example:
        >>> CardFit(70 * 2**30, 72 * 2**30, 78 * 2**30).margin_bytes / 2**30
        6.0
    """

    allocated_bytes: int
    reserved_bytes: int
    limit_bytes: int
    expandable_reserved_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("allocated_bytes", "reserved_bytes", "limit_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(message("CardFit", f"{name} must be an int >= 0",
                                         {"found": repr(value)}, fix=f"pass {name} in bytes"))
        if self.reserved_bytes < self.allocated_bytes:
            raise ValueError(message("CardFit", "reserved_bytes is below allocated_bytes",
                                     {"allocated": self.allocated_bytes,
                                      "reserved": self.reserved_bytes},
                                     fix="the allocator reserves at least what it allocates"))

    @property
    def margin_bytes(self) -> int:
        """What is left on the card at the step's reserved peak, bytes (negative: over)."""
        return self.limit_bytes - self.reserved_bytes

    @property
    def fits(self) -> bool:
        """The reserved peak, workspaces included, is within the card's limit."""
        return self.margin_bytes >= 0

    @property
    def needs_expandable_segments(self) -> bool:
        """Over with the default segments, within the limit with expandable ones."""
        return (not self.fits and self.expandable_reserved_bytes is not None
                and self.expandable_reserved_bytes <= self.limit_bytes)


@dataclass(frozen=True)
class CardBudget:
    """What one rank's step may hold on its card: NOTE [ Fits on the card ].

    Args:
        device: the card's name.
        capacity_bytes: what PyTorch reports for it, bytes.
        outside: the terms held outside the allocator (CUDA context, NCCL), by name.
        workspaces: the workspaces allocated through it (cuBLAS, cuBLASLt, cuDNN), by name.

    Example:
        >>> budget = card_budget("h100-80gb", env={})
        >>> round(budget.limit_bytes / 2**30, 2)
        78.6
    """

    device: str
    capacity_bytes: int
    outside: Mapping[str, Term] = field(default_factory=dict)
    workspaces: Mapping[str, Term] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.limit_bytes <= self.workspace_bytes:
            raise ValueError(message(
                "CardBudget", f"nothing of {self.device} is left for tensors",
                {"capacity": format_bytes(self.capacity_bytes),
                 "outside the allocator": format_bytes(self.outside_bytes),
                 "workspaces": format_bytes(self.workspace_bytes)},
                fix="check the outside-memory overrides and process groups passed"))

    @property
    def outside_bytes(self) -> int:
        """Bytes held outside PyTorch's allocator."""
        return sum(t.size_bytes for t in self.outside.values())

    @property
    def workspace_bytes(self) -> int:
        """Workspace bytes the allocator holds besides the step's tensors."""
        return sum(t.size_bytes for t in self.workspaces.values())

    @property
    def limit_bytes(self) -> int:
        """What the allocator can reserve: capacity less the outside bytes."""
        return self.capacity_bytes - self.outside_bytes

    @property
    def tensor_bytes(self) -> int:
        """What the step's tensors may reserve: the limit less the workspaces."""
        return self.limit_bytes - self.workspace_bytes

    def check(self, allocated_bytes: int, reserved_bytes: int,
              expandable_reserved_bytes: int | None = None) -> CardFit:
        """The fit of a step whose tensors peak at ``allocated_bytes`` and reserve
        ``reserved_bytes`` (workspaces added here), bytes.

        Example:
            >>> card_budget("h100-80gb", env={}).check(70 * 2**30, 71 * 2**30).fits
            True
        """
        ws = self.workspace_bytes
        return CardFit(
            allocated_bytes=allocated_bytes + ws,
            reserved_bytes=max(reserved_bytes, allocated_bytes) + ws,
            limit_bytes=max(self.limit_bytes, 0),
            expandable_reserved_bytes=None if expandable_reserved_bytes is None
            else max(expandable_reserved_bytes, allocated_bytes) + ws)


def card_budget(device: str | DeviceSpec, *, outside: OutsideMemory | None = None,
                workspaces: Workspaces | None = None, process_groups: Sequence[int] = (),
                env: Mapping[str, str] | None = None) -> CardBudget:
    """The card's budget for one rank: its capacity, the outside terms and the workspaces
    (NOTE [ Fits on the card ]).

    Args:
        device: the card (name or spec); :func:`remat.devices.current` reads yours.
        outside: overrides of the outside terms. Default: the estimates.
        workspaces: overrides of the workspaces. Default: the estimates.
        process_groups: sizes of the NCCL communicators this rank joins
            (:func:`remat.device_memory.layout_process_groups`). Default: none.
        env: the environment the estimates read. Default: ``os.environ``.

    Example:
        >>> card_budget("a100-80gb", process_groups=(8,), env={}).outside["nccl"].size_bytes > 0
        True
    """
    card = get_device(device)
    return CardBudget(
        device=card.name, capacity_bytes=card.capacity_bytes,
        outside=outside_terms(card, outside, env=env, process_groups=process_groups),
        workspaces=workspace_terms(card, workspaces, env=env))
