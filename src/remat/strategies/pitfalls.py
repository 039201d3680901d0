"""Pitfalls that silently corrupt or waste checkpointed training, caught at apply time.

Each check returns :class:`Pitfall` records; :func:`warn_pitfalls` turns them into
one :class:`~remat.errors.RematWarning` per kind that names the modules and the fix.

- KV cache (Hugging Face ``config.use_cache=True``): recomputing a block appends to
  the cache a second time, which fails or corrupts it; remat turns it off.
- Hugging Face's own gradient checkpointing already enabled: two layers of
  checkpointing recompute twice; remat disables the model's own.
- BatchNorm (running statistics) inside a region: recomputation would update the
  statistics twice per step; remat restores them after each recompute.
- Forward hooks on modules inside a region: they fire again on recompute.
- Model in eval mode, under ``torch.no_grad()``, or with no trainable parameter:
  nothing is saved for backward, so checkpointing does nothing.

While the model runs (runtime.py): hooks registered inside a region after ``apply``
warn once, a region running inside the model's own ``torch.utils.checkpoint`` call warns
(it would be recomputed twice), and a checkpointed module that changes its input in place
raises.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from remat.errors import RematWarning, message


@dataclass(frozen=True)
class Pitfall:
    """One detected pitfall.

    Args:
        kind: ``"use_cache"``, ``"hf_gradient_checkpointing"``, ``"batchnorm"``,
            ``"hooks"``, ``"eval_mode"``, ``"no_grad"`` or ``"frozen"``.
        module: qualified name of the module concerned (``""`` for the root).
        fixed: whether remat already handled it.
    """

    kind: str
    module: str
    fixed: bool = False


#: Per pitfall kind: what is wrong (after the module names), why it matters / what remat
#: did, and the fix (remat.errors.message's format).
_FIXES: dict[str, tuple[str, str, str]] = {
    "use_cache": (
        "config.use_cache was True",
        "recomputing a block with a stateful KV cache fails or corrupts the cache, so remat "
        "set use_cache=False for training",
        "set it back to True before generation",
    ),
    "hf_gradient_checkpointing": (
        "had the model's own gradient checkpointing (gradient_checkpointing_enable) on",
        "two layers of checkpointing would recompute twice, so remat turned it off "
        "(gradient_checkpointing_disable()) and now manages checkpointing alone",
        "nothing to do; leave gradient checkpointing to remat",
    ),
    "batchnorm": (
        "has running statistics inside a checkpointed region",
        "recomputation would update them twice per step; remat restores them after each "
        "recompute",
        "to avoid the extra copies, use LayerNorm/GroupNorm or keep these modules out of "
        "checkpointed blocks (blocks=...)",
    ),
    "hooks": (
        "has forward hooks inside a checkpointed region",
        "they fire again when the region is recomputed in backward",
        "make them idempotent, skip them while remat.recompute.is_recomputing() is True, or "
        "register them on the block itself (hooks on a checkpointed block run once)",
    ),
    "eval_mode": (
        "is in eval mode",
        "checkpointing only matters while training",
        "call model.train() before the training step",
    ),
    "no_grad": (
        "was set up under torch.no_grad()",
        "nothing is saved for backward there, so checkpointing changes nothing",
        "run the training step with gradients enabled",
    ),
    "frozen": (
        "has no parameter with requires_grad=True",
        "there is no backward pass to save activations for",
        "unfreeze the parameters to train (p.requires_grad_(True))",
    ),
}


def check_model(model: nn.Module, *, fix: bool = True) -> list[Pitfall]:
    """Whole-model pitfalls: KV cache, HF checkpointing, eval mode, no_grad, frozen.

    Args:
        model: the model about to be checkpointed.
        fix: turn off ``use_cache`` and Hugging Face's own checkpointing. Default: ``True``.
    """
    found: list[Pitfall] = []
    # Sub-models may hold their own config copy (T5's decoder stack does): check them all.
    seen_configs: set[int] = set()
    for name, module in model.named_modules():
        config = module.__dict__.get("config")
        if config is None or id(config) in seen_configs:
            continue
        seen_configs.add(id(config))
        if getattr(config, "use_cache", False) is True:
            if fix:
                config.use_cache = False
            found.append(Pitfall("use_cache", name, fixed=fix))
    # transformers >= 5 renamed gradient_* to activation_* (the old names warn).
    for flag, disable_name in (
        ("is_activation_checkpointing", "activation_checkpointing_disable"),
        ("is_gradient_checkpointing", "gradient_checkpointing_disable"),
    ):
        if not hasattr(type(model), flag) and flag not in model.__dict__:
            continue
        if getattr(model, flag, False) is True:
            disable = getattr(model, disable_name, None)
            if fix and callable(disable):
                disable()
            found.append(Pitfall("hf_gradient_checkpointing", "", fixed=fix and callable(disable)))
        break
    if not model.training:
        found.append(Pitfall("eval_mode", ""))
    if not torch.is_grad_enabled():
        found.append(Pitfall("no_grad", ""))
    if not any(p.requires_grad for p in model.parameters()):
        found.append(Pitfall("frozen", ""))
    return found


#: Modules whose forward hooks are known to do nothing on recompute (NOTE [ Hooks that
#: stay quiet on recompute ]).
_QUIET_HOOK_MODULES = ("transformers.utils.output_capturing",)

# NOTE [ Hooks that stay quiet on recompute ]
#   transformers (>= 5) installs forward hooks on attention and router modules to collect
#   outputs (``output_attentions``, router logits) while the model's forward runs. They read
#   a context variable that is set only inside that forward and return at once otherwise,
#   so the recompute in backward (after the forward returned) does nothing with them. A
#   warning about them is noise the user cannot act on; every other hook still warns.


def _has_forward_hooks(module: nn.Module) -> bool:
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    return any(getattr(h, "__module__", None) not in _QUIET_HOOK_MODULES for h in hooks)


def check_regions(model: nn.Module, regions: Sequence[nn.Module]) -> list[Pitfall]:
    """Pitfalls inside checkpointed regions: BatchNorm statistics and descendants' hooks."""
    names = {id(m): name for name, m in model.named_modules()}
    found: list[Pitfall] = []
    global_hooks = bool(
        nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks
    )
    for region in regions:
        for sub in region.modules():
            name = names.get(id(sub), type(sub).__name__)
            if isinstance(sub, nn.modules.batchnorm._NormBase) and sub.track_running_stats:
                found.append(Pitfall("batchnorm", name, fixed=True))
            if sub is not region and _has_forward_hooks(sub):
                found.append(Pitfall("hooks", name))
    if global_hooks and regions:
        found.append(Pitfall("hooks", "<global nn.Module forward hooks>"))
    return found


def warn_pitfalls(pitfalls: Sequence[Pitfall], *, api: str = "remat.apply",
                  model_name: str = "model") -> None:
    """Emit one RematWarning per pitfall kind, naming the modules and the fix."""
    by_kind: dict[str, list[str]] = {}
    for pitfall in pitfalls:
        by_kind.setdefault(pitfall.kind, []).append(pitfall.module or model_name)
    for kind, modules in by_kind.items():
        shown = ", ".join(repr(m) for m in modules[:4])
        more = f" and {len(modules) - 4} more" if len(modules) > 4 else ""
        what, why, fix = _FIXES[kind]
        warnings.warn(message(api, f"{shown}{more} {what}", {"why": why}, fix=fix),
                      RematWarning, stacklevel=3)
