"""What a region checks and carries at run time: a picklable bound forward, late hooks,
inputs changed in place, save sets naming ops the region never runs, BatchNorm
statistics restored after recompute.

NOTE [ Picklable regions ]
    A region is an instance ``forward`` (regions.py NOTE [ Instance forward ]). A
    ``types.MethodType`` pickles as ``getattr(module, "_checkpointed_forward")``,
    which fails on ``torch.load``: the module has no such attribute. The forward
    remat installs is a :class:`BoundForward` instead, which pickles as the module
    and the module-level function it binds (by reference), and exposes ``__self__``
    / ``__func__`` like a bound method. ``copy.deepcopy`` and the fake copies
    (measure/fake.py) rebind it to the copy through the same reduction.

NOTE [ Hooks registered after apply ]
    Forward hooks on modules inside a region fire again when the region is
    recomputed in backward. ``remat.apply`` warns about the hooks present when it
    installs the region (pitfalls.py); hooks registered later are caught here: the
    region remembers the hook-handle counter at install time
    (``RemovableHandle.next_id``, which only grows), and each forward looks for a
    hook on its descendants with a newer id. The first one found warns once per
    region. Global module hooks registered later are not reported: torch's own
    tools register them for a while (``FlopCounterMode``, ``ModTracker``) and
    only track modules; global hooks present at apply time are reported there.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from remat.errors import RematError, RematWarning, message
from remat.strategies.pitfalls import Pitfall, warn_pitfalls
from remat.strategies.sac import parse_entry


class BoundForward:
    """``fn`` bound to ``module``, as the instance forward (NOTE [ Picklable regions ]).

    Args:
        module: the module whose forward (or method) it replaces (``__self__``).
        fn: a module-level function ``fn(module, *bound, *args, **kwargs)`` (``__func__``).
        bound: picklable values passed before the call's arguments: a marker naming the
            method, for a region on a method (NOTE [ Method regions ] in regions.py).
    """

    __slots__ = ("__func__", "__self__", "bound")

    def __init__(self, module: nn.Module, fn: Callable[..., Any], *bound: Any) -> None:
        self.__self__ = module
        self.__func__ = fn
        self.bound = bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *self.bound, *args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return BoundForward, (self.__self__, self.__func__, *self.bound)

    def __repr__(self) -> str:
        on = f" {getattr(self.bound[0], 'name', self.bound[0])}" if self.bound else ""
        return (f"<remat region forward {self.__func__.__name__}{on} of "
                f"{type(self.__self__).__name__}>")


def _hook_ids(module: nn.Module) -> list[int]:
    return [*module._forward_hooks, *module._forward_pre_hooks]


class HookWatch:
    """Finds forward hooks registered inside a region after it was installed
    (NOTE [ Hooks registered after apply ])."""

    def __init__(self, region: nn.Module) -> None:
        self.mark: int | None = RemovableHandle.next_id
        self.warned = False
        self.region_name = type(region).__name__

    def __getstate__(self) -> dict[str, Any]:
        return {"mark": None, "warned": self.warned, "region_name": self.region_name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A loaded or copied region: hook ids come from another process (or are copies),
        # so the mark is set again at the first forward, above every hook present then.
        self.__dict__.update(state)

    def check(self, region: nn.Module) -> None:
        """Warn once if a descendant of ``region`` has a hook newer than the region."""
        if self.warned or torch.compiler.is_compiling():
            return
        if self.mark is None:
            present = [i for sub in region.modules() for i in _hook_ids(sub)]
            self.mark = max([RemovableHandle.next_id, *(i + 1 for i in present)])
            return
        late = [f"{self.region_name}.{name}" for name, sub in region.named_modules()
                if sub is not region and any(i >= self.mark for i in _hook_ids(sub))]
        if late:
            self.warned = True
            warn_pitfalls([Pitfall("hooks", n) for n in late],
                          api="remat (hooks registered after remat.apply)")


# NOTE [ A region inside another checkpoint ]
#     A model whose own forward wraps its blocks in ``torch.utils.checkpoint`` (a
#     ``use_reentrant=False`` call in a loop over layers, a library's own flag) and gets
#     remat's regions on the same blocks recomputes each block twice in backward: the
#     outer checkpoint re-runs the block's forward, which re-enters remat's region, which
#     is re-run again for its own saved tensors. Hugging Face's flag is turned off at
#     apply (pitfalls.py); any other is seen here: when a region's forward starts, the
#     innermost saved-tensors hooks are a checkpoint's (their pack function comes from
#     ``torch.utils.checkpoint``). One C call per region forward; the warning names the
#     module once (the warnings filter keeps one per message).
def check_outer_checkpoint(module: nn.Module) -> None:
    """Warn when ``module``'s region runs inside another non-reentrant checkpoint (NOTE
    [ A region inside another checkpoint ])."""
    if torch.compiler.is_compiling():  # dynamo would break the graph on the C call
        return
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None or getattr(top[0], "__module__", None) != "torch.utils.checkpoint":
        return
    warnings.warn(message(
        "remat", f"{type(module).__name__} is checkpointed by remat and runs inside another "
        "torch.utils.checkpoint call",
        {"why": "the outer checkpoint recomputes it in backward, and remat's region "
                "recomputes it again: its forward runs three times per step"},
        fix="remove your own checkpoint calls around the modules remat checkpoints and "
            "let remat decide, or remat.remove(model) to keep yours"),
        RematWarning, stacklevel=3)


def check_save_ops(module: nn.Module, save_ops: frozenset[str], seen: dict[str, int]) -> None:
    """Warn when a save set saves nothing, or names op calls the region never makes.

    A save set none of whose ops run saves nothing: the region recomputes everything.
    An op call (``aten.mm#3``) is specific to the forward a plan measured; one the
    region never makes saves nothing the plan counted on. A missing op *name* alone is
    fine: the default ``ops`` set names every matmul and attention kernel, and a
    region runs a few of them. ``seen`` counts the ops of one forward of the region
    (``SavePolicy.seen``).
    """
    missing = sorted(e for e in save_ops
                     if (n := parse_entry(e))[0] not in seen
                     or (n[1] is not None and n[1] >= seen[n[0]]))
    calls_missing = any("#" in e for e in missing)
    if not missing or (len(missing) < len(save_ops) and not calls_missing):
        return
    ran = ", ".join(f"{name} x{count}" if count > 1 else name for name, count in seen.items())
    warnings.warn(
        message("remat", f"the save set of {type(module).__name__}'s region names {missing}, "
                "which its forward never runs",
                {"it runs": ran or "no op",
                 "so": "those entries save nothing and the region recomputes them",
                 "likely": "the plan was made for another model, dtype or device"},
                fix="re-plan, or name ops from the list it runs"),
        RematWarning,
        stacklevel=3,
    )


def check_save_ops_once(module: nn.Module, info: Any) -> None:
    """:func:`check_save_ops` after a region's first forward under its SAC policy.

    ``info`` is the region's ``RegionInfo`` (regions.py); it records that the check ran.
    """
    policy = getattr(info.sac_contexts, "last_policy", None)
    if policy is None or info.save_ops is None or info.save_ops_checked:
        return
    info.save_ops_checked = True
    check_save_ops(module, info.save_ops, policy.seen)


def input_versions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[torch.Tensor, int]]:
    """The tensor arguments of a call and their version counters."""
    return [(v, v._version) for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]


def check_inputs_unchanged(module: nn.Module, versions: list[tuple[torch.Tensor, int]]) -> None:
    """Refuse a checkpointed module that changed one of its inputs in place.

    Raises:
        RematError: an input's version counter moved during the forward; the backward
            would fail with torch's "modified by an inplace operation".
    """
    changed = [(i, t) for i, (t, v) in enumerate(versions) if t._version != v]
    if not changed:
        return
    i, t = changed[0]
    raise RematError(message(
        "remat", f"{type(module).__name__} is checkpointed and modified its input in place",
        {"input": f"tensor argument {i}, shape {tuple(t.shape)}, version {versions[i][1]} -> "
                  f"{t._version}",
         "why": "a checkpointed module is recomputed in backward from its saved inputs, so it "
                "must not change them; the backward would fail with torch's 'one of the "
                "variables needed for gradient computation has been modified by an inplace "
                "operation'"},
        fix="make the op out of place (x = x * 2 instead of x.mul_(2)), or leave this module "
            "out of the checkpointed blocks (blocks=... or another strategy)"))


def stateful_modules(module: nn.Module) -> tuple[nn.Module, ...]:
    """Descendants whose forward updates buffers in training (BatchNorm running stats)."""
    return tuple(
        m for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
    )


@contextlib.contextmanager
def restore_running_stats(modules: tuple[nn.Module, ...]) -> Iterator[None]:
    """Put back the buffers of ``modules`` (BatchNorm running statistics) on exit."""
    saved = [
        {name: buf.clone() for name, buf in m.named_buffers(recurse=False) if buf is not None}
        for m in modules
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, buffers in zip(modules, saved, strict=True):
                for name, value in buffers.items():
                    getattr(m, name).copy_(value)
