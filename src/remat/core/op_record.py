"""One executed op of a measured step, as profiles and the planner's cost model read it.

The PyTorch tracker (``remat.measure.tracker``) records an :class:`OpRecord` per aten op
it sees, with the op's FLOPs and bytes moved (``remat.measure.flops``); a
:class:`~remat.core.results.Profile` keeps them in order. The record holds numbers and
names only, so it lives in the framework-neutral core. :data:`PHASES` names the phases
of a training step every op (and every phase peak) belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass

from remat.errors import message

PHASES: tuple[str, ...] = ("forward", "backward", "recompute", "optimizer")


@dataclass(frozen=True)
class OpRecord:
    """One aten op executed during a tracked step.

    Args:
        name: overload packet name, e.g. ``"aten.mm"``.
        phase: ``"forward"``, ``"backward"``, ``"recompute"`` or ``"optimizer"``.
        flops: FLOPs by ``torch.utils.flop_counter``'s formulas (0 for ops without one).
        read_bytes: bytes of tensor inputs (0 for views; see NOTE [ Bytes moved ] in
            ``remat/measure/flops.py``).
        write_bytes: bytes of tensor outputs (0 for views and ``aten.empty*``).
        block: qualified name of the block the op ran in, or None.
        dtype_bytes: element size of the op's first floating-point output (else first
            tensor output, else first input; 0 with no tensors): 2 selects bf16/fp16 peaks
            in the roofline.
        alloc_bytes: bytes of storages this op created (on the tracked device).

    Example:
        >>> OpRecord("aten.mm", "forward", 32768, 3072, 1024, None, 4, 1024).flops
        32768
    """

    name: str
    phase: str
    flops: int
    read_bytes: int
    write_bytes: int
    block: str | None = None
    dtype_bytes: int = 4
    alloc_bytes: int = 0

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(message("OpRecord", "unknown phase", {"found": repr(self.phase)},
                                     fix=f"pass one of {PHASES}"))
        if min(self.flops, self.read_bytes, self.write_bytes, self.dtype_bytes,
               self.alloc_bytes) >= 0:
            return  # the common case, checked at once (a step records thousands of ops)
        for name in ("flops", "read_bytes", "write_bytes", "dtype_bytes", "alloc_bytes"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(message(f"OpRecord({self.name})", f"{name} must be >= 0",
                                         {"found": value}, fix=f"pass {name} >= 0"))

    @property
    def bytes_moved(self) -> int:
        """``read_bytes + write_bytes``."""
        return self.read_bytes + self.write_bytes
