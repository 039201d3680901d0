"""The tracked step: one training step under the storage-level tracker, and the checks
that a model has a training step to measure."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

from remat.errors import message
from remat.measure.step import Step, batch_tensors
from remat.measure.tracker import MemoryTracker

_API = "remat.profile"


# ---- checks and block lookup -------------------------------------------------------------

def check_trainable(model: nn.Module, *, api: str = _API,
                    why: str = "there is no training step to measure (dropout off, nothing "
                               "to checkpoint)") -> None:
    """Refuse what has no training step: not a module, eval mode, nothing requires grad."""
    if not isinstance(model, nn.Module):
        raise TypeError(message(api, "model must be an nn.Module",
                                {"found": type(model).__name__}, fix="pass a torch.nn.Module"))
    if not model.training:
        raise ValueError(message(api, f"{type(model).__name__} is in eval mode",
                                 {"so": why}, fix="call model.train() first"))
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(message(
            api, f"no parameter of {type(model).__name__} requires grad, so there is nothing "
            "to train", {"parameters": sum(1 for _ in model.parameters())},
            fix="unfreeze some with p.requires_grad_(True)"))


# ---- the tracked step --------------------------------------------------------------------

@dataclass
class Tracked:
    """A finished tracked step: the tracker, the registered bytes, the gradient bytes."""

    tracker: MemoryTracker
    static: dict[str, int]
    grad_bytes: int

    def resident_fields(self) -> dict[str, int]:
        """The :class:`~remat.core.results.Profile` fields of what the step holds
        besides activations: parameter, buffer, gradient, optimizer-state and batch
        bytes."""
        return {"param_bytes": self.static.get("params", 0),
                "buffer_bytes": self.static.get("buffers", 0),
                "grad_bytes": self.grad_bytes,
                "optimizer_bytes": self.static.get("optimizer_state", 0),
                "batch_bytes": self.static.get("batch", 0)}


def tracked_step(step: Step, blocks: Sequence[tuple[str, nn.Module]], *,
                 after_op: Callable[[MemoryTracker], None] | None = None,
                 record_saved: bool = False) -> Tracked:
    """One step of ``step`` under a tracker attributing to ``blocks``; ``after_op(tracker)``
    runs after every op (a listener reading the tracker's state as the step goes);
    ``record_saved`` fills the tracker's ``saved_storages`` (NOTE [ Saved storages ])."""
    model, optimizer = step.model, step.optimizer
    tracker = MemoryTracker(device=step.device, blocks=blocks, record_saved=record_saved)
    if after_op is not None:
        listener = after_op
        tracker.after_op = lambda: listener(tracker)
    tracker.register_step(model, optimizer, batch_tensors(step.batch))
    static = tracker.current_breakdown
    grad_bytes = 0

    def on_phase(phase: str) -> None:
        nonlocal grad_bytes
        if phase in ("optimizer", "end") and tracker.phase == "backward":
            grad_bytes = tracker.bytes_of(p.grad for p in model.parameters())
        if phase != "end":
            tracker.set_phase(phase)

    with held_gc(), tracker:
        step.run(on_phase)
    return Tracked(tracker, static, grad_bytes)


@contextmanager
def held_gc() -> Iterator[None]:
    """No automatic garbage collection inside the block (restored afterwards).

    Automatic collection would free cyclic garbage at arbitrary moments, and differently
    in real and fake runs (they allocate different Python objects), so every tracked run
    holds it: what a run measures then never depends on when the collector ran. Cyclic
    garbage of *earlier* runs cannot show either way: its storages are not in the new
    tracker's ledger.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
