"""torch.compile with the compiler's own activation memory budget, per model or per block.

Lives at the strategies level so :func:`remat.apply` can compile a plan's blocks as the
plan records (``Plan.compiled``) and the planner can compile candidates.

``torch._functorch.config.activation_memory_budget`` (0.0 to 1.0) tells AOTAutograd's
min-cut partitioner what fraction of the activations to keep; below 1.0 it
recomputes (matmuls included) to save the rest. It is a global setting read when a
graph is partitioned, and dynamo reuses compiled graphs across ``torch.compile``
calls that share a backend, so setting it globally between two compiles does not
do what it says (see NOTE [ One backend per compile ] in
``remat/compiled/graphs.py``). These helpers give every compile its own
:class:`~remat.compiled.graphs.CountingBackend`, which patches the budget
only while inductor compiles and logs the partitioned graphs' FLOPs, so
:func:`remat.compiled.measure.profile_compiled` can report compiled FLOPs and
recompute exactly.

NOTE [ One backend per kind of block ]
    Dynamo keeps at most ``torch._dynamo.config.recompile_limit`` (8) compiled
    entries per code object, and every backend is a separate entry: one backend
    per block would make the 9th block of a 12-layer model silently run eagerly.
    Blocks that compile to the same graph (same class, same parameter shapes, same
    remat regions and budget) therefore share one backend, and dynamo reuses one
    compiled graph for all of them (it inlines ``nn.Module`` calls, so parameters
    are graph inputs); each kind of block costs one entry. ``profile_compiled``
    attributes that graph to every block that shares it (each runs it once).

Example::

    >>> compiled = compile_with_budget(model, 0.5)             # whole model
    >>> compile_blocks_with_budget(model, 0.5)                 # each block, in place
    >>> compile_blocks_with_budget(model, {"blocks.0": 0.0})   # one block only
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from torch import nn

from remat.blocks import BlocksSpec, named_blocks
from remat.compiled.graphs import CountingBackend, GraphLog, register_backend
from remat.errors import StrategyError, message
from remat.strategies.regions import method_regions, region_of

#: The key of ``Plan.compiled`` that stands for the whole model (its qualified name).
WHOLE_MODEL = ""

M = TypeVar("M", bound=nn.Module)

_API = "remat.compiled.install"
#: Backends shared across compiles, keyed by (budget, block fingerprint).
BackendCache = dict[tuple[Any, ...], CountingBackend]


def check_compilable(model: nn.Module, *, api: str = "remat.integrations.compile") -> None:
    """Raise when the strategy on ``model`` cannot be compiled block by block.

    Raises:
        StrategyError: a ``sqrt`` segment is installed (see NOTE [ Compiling
            checkpointed blocks ] in ``remat/integrations/compile.py``).
    """
    for name, module in model.named_modules():
        info = region_of(module)
        if info is not None and info.kind == "segment":
            raise StrategyError(message(
                api, f"block {name!r} is part of a {info.label!r} segment",
                {"why": "one region spread over several blocks' calls and driven by Python "
                        "state between them, which torch.compile cannot trace block by block"},
                fix=f"use 'full', 'every:N', 'ops' or a plan with per-block compile, or leave "
                    f"{info.label!r} blocks uncompiled"))


def check_compiled(compiled: Mapping[str, Any], names: tuple[str, ...], *,
                   api: str) -> dict[str, float]:
    """A plan's ``compiled`` map checked: block names -> compiler budgets in [0, 1], or
    ``{"": budget}``: the whole model compiled at one budget (:data:`WHOLE_MODEL`).

    ``api`` (e.g. ``"Plan"``) starts the error messages.

    Raises:
        ValueError: a name that is not a block, ``""`` with block names, or a budget
            outside [0, 1].
    """
    if not isinstance(compiled, Mapping):
        raise ValueError(message(api, "compiled must map block names to compiler budgets",
                                 {"found": type(compiled).__name__},
                                 fix='pass {"block name": budget, ...} or {"": budget}'))
    if WHOLE_MODEL in compiled and len(compiled) > 1:
        raise ValueError(message(
            api, f"compiled names the whole model ({WHOLE_MODEL!r}) and blocks",
            {"blocks": sorted(k for k in compiled if k)[:3]},
            fix="name the whole model or blocks, not both"))
    out: dict[str, float] = {}
    for name, value in compiled.items():
        if name not in names and name != WHOLE_MODEL:
            raise ValueError(message(api, f"compiled names {name!r}, which is not a block",
                                     {"block_names": ", ".join(names[:4])},
                                     fix="name blocks of block_names"))
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(message(api, f"compiled[{name!r}] must be a number",
                                     {"found": repr(value)},
                                     fix="pass a compiler budget in [0, 1]"))
        _check_budget(float(value), api, f" compiled[{name!r}]")
        out[str(name)] = float(value)
    return out


def compile_plan(model: nn.Module, compiled: Mapping[str, float], blocks: BlocksSpec = None,
                 backends: BackendCache | None = None) -> None:
    """Compile ``model`` as a plan's ``compiled`` map says: each named block in place at its
    budget, or (``{"": budget}``) the whole model in place at one budget."""
    if WHOLE_MODEL in compiled:
        compile_with_budget(model, compiled[WHOLE_MODEL], in_place=True)
    else:
        compile_blocks_with_budget(model, compiled, blocks=blocks, backends=backends)


def uncompile(model: nn.Module) -> None:
    """Undo ``module.compile()`` on ``model`` and its submodules (they run eagerly again;
    dynamo's caches are left alone)."""
    for module in model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None


def _check_budget(budget: float | None, api: str, where: str = "") -> None:
    if budget is not None and not 0.0 <= budget <= 1.0:
        raise ValueError(message(
            api, f"budget{where} must be in [0, 1]", {"found": budget},
            fix="pass the fraction of activations the partitioner keeps (1.0 = inductor's "
                "default)"))


def compile_with_budget(model: M, budget: float | None = None, *, in_place: bool = False,
                        log: GraphLog | None = None, **compile_kwargs: Any) -> M:
    """Compile ``model`` whole with inductor at activation memory budget ``budget``.

    Args:
        model: the module to compile.
        budget: ``activation_memory_budget`` in [0, 1]; ``None`` keeps whatever
            ``torch._functorch.config`` holds at compile time. Default: ``None``.
        in_place: compile with ``model.compile`` (returns ``model``; ``state_dict``
            keys unchanged) instead of ``torch.compile(model)`` (returns an
            ``OptimizedModule`` wrapping it). Default: ``False``.
        log: a :class:`GraphLog` to record the compiled graphs in. Default: a new one
            (reachable as ``backend_of(result).log``).
        **compile_kwargs: passed to ``torch.compile`` (``fullgraph=``, ``dynamic=``).
            ``backend=`` is not allowed: the backend is inductor, wrapped.

    Returns:
        The compiled model (``model`` itself when ``in_place``).

    Raises:
        ValueError: budget outside [0, 1], or a ``backend=`` argument.
    """
    api = f"{_API}.compile_with_budget"
    _check_budget(budget, api)
    if "backend" in compile_kwargs:
        raise ValueError(message(api, "backend= is not accepted",
                                 {"why": "the backend is remat's counting wrapper around "
                                         "inductor"},
                                 fix="leave backend= out, or call torch.compile yourself "
                                     "for other backends"))
    backend = CountingBackend(budget, label="" if in_place else "model", log=log)
    if in_place:
        model.compile(backend=backend, **compile_kwargs)
        register_backend(model, backend)
        return model
    import torch

    compiled = torch.compile(model, backend=backend, **compile_kwargs)
    assert isinstance(compiled, nn.Module)  # torch.compile of a module wraps it
    register_backend(compiled, backend)
    register_backend(model, backend)
    return compiled  # type: ignore[return-value]


def compile_blocks_with_budget(model: M, budget: float | None | Mapping[str, float | None],
                               *, blocks: BlocksSpec = None, log: GraphLog | None = None,
                               backends: BackendCache | None = None,
                               **compile_kwargs: Any) -> M:
    """Compile each block of ``model`` in place, each with its own budget and backend.

    A block-level counterpart of :func:`remat.integrations.compile.compile_blocks` (same
    in-place ``Module.compile``, same refusal of ``sqrt`` segments) where the blocks'
    graphs are logged (per-block FLOPs, recompute and saved bytes in
    ``profile_compiled``) and each block can take its own budget. Identical blocks
    at the same budget share one backend and one compiled graph (NOTE [ One backend
    per kind of block ]).

    Args:
        model: the model, with any remat strategy already applied.
        budget: one budget for every block, or ``{qualified_name: budget}`` (blocks not
            named are left uncompiled). ``None`` keeps ``torch._functorch.config``'s value.
        blocks: which modules are blocks (see :func:`remat.find_blocks`). Default: automatic.
        log: one :class:`GraphLog` shared by every block's backend. Default: one per block.
        backends: a dict to take backends from and add new ones to, so compiling the
            same kind of block at the same budget again (the planner trying several
            mixtures) reuses dynamo's compiled graph instead of adding a cache entry.
            Default: a new dict (a fresh compile).
        **compile_kwargs: passed to ``Module.compile`` (not ``backend=``).

    Returns:
        ``model``.

    Raises:
        ValueError: a budget outside [0, 1], a name in ``budget`` that is not a block,
            or ``backend=``.
        StrategyError: the model has ``sqrt`` segments.
    """
    api = f"{_API}.compile_blocks_with_budget"
    if "backend" in compile_kwargs:
        raise ValueError(message(api, "backend= is not accepted",
                                 {"why": "the backend is remat's counting wrapper around "
                                         "inductor"}, fix="leave backend= out"))
    check_compilable(model, api=api)
    named = named_blocks(model, blocks, api=api)
    if isinstance(budget, Mapping):
        unknown = sorted(set(budget) - {name for name, _ in named})
        if unknown:
            raise ValueError(message(api, f"{unknown} are not blocks of {type(model).__name__}",
                                     {"blocks": ", ".join(n for n, _ in named)},
                                     fix="key budgets by block names"))
        chosen = {name: budget[name] for name, _ in named if name in budget}
    else:
        chosen = {name: budget for name, _ in named}
    for name, value in chosen.items():
        _check_budget(value, api, f" for {name!r}")
    shared: BackendCache = backends if backends is not None else {}
    for name, block in named:
        if name not in chosen:
            continue
        key = (chosen[name], _fingerprint(block))
        backend = shared.get(key)
        if backend is None:  # See NOTE [ One backend per kind of block ]
            backend = shared[key] = CountingBackend(chosen[name], label=name, log=log)
        block.compile(backend=backend, **compile_kwargs)
        register_backend(block, backend)
    return model


def _fingerprint(block: nn.Module) -> tuple[Any, ...]:
    """What decides a block's compiled graph besides its shapes: its class and the remat
    regions installed on it and its submodules (kind, decision, saved ops)."""
    regions = []
    for sub_name, sub in block.named_modules():
        infos = {"": region_of(sub), **method_regions(sub)}
        for method, info in infos.items():
            if info is not None:
                regions.append((sub_name, method, info.kind, info.label,
                                tuple(sorted(info.save_ops)) if info.save_ops else None))
    shapes = tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters())
    return (type(block), tuple(regions), shapes)
