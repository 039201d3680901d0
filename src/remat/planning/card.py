"""The card a ``budget="device"`` plan is for (NOTE [ Fits on the card ] in
card_fit.py), and a step's reserved peak on it."""

from __future__ import annotations

from remat.card_fit import CardBudget, card_budget
from remat.core.allocator_settings import AllocatorSettings
from remat.core.results import Profile
from remat.device_memory import layout_process_groups
from remat.errors import message
from remat.measure.step import Step, model_device
from remat.planning.options import PlanOptions


def card_of(step: Step, options: PlanOptions) -> CardBudget:
    """The card a ``budget="device"`` plan is for (NOTE [ Fits on the card ] in
    card_fit.py): the GPU the model is on, else ``device=``; one NCCL communicator
    over the process group's ranks when one is initialized.

    Raises:
        ValueError: a model off CUDA and no ``device=`` to plan for.
    """
    import torch.distributed as dist

    from remat.devices import current, get_device

    groups = layout_process_groups(dp=dist.get_world_size()) \
        if dist.is_available() and dist.is_initialized() else ()
    where = model_device(step.model)
    if where.type == "cuda":
        return card_budget(current(where.index), process_groups=groups)
    if options.device is None:
        raise ValueError(message(
            "remat.plan", "budget='device' needs a card to plan for",
            {"model on": str(where)},
            fix="pass device='h100-80gb' (or another name in remat.devices.DEVICES, or "
                "remat.devices.current() on the GPU machine), with simulate=True on a CPU"))
    return card_budget(get_device(options.device), process_groups=groups)


def reserved_on_card(card: CardBudget, prof: Profile,
                     settings: AllocatorSettings | None = None,
                     allocated_bytes: int | None = None) -> int:
    """The step's reserved peak on ``card``, workspaces included: its allocations replayed
    through the caching allocator's model (first and steady step), bytes; never below
    ``allocated_bytes`` (the allocator's own reading where one ran; default: the
    tracker's peak).

    Example:
        >>> reserved_on_card(card, remat.profile(model, batch, simulate=True)) > 0
        True
    """
    tensors = prof.peak_bytes if allocated_bytes is None else allocated_bytes
    predicted = prof.reserved(settings or AllocatorSettings.from_env()).reserved_bytes \
        if prof.allocations is not None else tensors
    return card.check(tensors, max(predicted, tensors)).reserved_bytes
