"""Which storages a step's forward leaves for backward, one by one, and the op that made each.

``activation_bytes`` is one number; :func:`saved_storages` lists its terms (NOTE [ Saved
storages ] in tracker.py), to check a formula term by term (benchmarks/korthikanti.py
sets the list next to Korthikanti et al.'s) or to see what a strategy keeps.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from remat.core.results import SavedStorage
from remat.errors import RematWarning, message
from remat.measure.profile import WarmFake
from remat.measure.step import LossFn, Step, clear_grads
from remat.measure.tracked_step import check_trainable, tracked_step

_API = "remat.measure.saved_storages"


def saved_storages(model: nn.Module, batch: Any, *, loss_fn: LossFn | None = None,
                   units: Sequence[str] | None = None,
                   device: torch.device | str | None = None) -> tuple[SavedStorage, ...]:
    """The storages one simulated training step's forward keeps for backward, in the
    order they were created, each with the op, shape and dtype that made it.

    The step runs on a fake copy, as :func:`~remat.measure.profile.profile_simulated`
    runs it (strategies applied to ``model`` apply to the copy); the storages' bytes sum
    to that profile's ``activation_bytes`` exactly. Naming every module as a unit (the
    default) attributes each storage to the innermost module that created it, at the
    price of a hook per module.

    Args:
        model: the model (real or on the meta device; never run), in training mode.
        batch: its batch, as for :func:`~remat.measure.profile.profile`.
        loss_fn: as for :func:`~remat.measure.profile.profile`. Default: the model's loss.
        units: qualified names of the modules to attribute storages to (innermost wins).
            Default: ``None``, every sub-module of ``model``.
        device: the device the fake tensors claim to be on. Default: each tensor's own
            device, CPU for meta tensors.

    Raises:
        ValueError: a unit names no sub-module of ``model``.

    Example:
        >>> with torch.device("meta"):
        ...     model = build_model("gpt-tiny")
        >>> saved = saved_storages(model, make_batch("gpt-tiny", 2))
        >>> sum(s.nbytes for s in saved) == profile_simulated(
        ...     model, make_batch("gpt-tiny", 2)).activation_bytes
        True
    """
    check_trainable(model, api=_API)
    step = Step(model, batch, loss_fn=loss_fn)
    warm = WarmFake(step, batch, device=device)
    modules = dict(warm.model.named_modules())
    names = [n for n in modules if n] if units is None else list(units)
    unknown = [n for n in names if n not in modules]
    if unknown:
        raise ValueError(message(_API, f"unit {unknown[0]!r} is no module of the model",
                                 {"unknown units": len(unknown),
                                  "modules": len(modules) - 1},
                                 fix="name modules as model.named_modules() does, "
                                     "e.g. 'transformer.h.0.attn'"))
    fstep = warm._step(batch)
    with warm.mode, warnings.catch_warnings():
        # hooks of units inside checkpointed regions fire again in recompute (the tracker
        # attributes recompute to the block in backward, as it should)
        warnings.simplefilter("ignore", RematWarning)
        clear_grads(warm.model)
        tracked = tracked_step(fstep, [(n, modules[n]) for n in names], record_saved=True)
    return tracked.tracker.saved_storages
