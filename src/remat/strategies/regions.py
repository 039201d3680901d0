"""Install checkpointed regions on modules without changing the module tree.

A region replaces a module's *instance* ``forward`` with one that runs the
original forward under non-reentrant ``torch.utils.checkpoint`` (or under
:func:`~remat.strategies.offload.offloading` for offload; both, the checkpoint's inputs
offloaded, for ``full_offload``). Nothing is wrapped or renamed, so
``state_dict()`` keys, ``named_parameters()``, ``find_blocks`` and FSDP2's
per-module hooks see exactly the modules they saw before.

NOTE [ Instance forward ]
    ``nn.Module.__call__`` looks ``self.forward`` up on the instance first. The
    override is a :class:`~remat.strategies.runtime.BoundForward` bound to the module
    (a picklable bound method, NOTE [ Picklable regions ]), so ``copy.deepcopy``, the
    fake-tensor copies and ``torch.save``/``torch.load`` rebind it to the copy; the
    original forward is found again at call time (``type(module).forward``, or a
    forward the instance already had, kept in ``_remat_prev_forward``). Hooks on
    the module itself stay outside the region and fire once; hooks on its
    descendants run again on recompute (pitfalls.py warns about them at apply
    time, runtime.py about hooks registered later).

NOTE [ Method regions ]
    A sub-layer written as a method of a block (NOTE [ Method sub-layers ] in
    remat/blocks.py) is made a region the same way: an instance attribute named like
    the method, a :class:`~remat.strategies.runtime.BoundForward` binding the module
    and a marker naming the method (``_Method``), shadows the class's function (an
    instance attribute wins over a function on the class), so
    ``self._attention_forward(x, mask)`` in the block's forward runs the region. The
    region functions are the forward's own: the marker, passed first, says which
    region and function a call is for (``_region_call``), so a region stays one frame
    from ``BoundForward`` to ``checkpoint``, which ``torch.compile`` needs (a graph
    break in a nested helper costs a frame and recompiles of its own). Its
    :class:`RegionInfo` is kept per method name in the module's ``_remat_methods``, and
    an instance attribute the method already had in ``_remat_prev_methods``; both dicts
    are replaced, never changed in place, so a saved copy (``preserved_strategy``) stays
    what it was. ``state_dict()`` and the module tree do not change; :func:`uninstall`
    removes method regions with the module's own, and copies and pickles rebind them
    like a forward.

NOTE [ Segments ]
    ``sqrt`` makes several consecutive blocks one region. The parent module's loop
    (``for block in blocks: x = block(x, ...)``) stays as it is: the first block
    opens the region (``_checkpoint_without_reentrant_generator``, the same
    machinery as ``torch.distributed._composable.checkpoint``), every block
    records its own arguments with the hidden state replaced by a marker, and
    the last block closes it. Recomputation replays the blocks in order, feeding
    each block's output to the next. Each forward pass keeps its own record, so
    several forwards before one backward stay correct.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.checkpoint import (
    _checkpoint_without_reentrant_generator,
    checkpoint,
    noop_context_fn,
)

from remat.errors import RematError, message
from remat.recompute import recomputing
from remat.strategies.dead_ops import mark_region_outputs
from remat.strategies.offload import offloading, offloading_inputs, offloads_from
from remat.strategies.runtime import (
    BoundForward,
    HookWatch,
    check_inputs_unchanged,
    check_outer_checkpoint,
    check_save_ops_once,
    input_versions,
    restore_running_stats,
    stateful_modules,
)
from remat.strategies.sac import sac_context_fn

__all__ = [
    "RegionInfo",
    "has_region",
    "install_checkpoint",
    "install_offload",
    "install_offloaded_checkpoint",
    "install_segment",
    "installed_attributes",
    "method_regions",
    "region_of",
    "uninstall",
]

_STATE = "_remat_region"
_PREV_FORWARD = "_remat_prev_forward"
_METHODS = "_remat_methods"  # method name -> RegionInfo (NOTE [ Method regions ])
_PREV_METHODS = "_remat_prev_methods"  # method name -> the instance attribute it replaced


@dataclass
class RegionInfo:
    """What remat installed on one module (kept in the module's ``__dict__``).

    Args:
        kind: ``"checkpoint"``, ``"offload"`` or ``"segment"``.
        label: the decision it implements, e.g. ``"full"``, ``"ops"``, ``"sqrt"``.
        save_ops: op names whose outputs are saved (op-level SAC), else ``None``.
        stateful: modules inside the region with running statistics (BatchNorm);
            their statistics are restored after each recompute.
        segment: the shared segment state when ``kind == "segment"``.
        sac_contexts: SAC's ``context_fn`` for ``save_ops`` (a fresh policy per call),
            made once here: under ``torch.compile`` Dynamo accepts a ``context_fn`` that
            exists before tracing, not a policy object built while tracing. Not
            pickled: made again when loaded.
        hooks: finds forward hooks registered inside the region after it was installed
            (NOTE [ Hooks registered after apply ]); set by the installer.
        save_ops_checked: whether a forward checked ``save_ops`` against the ops it ran.
    """

    kind: str
    label: str
    save_ops: frozenset[str] | None = None
    stateful: tuple[nn.Module, ...] = ()
    segment: _Segment | None = None
    sac_contexts: Callable[[], tuple[Any, Any]] | None = None
    hooks: HookWatch | None = None
    save_ops_checked: bool = False

    def __post_init__(self) -> None:
        if self.save_ops is not None and self.sac_contexts is None:
            self.sac_contexts = sac_context_fn(self.save_ops)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["sac_contexts"] = None  # a closure; see NOTE [ Picklable regions ]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__post_init__()


@dataclass(eq=False)
class _Segment:
    members: list[nn.Module]
    stateful: tuple[nn.Module, ...] = ()
    generator: Any = None
    calls: list[Any] = field(default_factory=list)
    last_output: Any = None
    position: int = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> _Segment:
        import copy

        # One segment is shared by all its members: register the copy before copying
        # the members, whose state points back here, so they share the copy too.
        clone = _Segment(members=[])
        memo[id(self)] = clone
        clone.members = copy.deepcopy(self.members, memo)
        clone.stateful = copy.deepcopy(self.stateful, memo)
        return clone


def region_of(module: nn.Module) -> RegionInfo | None:
    """The region remat installed on ``module``, or ``None``."""
    info = module.__dict__.get(_STATE)
    return info if isinstance(info, RegionInfo) else None


def method_regions(module: nn.Module) -> dict[str, RegionInfo]:
    """The regions remat installed on methods of ``module``, by method name (a copy)."""
    regions = module.__dict__.get(_METHODS)
    return dict(regions) if isinstance(regions, dict) else {}


def has_region(module: nn.Module) -> bool:
    """Whether remat installed a region on ``module``'s forward or on one of its methods."""
    return region_of(module) is not None or bool(method_regions(module))


def installed_attributes(module: nn.Module) -> dict[str, Any]:
    """The instance attributes regions put on ``module`` (and a ``forward`` it had), to
    put back after :func:`uninstall` (``module.__dict__.update(saved)``)."""
    keys = ("forward", _STATE, _PREV_FORWARD, _METHODS, _PREV_METHODS, *method_regions(module))
    return {k: module.__dict__[k] for k in keys if k in module.__dict__}


def _inner_method(module: nn.Module, method: str) -> Callable[..., Any]:
    previous = module.__dict__.get(_PREV_METHODS, {}).get(method)
    if previous is not None:
        return previous  # type: ignore[no-any-return]
    return getattr(type(module), method).__get__(module)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class _Method:
    """The first argument a method region's forward gets: which method is called."""

    name: str


def _region_call(module: nn.Module, args: tuple[Any, ...]
                 ) -> tuple[RegionInfo, Callable[..., Any], tuple[Any, ...]]:
    """The region a call is for, the function it runs, and the call's own arguments:
    ``module``'s forward, or the method named by a leading :class:`_Method`."""
    if args and isinstance(args[0], _Method):
        name = args[0].name
        return module.__dict__[_METHODS][name], _inner_method(module, name), args[1:]
    return module.__dict__.get(_STATE), _inner_forward(module), args  # type: ignore[return-value]


def _replace(module: nn.Module, key: str, value: dict[str, Any]) -> None:
    if value:
        module.__dict__[key] = value
    else:
        module.__dict__.pop(key, None)


def _set_method(module: nn.Module, method: str, fn: Callable[..., Any],
                info: RegionInfo) -> None:
    """NOTE [ Method regions ]."""
    _uninstall_method(module, method)
    if method in module.__dict__:
        previous = dict(module.__dict__.get(_PREV_METHODS, {}))
        previous[method] = module.__dict__.pop(method)
        _replace(module, _PREV_METHODS, previous)
    if info.hooks is None:
        info.hooks = HookWatch(module)
    _replace(module, _METHODS, {**method_regions(module), method: info})
    module.__dict__[method] = BoundForward(module, fn, _Method(method))


def _uninstall_method(module: nn.Module, method: str) -> None:
    regions = method_regions(module)
    if regions.pop(method, None) is None:
        return
    _replace(module, _METHODS, regions)
    module.__dict__.pop(method, None)
    previous = dict(module.__dict__.get(_PREV_METHODS, {}))
    if method in previous:
        module.__dict__[method] = previous.pop(method)
    _replace(module, _PREV_METHODS, previous)


def _inner_forward(module: nn.Module) -> Callable[..., Any]:
    previous = module.__dict__.get(_PREV_FORWARD)
    if previous is not None:
        return previous  # type: ignore[no-any-return]
    return type(module).forward.__get__(module)  # type: ignore[no-any-return]


def _set_forward(module: nn.Module, fn: Callable[..., Any], info: RegionInfo) -> None:
    if region_of(module) is not None:
        uninstall(module)
    if "forward" in module.__dict__:
        module.__dict__[_PREV_FORWARD] = module.__dict__.pop("forward")
    if info.hooks is None:
        info.hooks = HookWatch(module)
    module.__dict__[_STATE] = info
    module.__dict__["forward"] = BoundForward(module, fn)


def uninstall(module: nn.Module) -> None:
    """Restore ``module``'s own forward and methods (no-op when nothing is installed)."""
    for method in method_regions(module):
        _uninstall_method(module, method)
    if region_of(module) is None:
        return
    del module.__dict__[_STATE]
    module.__dict__.pop("forward", None)
    previous = module.__dict__.pop(_PREV_FORWARD, None)
    if previous is not None:
        module.__dict__["forward"] = previous


class _RecomputeContext:
    """The recompute's context: remat's marker, running statistics restored, and
    ``inner`` (SAC's). Re-enterable: each backward through a retained graph recomputes
    the region again under the same context object."""

    def __init__(self, inner: Any, stateful: tuple[nn.Module, ...]) -> None:
        self.inner = inner
        self.stateful = stateful
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        with contextlib.ExitStack() as undo:
            undo.push(stack)
            stack.enter_context(recomputing())
            if self.stateful:
                stack.enter_context(restore_running_stats(self.stateful))
            if self.inner is not None:
                stack.enter_context(self.inner)
            undo.pop_all()
        self._stacks.append(stack)

    def __exit__(self, *exc: Any) -> bool:
        return bool(self._stacks.pop().__exit__(*exc))


def _recompute_context(inner: Any, stateful: tuple[nn.Module, ...]) -> _RecomputeContext:
    return _RecomputeContext(inner, stateful)


def _context_fn(info: RegionInfo | None,
                stateful: tuple[nn.Module, ...]) -> Callable[[], tuple[Any, Any]]:
    sac = info.sac_contexts if info is not None else None
    # Under torch.compile the context managers must be SAC's own dispatch modes
    # (torch.utils.checkpoint asserts it), so the recompute marker is left out.
    if torch.compiler.is_compiling():
        return sac if sac is not None else noop_context_fn

    def context_fn() -> tuple[Any, Any]:
        if sac is None:
            return contextlib.nullcontext(), _recompute_context(None, stateful)
        forward_ctx, recompute_ctx = sac()
        return forward_ctx, _recompute_context(recompute_ctx, stateful)

    return context_fn


# ---- single-module checkpoint ------------------------------------------------------------

def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # One frame from BoundForward to checkpoint: see NOTE [ Method regions ].
    info, inner, args = _region_call(self, args)
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    if info.save_ops is None and torch.compiler.is_compiling():
        # Dynamo traces a checkpoint with no context_fn, or SAC's own (see _context_fn).
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
    if info.hooks is not None:
        info.hooks.check(self)
    check_outer_checkpoint(self)
    versions = input_versions(args, kwargs)
    output = checkpoint(
        inner,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=_context_fn(info, info.stateful),
        **kwargs,
    )
    mark_region_outputs(info.sac_contexts, output)
    check_inputs_unchanged(self, versions)
    check_save_ops_once(self, info)
    return output


def install_checkpoint(module: nn.Module, *, label: str = "full",
                       save_ops: frozenset[str] | None = None,
                       method: str | None = None) -> None:
    """Run ``module`` (or one of its methods) under non-reentrant checkpoint (op-level SAC
    when ``save_ops``).

    Args:
        module: the module whose forward becomes one checkpointed region.
        label: the decision name recorded for reporting. Default: ``"full"``.
        save_ops: aten op names whose outputs are kept (selective checkpointing);
            ``None`` recomputes everything. Default: ``None``.
        method: the name of a method of ``module`` to make the region instead of its
            forward (NOTE [ Method regions ]), e.g. ``"_attention_forward"``.
            Default: ``None`` (the forward).
    """
    info = RegionInfo("checkpoint", label, save_ops=save_ops, stateful=stateful_modules(module))
    if method is not None:
        _set_method(module, method, _checkpointed_forward, info)
    else:
        _set_forward(module, _checkpointed_forward, info)


# ---- offload -----------------------------------------------------------------------------

def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def _offload_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    _, inner, args = _region_call(self, args)
    first = _first_tensor(args, kwargs)
    if not torch.is_grad_enabled() or first is None or not offloads_from(first.device):
        return inner(*args, **kwargs)
    # NOTE [ Asynchronous offload ]: fake tensors (the planner's measurements) take the
    # same steps without streams, so the tracker sees the bytes the real run holds.
    with offloading(self, first.device, fake=isinstance(first, FakeTensor)):
        return inner(*args, **kwargs)


def install_offload(module: nn.Module, *, label: str = "offload",
                    method: str | None = None) -> None:
    """Keep the tensors ``module`` (or its method ``method``, NOTE [ Method regions ])
    saves for backward in (pinned) host memory.

    On a CPU-only run there is no separate host memory and this is a no-op.
    """
    if method is not None:
        _set_method(module, method, _offload_forward, RegionInfo("offload", label))
    else:
        _set_forward(module, _offload_forward, RegionInfo("offload", label))


# ---- offloaded checkpoint -----------------------------------------------------------------

def _offloaded_checkpoint_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # NOTE [ Offloaded checkpoints ] in offload.py: the checkpoint of
    # _checkpointed_forward, with the inputs it saves kept on the host.
    _, _, call_args = _region_call(self, args)
    first = _first_tensor(call_args, kwargs)
    if (first is None or not torch.is_grad_enabled() or torch.compiler.is_compiling()
            or not offloads_from(first.device)):
        return _checkpointed_forward(self, *args, **kwargs)
    with offloading_inputs(self, first.device, fake=isinstance(first, FakeTensor)):
        return _checkpointed_forward(self, *args, **kwargs)


def install_offloaded_checkpoint(module: nn.Module, *, label: str = "full_offload",
                                 method: str | None = None) -> None:
    """Checkpoint ``module`` (or its method ``method``) as :func:`install_checkpoint` does,
    keeping the inputs the checkpoint saves in (pinned) host memory (NOTE [ Offloaded
    checkpoints ] in offload.py).

    On a model on the CPU there is no separate host memory: the region is ``full``'s.
    """
    info = RegionInfo("checkpoint", label, stateful=stateful_modules(module))
    if method is not None:
        _set_method(module, method, _offloaded_checkpoint_forward, info)
    else:
        _set_forward(module, _offloaded_checkpoint_forward, info)


# ---- segments (several consecutive blocks as one region) --------------------------------

_CHAINED = object()  # stands for "the previous block's output" in recorded arguments
_GENERATOR_HAS_EARLY_STOP = "early_stop" in inspect.signature(
    _checkpoint_without_reentrant_generator
).parameters


def _hidden_state(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _replace_chained(args: tuple[Any, ...], kwargs: dict[str, Any],
                     hidden: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (
        tuple(hidden if a is _CHAINED else a for a in args),
        {k: (hidden if v is _CHAINED else v) for k, v in kwargs.items()},
    )


def _run_segment(members: list[nn.Module], calls: list[Any], *args: Any, **kwargs: Any) -> None:
    output = _inner_forward(members[0])(*args, **kwargs)
    for member, (call_args, call_kwargs) in zip(members[1:], calls[1:], strict=True):
        hidden = _hidden_state(output)
        if hidden is None:
            raise RematError(message("remat sqrt segment", f"{type(members[0]).__name__} returned "
                                     f"{type(output).__name__}, not a tensor or a tuple starting "
                                     "with one", fix="use strategy 'full' or 'every:N'"))
        args_k, kwargs_k = _replace_chained(call_args, call_kwargs, hidden)
        output = _inner_forward(member)(*args_k, **kwargs_k)


def _close_segment(segment: _Segment) -> None:
    generator, segment.generator = segment.generator, None
    segment.last_output = None
    # The recompute reads the members' recorded arguments through its runner's own
    # reference; the segment's would keep them (e.g. rotary tables) past the backward,
    # through the optimizer step, until the next forward.
    segment.calls = []
    segment.position = 0
    if generator is not None:
        with contextlib.suppress(StopIteration):
            next(generator)


def _abort_segment(segment: _Segment) -> None:
    generator, segment.generator = segment.generator, None
    segment.last_output = None
    segment.calls = []
    segment.position = 0
    if generator is not None:
        generator.close()


def _segment_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    info: RegionInfo = self.__dict__[_STATE]
    segment = info.segment
    if segment is None:
        raise RematError(message("remat", "a segment region lost its state",
                                 fix="call remat.apply again"))
    inner = _inner_forward(self)
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    if info.hooks is not None and not torch.compiler.is_compiling():
        info.hooks.check(self)
    index = next(i for i, m in enumerate(segment.members) if m is self)
    if index == 0:
        if segment.generator is not None:
            _abort_segment(segment)
        segment.calls = [None]
        runner = partial(_run_segment, segment.members, segment.calls)
        options: list[Any] = [True, _context_fn(None, segment.stateful), "default", False]
        if _GENERATOR_HAS_EARLY_STOP:
            options.append(True)
        segment.generator = _checkpoint_without_reentrant_generator(
            runner, *options, *args, **kwargs
        )
        next(segment.generator)
    else:
        if segment.generator is None or segment.position != index:
            return inner(*args, **kwargs)  # called outside the segment's usual order
        hidden = _hidden_state(segment.last_output)
        record_args = tuple(_CHAINED if a is hidden else a for a in args)
        record_kwargs = {k: (_CHAINED if v is hidden else v) for k, v in kwargs.items()}
        if hidden is None or (
            _CHAINED not in record_args and _CHAINED not in record_kwargs.values()
        ):
            _abort_segment(segment)
            raise RematError(message(
                "remat sqrt", f"block {index} of a segment ({type(self).__name__}) did not "
                "receive the previous block's output as an argument, so it cannot be replayed",
                {"why": "the model transforms the hidden state between blocks, or something "
                        "between them (e.g. FSDP2 fully_shard applied per block) rewraps it"},
                fix="use strategy 'full' or 'every:N' (one region per block), or shard each "
                    "segment as one group (remat.integrations.fsdp2.apply_fsdp does)"))
        segment.calls.append((record_args, record_kwargs))
    try:
        output = inner(*args, **kwargs)
    except BaseException:
        _abort_segment(segment)
        raise
    segment.position = index + 1
    segment.last_output = output
    if segment.position == len(segment.members):
        _close_segment(segment)
    return output


def install_segment(modules: list[nn.Module], *, label: str = "sqrt") -> None:
    """Make consecutive ``modules`` one checkpointed region (see NOTE [ Segments ]).

    Args:
        modules: blocks called one after another by their parent, each taking the
            previous one's output (or its first element) as an argument.
        label: decision name recorded for reporting. Default: ``"sqrt"``.
    """
    if not modules:
        return
    if len(modules) == 1:
        install_checkpoint(modules[0], label=label)
        return
    stateful = tuple(m for module in modules for m in stateful_modules(module))
    segment = _Segment(members=list(modules), stateful=stateful)
    for module in modules:
        _set_forward(module, _segment_forward,
                     RegionInfo("segment", label, stateful=stateful, segment=segment))


